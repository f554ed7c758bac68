"""Subscriptions to storage collections through a real `Controller` (catalog, storage
and the feed; the SQL planner stands in, as in `test_runtime_ddl`): the feed is the
snapshot, then every change once in time order, with progress a client can resume from,
bounded when the client does not read, and refused with the right status before it
opens anything."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import grpc
import pyarrow as pa
import pytest
from test_client_api import ServerThread
from test_runtime_ddl import _controller, _stop

from catalog import FailedPrecondition
from controller import _subscribe
from controller._api import ControllerError, SubscribeBatch
from controller._upkeep import RETENTION_HOLDER
from controller.cli import main
from controller.client import Client, TandemError
from history import Frontier, SubscribeChanges
from protocol import table_to_ipc

SCHEMA = "id BIGINT NOT NULL, v STRING"


def consolidated(batches: list[SubscribeBatch], through: int) -> Counter:
    """The rows the feed says the collection holds at `through`: its updates there summed."""
    counts: Counter = Counter()
    for batch in batches:
        for row in batch.updates.to_pylist():
            if row["_time"] <= through:
                counts[(row["id"], row["v"])] += row["_diff"]
    return +counts


def contents(controller, name: str, time: int) -> Counter:
    id = controller.catalog.collection_by_name(name).id
    return Counter((row["id"], row["v"]) for row in controller.storage.read_snapshot(id, time).to_pylist())


def hold_for_checks(controller, name: str, time: int) -> None:
    """Keep `name` readable from `time` on, for `contents` (the feed's own hold moves on)."""
    controller.storage.acquire_read_hold(controller.catalog.collection_by_name(name).id, "checks", Frontier(time))


async def take_until(batches, progress: int, taken: list) -> None:
    async for batch in batches:
        taken.append(batch)
        if batch.progress is not None and batch.progress >= progress:
            return


def test_a_source_feed_is_its_snapshot_then_each_change_once_in_time_order(tmp_path):
    async def run() -> None:
        controller = _controller(tmp_path)
        await controller.create_source("s", SCHEMA)
        first = await controller.append("s", [{"id": 1, "v": "a"}, {"id": 2, "v": "b"}])
        hold_for_checks(controller, "s", first)
        feed = await controller.subscribe(None, "s", progress=True)
        batches, taken = aiter(feed), []
        await take_until(batches, first, taken)
        assert taken[0].progress == first and taken[0].updates.column_names == ["id", "v", "_time", "_diff"]
        assert consolidated(taken, first) == contents(controller, "s", first)
        times = [first]
        for rows in (
            [{"id": 1, "v": "a", "_diff": -1}, {"id": 3, "v": "c"}],  # an update as retract + insert
            [{"id": 3, "v": "c", "_diff": -1}],  # a row that vanishes
            [{"id": 4, "v": None}, {"id": 4, "v": None}],  # a NULL, twice
        ):
            times.append(await controller.append("s", rows))
            await take_until(batches, times[-1], taken)
        for time in times:  # the feed consolidated through any time is the source then
            assert consolidated(taken, time) == contents(controller, "s", time), time
        delivered = [row["_time"] for batch in taken for row in batch.updates.to_pylist()]
        assert delivered == sorted(delivered) and set(delivered) == set(times)  # time order, no gaps
        progress = [b.progress for b in taken]
        assert progress == sorted(progress)  # never back
        await feed.close()
        id = controller.catalog.collection_by_name("s").id
        assert feed.holder not in dict(controller.catalog.manifest(id).holds)  # the feed's hold went with it
        await _stop(controller)

    asyncio.run(run())


def test_a_client_resumes_from_the_last_progress_it_saw_and_up_to_ends_the_feed(tmp_path):
    async def run() -> None:
        controller = _controller(tmp_path)
        await controller.create_source("s", SCHEMA)
        first = await controller.append("s", [{"id": 1, "v": "a"}])
        hold_for_checks(controller, "s", first)
        feed = await controller.subscribe(None, "s", as_of=first)
        taken: list = []
        await take_until(aiter(feed), first, taken)
        await feed.close()  # the client lost its stream here
        second = await controller.append("s", [{"id": 2, "v": "b"}])
        third = await controller.append("s", [{"id": 1, "v": "a", "_diff": -1}])
        resumed = await controller.subscribe(None, "s", as_of=taken[-1].progress, snapshot=False, up_to=third)
        rest = [batch async for batch in resumed]  # ends by itself: up_to
        await resumed.close()
        assert [row["_time"] for batch in rest for row in batch.updates.to_pylist()] == [second]  # not the first, not the third
        assert consolidated(taken + rest, second) == contents(controller, "s", second)
        await _stop(controller)

    asyncio.run(run())


def test_a_client_that_does_not_read_is_dropped_with_where_to_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(_subscribe, "QUEUE_BATCHES", 3)

    async def run() -> None:
        controller = _controller(tmp_path)
        await controller.create_source("s", SCHEMA)
        first = await controller.append("s", [{"id": 1, "v": "a"}])
        feed = await controller.subscribe(None, "s", as_of=first, progress=True)
        batches = aiter(feed)
        snapshot = await anext(batches)
        for n in range(6):  # the client reads nothing more meanwhile
            await controller.append("s", [{"id": 10 + n, "v": "x"}])
            await asyncio.sleep(0.1)
        with pytest.raises(ControllerError) as refused:
            async for _ in batches:
                pass
        assert refused.value.code == "RESOURCE_EXHAUSTED"
        assert f"subscribe again with as_of={snapshot.progress} and snapshot off" in refused.value.message
        await feed.close()
        await _stop(controller)

    asyncio.run(run())


def test_bad_subscriptions_are_refused_and_open_nothing(tmp_path):
    async def run() -> None:
        controller = _controller(tmp_path)
        await controller.create_instance("main")
        await controller.create_source("s", SCHEMA)
        first = await controller.append("s", [{"id": 1, "v": "a"}])
        second = await controller.append("s", [{"id": 2, "v": "b"}])
        id = controller.catalog.collection_by_name("s").id
        # The retention window moved past `first` (a source holds it from its creation):
        # with only these holds, its since moves to `second`.
        controller.storage.acquire_read_hold(id, "later", Frontier(second))
        controller.storage.downgrade_read_hold(id, RETENTION_HOLDER, Frontier(second))
        await controller.create_dataflow("main", "idx", "select * from s", index_key=["id"])
        refusals = {}
        for call in (
            lambda: controller.subscribe(None, "nothing"),
            lambda: controller.subscribe("nowhere", "s"),
            lambda: controller.subscribe(None, "s", as_of=first),
            lambda: controller.subscribe(None, "s", as_of=second, up_to=second),
            lambda: controller.subscribe(None, "s", as_of=-1),
            lambda: controller.subscribe("main", "nothing"),
            lambda: controller.subscribe("main", "idx", as_of=first),  # an index: the instance checks
            lambda: controller.subscribe("main", "idx", as_of=second, up_to=second),
        ):
            with pytest.raises(ControllerError) as refused:
                await call()
            refusals[refused.value.code] = refusals.get(refused.value.code, []) + [refused.value.message]
        assert sorted(refusals) == ["FAILED_PRECONDITION", "INVALID_ARGUMENT", "NOT_FOUND"]
        assert len(refusals["NOT_FOUND"]) == 3 and len(refusals["INVALID_ARGUMENT"]) == 3
        assert [f"its since is {second}" in message for message in refusals["FAILED_PRECONDITION"]] == [True, True]
        instance = controller._driver("main")
        assert not instance.feeds and not instance.instance.subscriptions
        # An open index feed ends, it does not hang, when its instance goes.
        feed = await controller.subscribe("main", "idx")
        assert list(instance.feeds) == [feed.uuid] and list(instance.instance.subscriptions) == [feed.uuid]
        await controller.drop_instance("main")
        with pytest.raises(ControllerError) as ended:
            async for _ in feed:
                pass
        assert ended.value.code == "UNAVAILABLE" and "instance main" in ended.value.message
        # The since can move between the check and the hold: the hold is refused then.
        late = _subscribe.StorageFeed(controller.storage, _subscribe.FeedRequest(id, "s", first, None, True, False), controller.open_feeds)
        with pytest.raises(FailedPrecondition, match=f"as of {first}"):
            late.hold()
        assert not controller.open_feeds()
        assert not [holder for holder, _ in controller.catalog.manifest(id).holds if holder.startswith("subscribe:")]
        await _stop(controller)

    asyncio.run(run())


def test_the_feed_crosses_grpc_to_the_client_and_the_cli(tmp_path, capsys):
    server = ServerThread(_controller(tmp_path))
    try:
        with Client.connect(server.address, timeout=10) as client:
            client.create_source("s", SCHEMA)
            first = client.append("s", [{"id": 1, "v": "a"}])
            hold_for_checks(server.api, "s", first)  # each feed below starts there
            second = client.append("s", [{"id": 1, "v": "a", "_diff": -1}, {"id": 2, "v": None}])
            batches = list(client.subscribe(None, "s", as_of=first, up_to=second + 1))  # ends by itself
            assert [b.progress for b in batches] == [first, second]
            assert [row for b in batches for row in b.updates.to_pylist()] == [
                {"id": 1, "v": "a", "_time": first, "_diff": 1},
                {"id": 1, "v": "a", "_time": second, "_diff": -1},
                {"id": 2, "v": None, "_time": second, "_diff": 1},
            ]
            with pytest.raises(TandemError) as refused:
                next(client.subscribe(None, "s", as_of=first, up_to=first))
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "up_to" in refused.value.message
            with pytest.raises(TandemError) as refused:
                next(client.subscribe(None, "nothing"))
            assert refused.value.code == grpc.StatusCode.NOT_FOUND

        argv = ["subscribe", "-", "s", "--as-of", str(first), "--up-to", str(second + 1), "--address", server.address]
        assert main([*argv, "--no-snapshot", "--json", "--progress"]) == 0
        printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert printed == [
            {"time": second, "diff": -1, "row": {"id": 1, "v": "a"}},
            {"time": second, "diff": 1, "row": {"id": 2, "v": None}},
            {"progress": second},
        ]
        assert main(argv) == 0
        assert capsys.readouterr().out.splitlines()[0] == f'{first}  +1  {{"id": 1, "v": "a"}}'
    finally:
        server.close()


def _changes(time: int, *rows: tuple[int, str, int]) -> SubscribeChanges:
    table = pa.Table.from_pylist(
        [{"id": id, "v": v, "_time": time, "_diff": diff} for id, v, diff in rows],
        pa.schema([("id", pa.int64()), ("v", pa.string()), ("_time", pa.int64()), ("_diff", pa.int64())]),
    )
    return SubscribeChanges(time, table_to_ipc(table), table.num_rows)


def _index_feed(canceled: list, **request) -> _subscribe.IndexFeed:
    options = {"as_of": 5, "up_to": None, "snapshot": True, "progress": False, **request}
    empty = pa.schema([("id", pa.int64()), ("v", pa.string()), ("_time", pa.int64()), ("_diff", pa.int64())]).empty_table()
    return _subscribe.IndexFeed(_subscribe.FeedRequest("u9", "idx", **options), "s1", empty, canceled.append)


def test_an_index_feed_queues_what_the_instance_forwards_and_cuts_it_at_up_to():
    async def run() -> None:
        canceled: list[str] = []
        feed = _index_feed(canceled, up_to=9)
        feed.forward((), 5)  # an empty snapshot still opens the feed
        feed.forward((), 6)  # progress alone: not asked for
        feed.forward((_changes(7, (1, "a", 1)),), 7)
        feed.forward((_changes(8, (1, "a", -1)), _changes(9, (2, "b", 1))), 12)  # past up_to
        batches = [batch async for batch in feed]
        assert [(b.progress, b.updates.to_pylist()) for b in batches] == [
            (5, []),
            (7, [{"id": 1, "v": "a", "_time": 7, "_diff": 1}]),
            (8, [{"id": 1, "v": "a", "_time": 8, "_diff": -1}]),
        ]
        assert canceled == ["s1"]  # up_to reached: the subscription is closed
        feed.forward((_changes(13, (3, "c", 1)),), 14)  # too late: nothing more
        await feed.close()
        assert canceled == ["s1"]

    asyncio.run(run())


def test_an_index_feed_a_client_does_not_read_ends_resource_exhausted_and_closes():
    async def run() -> None:
        canceled: list[str] = []
        feed = _index_feed(canceled, snapshot=False, progress=True)
        for time in range(6, 6 + _subscribe.QUEUE_BATCHES + 1):
            feed.forward((), time)
        with pytest.raises(ControllerError) as ended:
            async for _ in feed:
                pass
        assert ended.value.code == "RESOURCE_EXHAUSTED" and "subscribe again as before" in ended.value.message
        assert canceled == ["s1"]
        feed.fail(ControllerError("NOT_FOUND", "dropped"))  # after the end: no second cancel
        assert canceled == ["s1"]

    asyncio.run(run())
