"""The additive accumulators of an incremental aggregate (`_incremental`): what one
row contributes to each (a group's accumulator is their sum, over state and change, or
running over a step's times), and each aggregate's value rebuilt from them. Sums are
exact and machine-word wide wherever that stays exact: integers of every width,
decimals cut into BIGINT digits, floats cut into integer chunks held in doubles. So
every replica computes the same bits whatever order its rows were summed in."""

from __future__ import annotations

from collections.abc import Mapping

from replica_service.dataplane._plan import DIFF, AggregateCall, AggregateShape

FLOAT_TYPES = ("FLOAT", "DOUBLE")
EXTREME_FUNCTIONS = ("min", "max")
STATE_FUNCTIONS = (*EXTREME_FUNCTIONS, "count_distinct")  # not additive accumulators


def extreme_name(call: AggregateCall) -> str:
    return f"__{'mn' if call.function == 'min' else 'mx'}{call.argument}"


# Floating-point values are summed as integers: each finite x is cut into chunks of 24
# bits, three of its integral part and four of its fraction, each an integer held in a
# double. Doubles add integers below 2^53 exactly, so the chunk sums are exact (and
# cheap: plain double sums) for groups of fewer than 2^29 rows; the value is rebuilt
# from them once, in a fixed order.
_CHUNK = 2**24
_FLOAT_CHUNKS = ("i0", "i1", "i2", "f1", "f2", "f3", "f4")


def _double(value: float) -> str:
    """A DOUBLE literal (`16777216.0` alone would be a DECIMAL in Spark SQL)."""
    return f"{value!r}D"


def _floor(y: str) -> str:
    """floor(y) as a double (Spark's floor of a double is a BIGINT, which overflows);
    through `rint`, which is exact and cheap (`%` on doubles costs ten times more)."""
    return f"(rint({y}) - IF(rint({y}) > {y}, 1D, 0D))"


def _float_chunks(x: str, a: int) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The seven chunks of the double `x` (argument `a`), when finite: x = i2*2^48 +
    i1*2^24 + i0 + f1*2^-24 + f2*2^-48 + f3*2^-72 + f4*2^-96, with i0, i1, f2, f3, f4 in
    [0, 2^24) and f1 in [-2^24, 2^24) (bits below 2^-96, about 1e-29, are dropped:
    rounded down). `x` is cut into its truncated integral part and its fraction (both
    exact), then each chunk is the difference of two floors of a part scaled by powers
    of two, all exact in doubles. Returned as staged projections (each stage's columns,
    SQL over the columns before it) and the chunks over them: inlined, the SQL repeats
    `x` hundreds of times (measured: a 10M-row hydration took 59 s inlined, 0.9 s
    staged; Spark keeps a projection whose columns are read more than once)."""
    c = _double(float(_CHUNK))
    d, whole, fraction = f"__d{a}", f"__w{a}", f"__fr{a}"
    floors = {  # floor(whole * 2^p) for p = -48, -24; floor(fraction * 2^p) for p = 24 .. 96
        f"__g{a}_{i}": _floor(f"{whole if power < 0 else fraction} * {_double(2.0**power)}")
        for i, power in enumerate((-48, -24, 24, 48, 72, 96))
    }
    stages = [
        {d: f"CAST({x} AS DOUBLE)"},
        {
            whole: f"IF(abs(rint({d})) > abs({d}), rint({d}) - signum({d}), rint({d}))",
            f"__fin{a}": f"(NOT isnan({d}) AND abs({d}) != CAST('Infinity' AS DOUBLE))",
        },
        {fraction: f"{d} - {whole}"},  # in (-1, 1), the sign of x
        floors,
    ]
    high, low, f1, f2, f3, f4 = floors
    chunks = {
        "i2": high,
        "i1": f"{low} - {high} * {c}",
        "i0": f"{whole} - {low} * {c}",
        "f1": f1,
        "f2": f"{f2} - {f1} * {c}",
        "f3": f"{f3} - {f2} * {c}",
        "f4": f"{f4} - {f3} * {c}",
    }
    return stages, {name: f"IF(__fin{a}, {chunk}, 0D)" for name, chunk in chunks.items()}


def _from_chunks(sums: Mapping[str, str]) -> str:
    """The double of summed chunks: the integral chunks added first (exactly, below
    2^53), then the fraction, smallest chunk first; deterministic, and within an ulp or
    two of the exact sum."""
    whole = f"(({sums['i2']}) * {_double(float(_CHUNK**2))} + ({sums['i1']}) * {_double(float(_CHUNK))}) + ({sums['i0']})"
    fraction = " + ".join(
        f"({sums[name]}) / {_double(float(_CHUNK**power))}" for power, name in ((4, "f4"), (3, "f3"), (2, "f2"), (1, "f1"))
    )
    return f"(({whole}) + ({fraction}))"


def _decimal_type(spark_type: str) -> tuple[int, int]:
    precision, scale = (int(p) for p in spark_type[len("DECIMAL(") : -1].split(","))
    return precision, scale


_DECIMAL_CHUNK = 10**9


def _decimal_chunks(x: str, a: int, precision: int, scale: int) -> tuple[list[dict[str, str]], list[str]]:
    """The unscaled value u of the DECIMAL `x` (argument `a`) cut into signed base-10^9
    digits: u = sum(c_k * 10^(9k)), every c_k in (-10^9, 10^9) and of u's sign, each a
    BIGINT whose sum over 9e9 rows cannot overflow. Signed, a group's digit sums are no
    larger than its positive or its negative values' sums (with digits in [0, 10^9), a
    negative value's higher digits are all 999999999 and its top one -1: the sums of a
    few hundred negative values overflowed DECIMAL(38,0) when rebuilt). Exact: `x *
    10^scale` is an integer, which Spark keeps whole in 38 - min(scale, 6) digits when
    precision + min(scale, 6) > 38 (a larger value fails the step loudly, an ANSI
    overflow; Spark's own sum of such a column overflows beyond 38 - scale digits).
    Returned as staged projections (each digit's quotient is the next stage's input)
    and the chunks over them."""
    count = -(-precision // 9)
    quotients = [f"__u{a}_{k}" for k in range(count)]
    stages = [{quotients[0]: f"CAST({x} * CAST({10**scale} AS DECIMAL({scale + 1},0)) AS DECIMAL(38,0))"}]
    for k in range(1, count):
        q = quotients[k - 1]  # `%` keeps the dividend's sign (`pmod` would not)
        stages.append({quotients[k]: f"CAST(({q} - {q} % {_DECIMAL_CHUNK}) / {_DECIMAL_CHUNK} AS DECIMAL(38,0))"})
    chunks = [f"CAST({q} % {_DECIMAL_CHUNK} AS BIGINT)" for q in quotients[:-1]] + [f"CAST({quotients[-1]} AS BIGINT)"]
    return stages, chunks


def _halves(value: str, a: int) -> dict[str, str]:
    """The contributions of the BIGINT `value` (argument `a`) cut in two, its 31 low bits
    and the rest (an arithmetic shift: exact down to BIGINT's least value), so that
    their BIGINT sums cannot overflow below 2^31 rows; `_from_halves` rebuilds the sum."""
    return {f"__sl{a}": f"({value} & 2147483647) * {DIFF}", f"__sh{a}": f"shiftright({value}, 31) * {DIFF}"}


def _from_halves(values: Mapping[str, str], a: int) -> str:
    """The exact sum (a DECIMAL(38,0)) of the halves `_halves` cut."""
    return f"CAST({values[f'__sh{a}']} AS DECIMAL(38,0)) * 2147483648 + {values[f'__sl{a}']}"


def accumulators(shape: AggregateShape) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The additive accumulators kept per group, by name, each as one row's contribution
    (a group's accumulator is their sum): `__n` and, per argument, what its aggregates
    need. Machine words wherever that stays exact (Spark sums BIGINTs and doubles ten
    times faster than wide DECIMALs). Returned with the staged projections the
    contributions read (each stage's columns, SQL over the pre-aggregate columns and
    the stages before it)."""
    stages: list[dict[str, str]] = []
    contributions: dict[str, str] = {"__n": DIFF}
    for call in shape.calls:
        if call.argument is None or call.function in STATE_FUNCTIONS:
            continue
        a = call.argument
        x = f"__x{a}"
        contributions[f"__c{a}"] = f"IF({x} IS NOT NULL, {DIFF}, 0)"
        if call.function == "count":
            continue
        if call.input_type in FLOAT_TYPES:
            chunk_stages, chunks = _float_chunks(x, a)
            _merge_stages(stages, chunk_stages)
            for name, chunk in chunks.items():
                contributions[f"__{name}_{a}"] = f"{chunk} * {DIFF}"
            value = f"__d{a}"
            contributions[f"__nan{a}"] = f"IF(isnan({value}), {DIFF}, 0)"
            contributions[f"__pinf{a}"] = f"IF({value} = CAST('Infinity' AS DOUBLE), {DIFF}, 0)"
            contributions[f"__ninf{a}"] = f"IF({value} = CAST('-Infinity' AS DOUBLE), {DIFF}, 0)"
        elif call.input_type.startswith("DECIMAL") and _decimal_type(call.input_type)[0] <= 18:
            _, scale = _decimal_type(call.input_type)  # the unscaled value fits a BIGINT
            contributions.update(_halves(f"CAST({x} * {10**scale} AS BIGINT)", a))
        elif call.input_type.startswith("DECIMAL"):
            chunk_stages, digits = _decimal_chunks(x, a, *_decimal_type(call.input_type))
            _merge_stages(stages, chunk_stages)
            for k, digit in enumerate(digits):
                contributions[f"__dc{a}_{k}"] = f"{digit} * {DIFF}"
        elif call.function == "avg":  # integers: Spark's AVG sums them as doubles, which never overflow
            contributions.update(_halves(f"CAST({x} AS BIGINT)", a))
        else:  # integers: a BIGINT sum, overflowing (in ANSI mode, loudly) where Spark's does
            contributions[f"__s{a}"] = f"CAST({x} AS BIGINT) * {DIFF}"
    return stages, contributions


def _merge_stages(stages: list[dict[str, str]], more: list[dict[str, str]]) -> None:
    """Add `more`'s columns to `stages`, level by level (arguments' stages run side by side)."""
    for level, columns in enumerate(more):
        if level == len(stages):
            stages.append({})
        stages[level].update(columns)


def final(call: AggregateCall, values: Mapping[str, str]) -> str:
    """The aggregate's value as SQL over the accumulators, extremes and distinct counts
    of one side (`values`: name -> SQL; a distinct count's is `__cd<argument>`), NULL
    over no values, as Spark's aggregates."""
    a = call.argument
    if call.function == "count_rows":
        return values["__n"]
    if call.function in EXTREME_FUNCTIONS:
        return values[extreme_name(call)]
    if call.function == "count_distinct":
        return values[f"__cd{a}"]
    count = values[f"__c{a}"]
    if call.function == "count":
        return count
    floating = call.input_type in FLOAT_TYPES
    if floating:
        total = (
            f"CASE WHEN {values[f'__nan{a}']} > 0 OR ({values[f'__pinf{a}']} > 0 AND {values[f'__ninf{a}']} > 0) THEN CAST('NaN' AS DOUBLE) "
            f"WHEN {values[f'__pinf{a}']} > 0 THEN CAST('Infinity' AS DOUBLE) "
            f"WHEN {values[f'__ninf{a}']} > 0 THEN CAST('-Infinity' AS DOUBLE) "
            f"ELSE {_from_chunks({name: values[f'__{name}_{a}'] for name in _FLOAT_CHUNKS})} END"
        )
    elif call.input_type.startswith("DECIMAL"):  # its unscaled sum, in BIGINT parts
        precision, scale = _decimal_type(call.input_type)
        if precision <= 18:
            unscaled = _from_halves(values, a)
        else:
            unscaled = " + ".join(
                f"CAST({values[f'__dc{a}_{k}']} AS DECIMAL(38,0)) * CAST({_DECIMAL_CHUNK**k} AS DECIMAL(38,0))"
                for k in range(-(-precision // 9))
            )
        total = f"CAST(CAST({unscaled} AS STRING) || 'E-{scale}' AS DECIMAL(38,{scale}))"
    elif call.function == "avg":  # of integers: exact, in two halves (`_halves`)
        total = _from_halves(values, a)
    else:
        total = values[f"__s{a}"]
    if call.function == "avg":
        if floating:
            total = f"({total}) / {count}"
        elif call.input_type.startswith("DECIMAL"):
            precision, scale = _decimal_type(call.input_type)
            total = f"CAST({total} AS DECIMAL({min(38, precision + 10)},{scale})) / CAST({count} AS DECIMAL(20,0))"
        else:
            total = f"CAST({total} AS DOUBLE) / {count}"
    return f"IF({count} = 0, NULL, {total})"
