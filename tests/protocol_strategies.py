"""Hypothesis strategies for every command and response of the compute protocol.

Values are arbitrary within what the wire can carry (ints in int64, text without lone
surrogates, floats without NaN since NaN != NaN), not within what a replica would accept:
the codec must carry a dataflow without exports as faithfully as a sensible one.
`COMMANDS` and `RESPONSES` map each type to its strategy; tests check that they cover
every type of `history` and `protocol`.
"""

from __future__ import annotations

from typing import get_args

from hypothesis import strategies as st

import history as h
from protocol import HelloAck, Refusal, RefusalCode

int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)
times = st.integers(min_value=0, max_value=2**63 - 1)
counts = times  # never negative either
texts = st.text()  # any unicode; hypothesis leaves out surrogates, which UTF-8 cannot hold
ids = st.from_regex(r"[ut][0-9]{1,4}", fullmatch=True) | texts


def _tuples(strategy: st.SearchStrategy, max_size: int = 3) -> st.SearchStrategy:
    return st.lists(strategy, max_size=max_size).map(tuple)


frontiers = st.builds(h.Frontier, st.none() | times)
scalars = st.none() | st.booleans() | int64s | st.floats(allow_nan=False) | texts
scalar_tuples = _tuples(scalars, max_size=4)

imports = st.builds(h.Import, texts, ids, st.sampled_from(["storage", "index"]))

predicates = st.one_of(
    st.builds(h.Predicate, texts, st.sampled_from(["=", "!=", "<", "<=", ">", ">="]), scalars),
    st.builds(h.Predicate, texts, st.just("in"), scalar_tuples),
    st.builds(h.Predicate, texts, st.sampled_from(["is_null", "is_not_null"]), st.none()),
)

finishings = st.builds(
    h.RowSetFinishing,
    key=st.none() | scalar_tuples,
    filter=_tuples(predicates),
    order_by=_tuples(st.builds(h.OrderBy, texts, st.booleans(), st.booleans())),
    offset=int64s,
    limit=st.none() | int64s,
    projection=st.none() | _tuples(texts),
)

dataflows = st.builds(
    h.DataflowDescription,
    name=texts,
    sql=texts,
    imports=_tuples(imports),
    index_exports=_tuples(st.builds(h.IndexExport, ids, _tuples(texts))),
    sink_exports=_tuples(st.builds(h.SinkExport, ids)),
    as_of=frontiers,
    until=frontiers,
    schema=texts,
    strategy=st.sampled_from(["recompute", "incremental"]),
)

targets = st.builds(h.IndexTarget, ids) | st.builds(h.SqlTarget, texts, _tuples(imports))

COMMANDS: dict[type, st.SearchStrategy] = {
    h.Hello: st.builds(h.Hello, int64s, texts, st.none() | st.builds(h.Resume, texts, counts), st.booleans()),
    h.CreateInstance: st.builds(
        h.CreateInstance, st.builds(h.InstanceConfig.of, texts, st.dictionaries(texts, texts))
    ),
    h.InitializationComplete: st.just(h.InitializationComplete()),
    h.UpdateConfiguration: st.builds(
        h.UpdateConfiguration,
        st.builds(h.ComputeParameters, *[st.none() | int64s] * len(h.ComputeParameters.__dataclass_fields__)),
    ),
    h.CreateDataflow: st.builds(h.CreateDataflow, dataflows),
    h.Schedule: st.builds(h.Schedule, ids),
    h.AllowCompaction: st.builds(h.AllowCompaction, ids, frontiers),
    h.Peek: st.builds(h.Peek, texts, targets, times, finishings, int64s),
    h.CancelPeek: st.builds(h.CancelPeek, texts),
    h.Subscribe: st.builds(h.Subscribe, texts, ids, times, st.booleans()),
    h.CancelSubscribe: st.builds(h.CancelSubscribe, texts),
}

peek_results = st.one_of(
    st.builds(h.PeekRows, st.binary(), int64s, texts),
    st.builds(h.PeekError, texts),
    st.just(h.PeekCanceled()),
)

RESPONSES: dict[type, st.SearchStrategy] = {
    h.FrontiersResponse: st.builds(h.FrontiersResponse, ids, frontiers),
    h.PeekResponse: st.builds(h.PeekResponse, texts, peek_results),
    h.StatusResponse: st.builds(
        h.StatusResponse,
        heartbeat=int64s,
        dataflows=_tuples(
            st.builds(
                h.DataflowStatus, ids, st.booleans(), st.none() | texts, texts, int64s, int64s, int64s, st.none() | int64s, int64s, int64s
            )
        ),
        dataflows_kept=int64s,
        dataflows_built=int64s,
        pid=int64s,
        errors=_tuples(texts),
        metrics_address=texts,
    ),
    h.SubscribeResponse: st.builds(
        h.SubscribeResponse,
        texts,
        times,
        times,
        _tuples(st.builds(h.SubscribeChanges, times, st.binary(), counts)),
        st.none() | texts,
    ),
    Refusal: st.builds(Refusal, st.sampled_from(get_args(RefusalCode)), texts),
    HelloAck: st.builds(HelloAck, st.booleans(), counts),
}
