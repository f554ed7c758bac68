"""The machinery of the path-independence tests (DESIGN section 10), shared by
`test_incremental.py` (the shapes without stages, the refusals) and
`test_incremental_subqueries.py` (stages: aggregates below joins, subqueries): two
sources in storage, Hypothesis update sequences over them, and dataflows stepped
incrementally (over random runs of times, several times in one step), from scratch
(one time a step), and hydrated late or rebuilt (`run_shape`): at every time, every
one's version has the same digest.
`TANDEM_PROPERTY_EXAMPLES` sets the number of generated sequences per shape (CI runs
the default). Every sequence inserts rows into both sources at its first time:
Hypothesis's first example would otherwise be the one that changes nothing, ever, which
costs an example's steps and checks almost nothing."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rows import assert_same_rows

import history as h
from catalog import Catalog
from replica_service import _spark
from replica_service._arrangement import Arrangement, Version
from replica_service.dataplane import StorageReader, _incremental, maintainer
from storage import Storage

EXAMPLES = int(os.environ.get("TANDEM_PROPERTY_EXAMPLES", "3"))

T_SCHEMA = "id BIGINT, k STRING, x DOUBLE, q DECIMAL(10,2), n INT"
U_SCHEMA = "id BIGINT, y INT, z STRING"

CONF = {
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.ansi.enabled": "true",
}


def spark_env(tmp_path_factory) -> Iterator[dict]:
    """A test module's storage and Spark session (its `env` fixture yields from this)."""
    root: Path = tmp_path_factory.mktemp("incremental")
    catalog = Catalog.open(f"sqlite:///{root / 'catalog.db'}")
    catalog.become_controller()
    storage = Storage(catalog, root / "blobs", fsync=False)
    session = _spark.start_session(_spark.SparkSettings("local[2]"), root / "spark", CONF)
    yield dict(storage=storage, session=session, sources=iter(range(10**6)))
    session.stop()


# --- Update sequences ----------------------------------------------------------------

values_k = st.sampled_from(["a", "b", "c", None])
values_x = st.sampled_from([0.1, 0.2, -2.5, 3.0, 1e10, 1e-9, 0.0, -0.0, None])
values_q = st.sampled_from([Decimal("1.10"), Decimal("-2.05"), Decimal("0.00"), Decimal("99999999.99"), None])
values_n = st.sampled_from([0, 1, 2, -3, None])
t_rows = st.fixed_dictionaries({"id": st.integers(0, 6), "k": values_k, "x": values_x, "q": values_q, "n": values_n})
u_rows = st.fixed_dictionaries({"id": st.sampled_from([0, 1, 2, 3, 4, 5, 6, None]), "y": st.sampled_from([0, 1, 2, 3, None]), "z": st.sampled_from(["p", "q", None])})


@st.composite
def sequences(draw):
    """Batches of changes: (t inserts, t retraction picks, u inserts, u retraction
    picks, t updates). A pick selects a live row by position, so every retraction
    retracts a row that exists; an update retracts a row and inserts a changed copy.
    The first batch inserts two rows into t and one into u at least, so that even
    Hypothesis's simplest example (which it tries first) has rows to join and group.
    Each batch is a time; `runs` (below) says which times one step covers."""
    steps = draw(st.integers(3, 5))
    return [
        (
            draw(st.lists(t_rows, min_size=2 if step == 0 else 0, max_size=6)),
            draw(st.lists(st.integers(0, 10**6), max_size=3)),
            draw(st.lists(u_rows, min_size=1 if step == 0 else 0, max_size=3)),
            draw(st.lists(st.integers(0, 10**6), max_size=2)),
            draw(st.lists(st.tuples(st.integers(0, 10**6), t_rows), max_size=2)),
        )
        for step in range(steps)
    ]


class Sources:
    """Two fresh sources in storage, their live rows, and the change of each batch."""

    def __init__(self, env) -> None:
        self.storage: Storage = env["storage"]
        number = next(env["sources"])
        self.t = self.storage.create_source(f"t{number}", T_SCHEMA).id
        self.u = self.storage.create_source(f"u{number}", U_SCHEMA).id
        self.rows = {self.t: [], self.u: []}

    def apply(self, batch) -> int:
        t_inserts, t_picks, u_inserts, u_picks, t_updates = batch
        changes = {self.t: [], self.u: []}
        for id, inserts, picks in ((self.t, t_inserts, t_picks), (self.u, u_inserts, u_picks)):
            live = self.rows[id]
            for pick in picks:
                if live:
                    changes[id].append({**live.pop(pick % len(live)), "_diff": -1})
            for row in inserts:
                live.append(row)
                changes[id].append({**row, "_diff": 1})
        for pick, row in t_updates:
            live = self.rows[self.t]
            if live:
                old = live.pop(pick % len(live))
                changes[self.t].append({**old, "_diff": -1})
                new = {**row, "id": old["id"]}
                live.append(new)
                changes[self.t].append({**new, "_diff": 1})
        time = self.storage.catalog.write_ts()
        for id, rows in changes.items():
            if rows:
                self.storage.append(id, rows, ts=time)
            else:  # no change: the upper still moves past the time
                self.storage.compare_and_append(id, self.storage.upper(id), h.Frontier(time + 1))
        return time


def runs(times: list[int], ends: frozenset[int]) -> list[list[int]]:
    """`times` cut into the runs one step each covers: a run ends at each position in
    `ends` (and at the last)."""
    cut, current = [], []
    for position, time in enumerate(times):
        current.append(time)
        if position in ends or position == len(times) - 1:
            cut.append(current)
            current = []
    return cut


run_ends = st.frozensets(st.integers(0, 5), max_size=3)
"""Where the runs of times a step covers end (positions in an example's times)."""


# --- Dataflows under test --------------------------------------------------------------


class Flow:
    """One dataflow in one session, stepped at given times; its versions as tables.
    `overlaid`: every aggregate state it keeps is a base and an overlay whatever its
    size, and the overlay is merged into a new base once it may hold more than a few
    groups (every two or three steps of these sequences), so both kinds of step are taken."""

    def __init__(self, env, name: str, sql: str, strategy: str, inputs: dict, *, overlaid: bool = False) -> None:
        session = _spark.dataflow_session(env["session"], CONF)
        desc = h.DataflowDescription(name, sql, (), (h.IndexExport(name, ()),), strategy=strategy)
        self.maintainer = maintainer(desc, session, inputs, {}, 2)
        self.overlaid = overlaid
        # Its versions, as a replica keeps an index's: each time's changes, the last whole.
        self.versions = Arrangement(name, (), h.Frontier.minimum(), h.Frontier.minimum())
        self.table: pa.Table | None = None
        self.digests: dict[int, str] = {}
        self.rows_changed: dict[int, int] = {}

    def step(self, time: int) -> pa.Table:
        return self.step_times([time])[time]

    def step_times(self, times: list[int]) -> dict[int, pa.Table]:
        """Steps over `times`, as many in each as the maintainer covers (a replica's
        steps); the version at each (read back from its changes, as reads of a
        replica's index do)."""
        versions: dict[int, pa.Table] = {}
        while times:
            covered = self.maintainer.coverable(times)
            versions.update(self._one_step(times[:covered]))
            times = times[covered:]
        return versions

    def _one_step(self, times: list[int]) -> dict[int, pa.Table]:
        with _overlay_limits(0, 8) if self.overlaid else nullcontext():
            output = self.maintainer.step(times)
            changes, table = output.versions(self.table)
            output.finish()
        by_time = dict(changes)
        unchanged = table.slice(0, 0).append_column("_diff", pa.array([], pa.int64()))
        last = Version.build(times[-1], table, ())
        if not self.versions.times:  # a hydration
            self.versions.insert(last)
        else:
            self.versions.extend([(t, by_time.get(t, unchanged)) for t in times[:-1]], last, by_time.get(times[-1], unchanged))
        self.table = table
        versions = {}
        for time in times:
            version = self.versions.version_at(time)
            versions[time], self.digests[time] = version.table, version.digest
            self.rows_changed[time] = int(pc.sum(pc.abs(by_time[time]["_diff"])).as_py() or 0) if time in by_time else 0
        assert self.digests[times[-1]] == last.digest, "the last version read back from its changes is the one computed"
        return versions


@contextmanager
def _overlay_limits(min_groups: int, max_groups: int) -> Iterator[None]:
    saved = _incremental.OVERLAY_MIN_GROUPS, _incremental.OVERLAY_MAX_GROUPS
    _incremental.OVERLAY_MIN_GROUPS, _incremental.OVERLAY_MAX_GROUPS = min_groups, max_groups
    try:
        yield
    finally:
        _incremental.OVERLAY_MIN_GROUPS, _incremental.OVERLAY_MAX_GROUPS = saved


LATER = ("late", "restored")
"""The dataflows that start halfway through a sequence: one hydrated then (`late`, as a
replica added late hydrates), and one whose state is rebuilt through the step before
(`restored`, as a replica that lost its Spark state rebuilds it)."""


def run_shape(env, name: str, sql: str, sequence, expected_sql: str, later: tuple[str, ...] = LATER, ends: frozenset[int] = frozenset()) -> None:
    """Write `sequence`, then step `sql` through its times: recomputed, one time a
    step; incrementally (its states overlaid), hydrated at the first time and then
    over the runs of times `ends` cuts (several times a step); and, from halfway, as
    each of `later`, over the same runs. At every time all have the same digest (and
    the same rows changed), and the incremental version is Spark's answer."""
    sources = Sources(env)
    storage = sources.storage
    readers = {"t": StorageReader(storage, sources.t), "u": StorageReader(storage, sources.u)}
    times = [sources.apply(batch) for batch in sequence]
    for reader in readers.values():
        reader.refresh(env["session"])
    half = len(times) // 2
    # The incremental flow's states are overlaid; the late and restored ones (small
    # states) take full steps, and all must agree.
    flows = {s: Flow(env, name, sql, s, readers, overlaid=s == "incremental") for s in ("incremental", "recompute")}
    versions: dict[str, dict[int, pa.Table]] = {kind: {} for kind in ("incremental", "recompute", *later)}
    try:
        for time in times:
            versions["recompute"].update(flows["recompute"].step_times([time]))
        versions["incremental"].update(flows["incremental"].step_times(times[:1]))
        for run in runs(times[1:], frozenset(end - 1 for end in ends)):
            versions["incremental"].update(flows["incremental"].step_times(run))
            _spark.release_dropped_proxies()
        for kind in later:
            flows[kind] = Flow(env, name, sql, "incremental", readers)
            if kind == "restored":
                # Rebuilt through the time before halfway, from where its versions are.
                flows[kind].maintainer.restore(times[half - 1])
                flows[kind].table = versions["incremental"][times[half - 1]]
                flows[kind].versions.insert(Version.build(times[half - 1], flows[kind].table, ()))
                start = half
            else:  # hydrated halfway
                versions[kind].update(flows[kind].step_times([times[half]]))
                start = half + 1
            for run in runs(times[start:], frozenset(end - start for end in ends if end >= start)):
                versions[kind].update(flows[kind].step_times(run))
        for index, time in enumerate(times):
            for kind in flows.keys() - {"incremental"}:
                if time in flows[kind].digests:
                    assert flows[kind].digests[time] == flows["incremental"].digests[time], f"{name}: {kind} differs from incremental at time {index}"
            # What status reports as the step's rows changed does not depend on the strategy.
            assert flows["incremental"].rows_changed[time] == flows["recompute"].rows_changed[time], f"{name}: rows changed at time {index}"
            expected = spark_answer(env, expected_sql, {"t": storage.read_snapshot(sources.t, time), "u": storage.read_snapshot(sources.u, time)})
            assert_same_rows(versions["incremental"][time], expected)
        # As a replica does after its steps: a dropped proxy in a reference cycle pins
        # its Dataset, plans and all, in the JVM until a cyclic collection.
        _spark.release_dropped_proxies()
    finally:
        release(flows.values(), readers.values())


def release(flows: Iterable[Flow], readers: Iterable[StorageReader]) -> None:
    """Close an example's dataflows and readers, and collect the proxies they dropped:
    the module's JVM keeps none of its Spark state (checkpoints, persisted snapshots)."""
    for flow in flows:
        flow.maintainer.close()
    for reader in readers:
        reader.close()
    _spark.release_dropped_proxies()


def spark_answer(env, sql: str, tables: dict[str, pa.Table]) -> pa.Table:
    session = _spark.dataflow_session(env["session"], CONF)
    return _spark.query(session, sql, tables).toArrow()


def check_shape(env, name: str, sql: str, expected_sql: str | None = None) -> None:
    """`run_shape` over Hypothesis's sequences, each with one of the dataflows that start
    halfway (`LATER`), in turn: both check that a dataflow started at a later time
    agrees, and each costs an example about a quarter of its time. A sequence keeps the
    one it was first run with, so that a failing example runs alike when Hypothesis
    tries it again. Spark's answer is `expected_sql`'s (the query itself by default)."""
    later_of: dict[str, str] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(sequences(), run_ends)
    def check(sequence, ends):
        later = later_of.setdefault(repr(sequence), LATER[len(later_of) % len(LATER)])
        run_shape(env, name, sql, sequence, expected_sql or sql, (later,), ends)

    check()
