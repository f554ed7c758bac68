"""Controller high availability with real processes: `tandem serve` leaders and
`--standby` processes on one catalog (SQLite, one host), a real replica, and a client
given every controller's address. A kill -9 of the leader, a hung leader (SIGSTOP) and
an operator's stop each move the lead to the standby; the client follows, no
acknowledged append is lost or doubled, and strict reads see every one of them. A
handover moves it on purpose (and one whose successor never serves ends in a non-zero
exit); a resize cut off by the leader's kill is finished by the standby."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from catalog import Catalog
from controller._leadership import this_process
from controller._process import ControllerProcess, _tail, kill_replicas, wait_until
from controller.client import Client, TandemError
from protocol import controller_codec as codec
from test_metrics import scrape
from test_resize import _quietly, resize_events_after_takeover
from protocol import controller_pb2 as pb
from protocol import controller_pb2_grpc as pb_grpc

pytestmark = pytest.mark.spark

LEASE = ["--lease-ms", "3000", "--lease-renew-ms", "500", "--lease-margin-ms", "1000"]
TOTALS = "SELECT count(*) AS n, sum(v) AS total FROM s"


def _controller(tmp_path, name: str, port: int, *, standby: bool) -> ControllerProcess:
    """A controller on the shared catalog and blobs, in a data directory of its own,
    listening on `port` (a restart by its supervisor takes the same one)."""
    shared = tmp_path / "shared"
    return ControllerProcess(
        tmp_path / name,
        catalog_url=f"sqlite:///{shared / 'catalog.db'}",
        log_name=f"serve-{time.monotonic_ns()}.log",
        serve_args=["--listen", f"127.0.0.1:{port}", "--blob-uri", str(shared / "blobs"), *LEASE, *(["--standby"] if standby else [])],
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _refusal(address: str) -> grpc.RpcError:
    """What a controller that does not lead answers to a call."""
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.ControllerStub(channel).ListSources(pb.ListSourcesRequest(), timeout=10)
        except grpc.RpcError as error:
            return error
    raise AssertionError(f"{address} answered as the leader")


def test_the_lead_moves_to_a_standby_on_a_kill_a_hang_and_a_stop_and_clients_follow(tmp_path):
    ports = _free_port(), _free_port()
    first = _controller(tmp_path, "c1", ports[0], standby=False)
    second = _controller(tmp_path, "c2", ports[1], standby=True)
    processes = [first, second]
    try:
        assert (first.epoch, second.epoch) == (1, 0)
        refused = _refusal(second.address)
        assert refused.code() is grpc.StatusCode.UNAVAILABLE and "standby" in refused.details()
        assert dict(refused.trailing_metadata())[codec.LEADER_METADATA_KEY] == first.address

        client = Client.connect(f"{second.address},{first.address}", failover=60)
        assert client.address == first.address  # connect prefers the leader
        client.create_instance("main", replica_timeout_ms=30_000)
        client.add_replica("main", "r1", size="xsmall")
        client.create_source("s", "id BIGINT NOT NULL, v DOUBLE")
        client.create_dataflow("main", "totals", TOTALS)
        acked: list[int] = []

        def append_and_read(n: int) -> None:
            start = len(acked)
            acked.extend(range(start, start + n))
            for i in range(start, start + n):
                client.append("s", [{"id": i, "v": 1.0}])
            rows = client.peek("main", "totals", consistency="strict", timeout_ms=120_000).rows
            assert rows == [{"n": len(acked), "total": float(len(acked))}]

        append_and_read(3)
        scraped = scrape(first.metrics_address)
        assert (scraped[("tandem_controller_epoch", frozenset())], scraped[("tandem_standbys", frozenset())]) == (1, 1)
        assert 0 < scraped[("tandem_lease_remaining_seconds", frozenset())] <= 3

        # A kill -9: the standby on this host sees the leader's process gone at once.
        first.kill()
        killed = time.monotonic()
        second.await_lead(120)
        assert second.epoch == 2
        append_and_read(2)  # the client follows to the new leader
        print(f"kill -9: appends and strict reads served again after {time.monotonic() - killed:.1f} s")
        took_over = [e.message for e in client.events("main") if e.kind == "took_over"]
        assert "the leader's process" in took_over[-1] and "is gone" in took_over[-1]
        status = client.status("main")[0]
        assert status.replicas[0].dataflows_kept >= 1  # reconciled, not rebuilt

        # A hang: the new standby (the first, restarted) waits for the lease to lapse;
        # the hung leader, woken, finds it no longer leads and exits; or, stopped inside a
        # catalog write, it held SQLite's lock, and the standby killed it.
        third = _controller(tmp_path, "c1", ports[0], standby=True)
        processes.append(third)
        time.sleep(1.5)  # a renewal counts it: the leader stops on its own clock from now on
        with Client.connect(third.address) as asked:  # a standby says who leads
            lead = asked.leadership()
        assert (lead.epoch, lead.leader.address, [s.address for s in lead.standbys]) == (2, second.address, [third.address])
        assert 0 < lead.lease_remaining_ms <= 3_000 and lead.leader.pid == second.pid
        os.kill(second.pid, signal.SIGSTOP)
        hung = time.monotonic()
        third.await_lead(120)
        print(f"SIGSTOP: the standby led after {time.monotonic() - hung:.1f} s")
        os.kill(second.pid, signal.SIGCONT)
        if second.process.wait(timeout=30) == -signal.SIGKILL:
            assert f"(pid {second.pid}) held the catalog's write lock, hung: this standby killed it" in third.log_path.read_text()
        else:
            assert second.process.returncode == 1
            assert "this controller no longer leads" in second.log_path.read_text() or "superseded" in second.log_path.read_text()
        append_and_read(2)

        # An operator's stop: the lease ends at once, the replicas stay for the next leader.
        fourth = _controller(tmp_path, "c2", ports[1], standby=True)
        processes.append(fourth)
        said = third.stop()
        assert "left replica main/r1 running" in said and "a standby takes the lead" in said
        fourth.await_lead(60)
        append_and_read(1)
        assert "no controller leads" in [e.message for e in client.events("main") if e.kind == "took_over"][-1]
        wait_until(lambda: client.status("main")[0].health == "healthy", 60, "the instance healthy under its fourth leader")
        client.close()
    finally:
        for process in processes:
            if process.process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
        kill_replicas(tmp_path / "c1", f"sqlite:///{tmp_path / 'shared' / 'catalog.db'}")


def test_a_call_to_a_hung_controller_fails_within_seconds_so_the_client_can_move_on(tmp_path):
    """A SIGSTOPped controller keeps its socket open: without the client's keepalive
    pings a call to it waited out its deadline (120 s), and one to a hung leader never
    reached the standby that took over."""
    controller = ControllerProcess(tmp_path / "c", serve_args=["--http-listen", "off"])
    try:
        with Client.connect(controller.address) as client:
            client.list_sources()
            os.kill(controller.pid, signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(TandemError, match="ping timeout") as failed:
                client.list_sources()
            assert failed.value.code is grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 15
    finally:
        os.kill(controller.pid, signal.SIGCONT)
        controller.kill()


def test_a_handover_moves_the_lead_to_the_named_standby_and_calls_wait_rather_than_fail(tmp_path):
    """`tandem leader handover`: the leader holds new calls, hands the epoch over and
    exits 0 once the standby serves; appends and strict reads in a loop through it all
    succeed (a held call is retried once, at the new leader), every append lands once,
    each read sees every append before it, a feed goes on at the new leader with each
    time once, and the replica is kept, not rebuilt."""
    ports = _free_port(), _free_port()
    first = _controller(tmp_path, "c1", ports[0], standby=False)
    second = _controller(tmp_path, "c2", ports[1], standby=True)
    try:
        client = Client.connect(f"{first.address},{second.address}", failover=60)
        client.create_instance("main", replica_timeout_ms=30_000)
        client.add_replica("main", "r1", size="xsmall")
        client.create_source("s", "id BIGINT NOT NULL, v DOUBLE")
        client.create_dataflow("main", "totals", TOTALS)
        client.peek("main", "totals", consistency="strict", timeout_ms=120_000)
        with Client(f"{first.address},{second.address}") as asked:
            with pytest.raises(TandemError, match="no standby at 127.0.0.1:1") as unknown:
                asked.handover("127.0.0.1:1")
            assert unknown.value.code is grpc.StatusCode.NOT_FOUND
        acked, failures, latencies = [], [], []
        done = threading.Event()

        def calls() -> None:
            with Client(f"{first.address},{second.address}", failover=60) as looping:
                while not done.is_set():
                    started = time.monotonic()
                    try:
                        looping.append("s", [{"id": len(acked), "v": 1.0}])
                        acked.append(len(acked))
                        rows = looping.peek("main", "totals", consistency="strict", timeout_ms=30_000).rows
                    except TandemError as error:
                        failures.append(error)
                    else:
                        if rows != [{"n": len(acked), "total": float(len(acked))}]:
                            failures.append(rows)
                    latencies.append(time.monotonic() - started)

        batches, at_last = [], []

        def feed() -> None:
            with Client(f"{first.address},{second.address}", failover=60) as following:
                for batch in following.subscribe("main", "totals", progress=True):
                    batches.append(batch)
                    if done.is_set():
                        # Read while the feed still holds its progress readable: once it
                        # ends, compaction may move the index's since past it.
                        last = max(b.progress for b in batches if b.progress is not None)
                        at_last.append(following.peek("main", "totals", timestamp=last).rows)
                        return

        loop, follow = threading.Thread(target=calls, daemon=True), threading.Thread(target=feed, daemon=True)
        loop.start()
        follow.start()
        wait_until(lambda: len(acked) >= 5, 60, "appends through the first leader")
        view = client.handover(second.address)
        handed = len(latencies)
        assert (view.previous, view.leader, view.epoch) == (first.address, second.address, 2)
        assert client.address == second.address
        assert first.process.wait(timeout=30) == 0
        said = first.process.stdout.read().decode()
        assert f"handed the lead over to {second.address}" in said and "left replica main/r1 running" in said
        wait_until(lambda: len(latencies) >= handed + 5, 60, "calls through the new leader")
        done.set()
        loop.join(60)
        follow.join(60)
        print(f"handover: new calls waited {view.unavailable_ms} ms; slowest call in the loop {max(latencies):.2f} s")
        assert failures == []
        result = client.peek("main", "totals", consistency="strict", timeout_ms=120_000)
        assert result.rows == [{"n": len(acked), "total": float(len(acked))}]
        # The feed went on at the new leader from its last progress: each time once, in
        # order, and its changes add up to the contents at its last progress.
        times = [sorted(set(batch.updates.column("_time").to_pylist())) for batch in batches]
        flat = [t for batch_times in times for t in batch_times]
        assert flat == sorted(set(flat)), "a time came twice, or out of order"
        [expected] = at_last  # the contents at the feed's last progress
        contents: dict[tuple, int] = {}
        for batch in batches:
            for row in batch.updates.to_pylist():
                key = (row["n"], row["total"])
                contents[key] = contents.get(key, 0) + row["_diff"]
        assert {key: diff for key, diff in contents.items() if diff} == {(row["n"], row["total"]): 1 for row in expected}
        took_over = [e.message for e in client.events("main") if e.kind == "took_over"]
        assert "handed the lead over to it" in took_over[-1] and "ms after it found it could" in took_over[-1]
        assert client.status("main")[0].replicas[0].dataflows_kept >= 1  # reconciled, not rebuilt
        assert client.leadership().leader.address == second.address
        client.close()
    finally:
        for process in (first, second):
            if process.process.poll() is None:
                process.kill()
        kill_replicas(tmp_path / "c1", f"sqlite:///{tmp_path / 'shared' / 'catalog.db'}")


class _DyingStandby(pb_grpc.ControllerServicer):
    """A standby that answers the handover's probe, then is gone when told to take the
    lead (as one that died between the two would be)."""

    def GetLeadership(self, request, context):
        return pb.LeadershipView()

    def TakeLead(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "this standby is gone")


def test_a_handover_whose_successor_never_serves_exits_non_zero_and_a_restart_takes_the_lead_back(tmp_path):
    """The successor answered the probe but never said it serves (it died between the
    two): the old leader, which no longer leads, exits non-zero saying so, rather than
    0 as after a handover that worked, so that a supervisor restarting it on failure
    brings the lead back; started again, it takes the lead (a new epoch, fencing the
    successor's) and serves what was appended before."""
    first = _controller(tmp_path, "c1", 0, standby=False)
    fake = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ControllerServicer_to_server(_DyingStandby(), fake)
    fake_address = f"127.0.0.1:{fake.add_insecure_port('127.0.0.1:0')}"
    fake.start()
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'shared' / 'catalog.db'}")
    try:
        with Client(first.address) as client:
            client.create_source("s", "id BIGINT NOT NULL, v DOUBLE")
            before = client.append("s", [{"id": 1, "v": 1.0}])
            catalog.register_standby(this_process(fake_address))
            with pytest.raises(TandemError, match=f"handed the lead to {fake_address} as epoch 2, which did not say it serves") as refused:
                client.handover(fake_address)
            assert refused.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert first.process.wait(timeout=30) == 1
        said = _tail(first.log_path, 10)  # its stderr
        assert f"handed the lead over to {fake_address}, which did not say it serves" in said, said
        first.start()
        assert first.epoch == 3
        with Client(first.address) as client:
            after = client.append("s", [{"id": 2, "v": 2.0}])
            assert after > before
            assert [s.name for s in client.list_sources()] == ["s"]
    finally:
        catalog.close()
        fake.stop(0)
        if first.process.poll() is None:
            first.kill()


def test_a_resize_cut_off_by_the_leaders_kill_is_finished_by_the_standby_that_takes_the_lead(tmp_path):
    """A resize is a durable record (issue 51, item 6): the standby that takes the lead
    from a leader killed halfway carries it on from the record, as a restarted
    controller does (`test_resize`). The old replica is an external address nothing
    listens on, so only the new replica, spawned by the killed leader and adopted by
    the new one, decides. A failed check prints the replicas, the reconfiguration
    records, the events and both controllers' logs. Each controller binds a port the
    system picks (no restart here needs the same one again), so no other test's process
    can take it between a probe and the bind."""
    first = _controller(tmp_path, "c1", 0, standby=False)
    second = _controller(tmp_path, "c2", 0, standby=True)
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'shared' / 'catalog.db'}")

    def explain() -> str:
        events = "\n".join(f"  {e.id} {e.kind} {e.replica} {e.message}" for e in catalog.list_events("main", limit=200))
        return (
            f"replicas {_replicas(catalog)}, reconfigurations {catalog.list_reconfigurations()}\nevents:\n{events}\n"
            f"c1 log:\n{_tail(first.log_path, 40)}\nc2 log:\n{_tail(second.log_path, 60)}"
        )

    try:
        client = Client.connect(f"{first.address},{second.address}", failover=60)
        client.create_instance("main")
        client.add_replica("main", "old", address="127.0.0.1:1")
        resizing = threading.Thread(target=lambda: _quietly(lambda: client.resize("main", "xsmall", timeout_ms=180_000)), daemon=True)
        resizing.start()
        wait_until(lambda: "xsmall_1" in _replicas(catalog), 60, "the new replica recorded")
        [record] = catalog.list_reconfigurations()
        assert (record.old, record.new) == (("old",), ("xsmall_1",))
        first.kill()
        second.await_lead(120)
        resizing.join(60)
        wait_until(lambda: _replicas(catalog) == ["xsmall_1"], 180, "the resize finished by the new leader")
        # Noted after the old replicas are dropped and the record ended: waited for.
        committed = wait_until(lambda: resize_events_after_takeover(catalog.list_events("main", limit=200)), 60, "the resize's end noted")
        assert committed == ["resize_committed"]
        assert catalog.list_reconfigurations() == []
        client.close()
    except (AssertionError, TimeoutError) as error:
        raise AssertionError(f"{error}\n{explain()}") from error
    finally:
        catalog.close()
        for process in (first, second):
            if process.process.poll() is None:
                process.kill()
        kill_replicas(tmp_path / "c1", f"sqlite:///{tmp_path / 'shared' / 'catalog.db'}")


def _replicas(catalog: Catalog) -> list[str]:
    return sorted(r.name for r in catalog.list_replicas("main"))
