"""Controller high availability under faults (issue 51): how long reads and appends stop
when the leading controller is killed, hung or cut off from the catalog, and whether
any acknowledged append is lost or doubled, or any strict read wrong.

    .venv/bin/python bench/ha_bench.py [--kills 10] [--handovers 5] [--catalog postgres]

Two `tandem serve` processes on one catalog (PostgreSQL by default, each reaching it
through a TCP proxy of this bench's, so one can be cut off), sharing blob storage, one
leading and one `--standby` (lease 3 s, renewed every 0.5 s, margin 1 s); an instance
of two `xsmall` replicas with `SELECT count(*), sum(v)` over a source. Two client
threads given both addresses: one appends a row at a time (each under its own
idempotency key, sent again after a failover), one makes strict peeks every 0.2 s.
Faults, one after the other, each once the clients were served again and the faulted
controller is back as a standby: `--kills` kill -9s of whichever controller leads, a
SIGSTOP of the leader (continued after the standby took over), a cut of the leader's own
catalog connections (restored likewise), and `--handovers` planned handovers. Printed
per fault: seconds from the fault until an append and a strict read were served again,
and the calls that failed; per handover: how long new calls were held, and the longest
append and strict read in flight meanwhile. After all: every acknowledged append in
storage exactly once, every strict read's count and sum equal to those of the appends
at or before its timestamp, and one controller serving at a time: the calls, in the
order they were answered, come in one run per leader, and none a leader answered was
sent after its successor answered one.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import catalog_for, log, pct, wait_until  # noqa: E402

from catalog import Catalog  # noqa: E402
from controller._process import ControllerProcess, kill_replicas  # noqa: E402
from controller.client import Client, TandemError  # noqa: E402
from storage import Storage  # noqa: E402

LEASE = ["--lease-ms", "3000", "--lease-renew-ms", "500", "--lease-margin-ms", "1000"]
TOTALS = "SELECT count(*) AS n, sum(v) AS total FROM s"
QUIET_S = 15  # calls without faults first: what a call costs when nothing fails


class Proxy:
    """A TCP forwarder to `target`; `cut(pid)` closes the connections of process `pid`
    and refuses its new ones until `restore()`. Only that process: the replicas a
    controller spawned reach the catalog by its URL, through this proxy too, and a cut of
    the leader must not cut them off (it did, and no strict read was served again)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open: dict[socket.socket, tuple[int | None, socket.socket]] = {}  # client -> (its pid, upstream)
        self.cut_off: int | None = None
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, (_, peer_port) = self.server.accept()
            pid = _socket_owner(peer_port, self.port)
            if pid is not None and pid == self.cut_off:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.open[client] = (pid, upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            # A shutdown, not only a close: the other direction's thread is blocked in
            # recv on one of these, which keeps a closed socket open (no FIN), and a
            # killed controller's catalog session then lived on, holding its locks
            # until PostgreSQL's idle-in-transaction timeout (5 s).
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                end.close()

    def cut(self, pid: int) -> None:
        self.cut_off = pid
        with self.lock:
            for client, (owner, upstream) in list(self.open.items()):
                if owner == pid:
                    for connection in (client, upstream):
                        try:
                            connection.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                    del self.open[client]

    def restore(self) -> None:
        self.cut_off = None


def _socket_owner(port: int, remote_port: int) -> int | None:
    """The pid of the process on this host whose IPv4 TCP socket has local port `port`
    and remote port `remote_port` (from /proc/net/tcp and /proc/*/fd), or None."""
    inode = None
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and int(fields[2].rsplit(":", 1)[1], 16) == remote_port:
                inode = fields[9]
                break
    if inode is None:
        return None
    wanted = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == wanted for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:  # gone, or not ours to read
            continue
    return None


class Loops:
    """The appending and the peeking client threads, and what each saw when."""

    def __init__(self, addresses: str) -> None:
        self.addresses = addresses
        self.stop = threading.Event()
        self.acked: dict[int, int] = {}  # row id -> its append's timestamp
        self.served: dict[str, list[tuple[float, float, str]]] = {"append": [], "read": []}  # (sent, answered, by whom)
        self.failed: dict[str, list[float]] = {"append": [], "read": []}
        self.errors: dict[str, int] = {}  # each failure's status and first words, counted
        self.reads: list[tuple[int, int, float, str | None, float]] = []  # (timestamp, n, total, replica, sent)
        self.threads = [threading.Thread(target=self._append), threading.Thread(target=self._read)]
        for thread in self.threads:
            thread.start()

    def _append(self) -> None:
        with Client.connect(self.addresses, failover=60) as client:
            i = 0
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    self.acked[i] = client.append("s", [{"id": i, "v": 1.0}], idempotency_key=f"row-{i}")
                    self.served["append"].append((sent, time.monotonic(), client.address))
                    i += 1
                except TandemError as error:
                    self._failed("append", error)  # sent again under its key
                time.sleep(0.05)

    def _read(self) -> None:
        with Client.connect(self.addresses, failover=60) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    result = client.peek("main", "totals", consistency="strict", timeout_ms=30_000)
                    (row,) = result.rows
                    self.reads.append((result.timestamp, row["n"], row["total"], result.replica, sent))
                    self.served["read"].append((sent, time.monotonic(), client.address))
                except TandemError as error:
                    self._failed("read", error)
                time.sleep(0.2)

    def _failed(self, kind: str, error: TandemError) -> None:
        self.failed[kind].append(time.monotonic())
        what = f"{kind}: {error.code.name}: {' '.join(str(error).split()[:12])}"
        self.errors[what] = self.errors.get(what, 0) + 1

    def back_after(self, kind: str, at: float, timeout: float = 120) -> float:
        """Seconds from `at` until a call of `kind` sent after it was answered (only a
        controller that took over can answer it: an upper bound, by at most one
        pause of the loop)."""
        wait_until(lambda: any(sent > at for sent, _, _ in self.served[kind]), timeout, f"{kind} served after the fault")
        return min(answered for sent, answered, _ in self.served[kind] if sent > at) - at

    def durations(self, start: float, end: float) -> str:
        """The calls of each kind sent between `start` and `end`: p50 and max duration."""
        spans = {kind: [answered - sent for sent, answered, _ in served if start <= sent <= end] for kind, served in self.served.items()}
        return ", ".join(f"{kind}s p50 {pct(d, 50):.2f} / max {max(d):.2f} s ({len(d)})" for kind, d in spans.items() if d)

    def longest_call(self, kind: str, start: float, end: float) -> float:
        """The longest call of `kind` in flight at some point between `start` and `end`."""
        wait_until(lambda: any(sent > end for sent, _, _ in self.served[kind]), 120, f"{kind} served after the handover")
        return max(answered - sent for sent, answered, _ in self.served[kind] if sent <= end and answered >= start)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--handovers", type=int, default=5)
    parser.add_argument("--catalog", default="postgres", help="postgres (127.0.0.1:5432/test, a schema of its own) or sqlite")
    args = parser.parse_args()
    with catalog_for(args.catalog) as url, tempfile.TemporaryDirectory(prefix="tandem-ha-") as directory:
        root = Path(directory)
        baseline, rows, handovers, checks = _run(root, url or f"sqlite:///{root / 'catalog.db'}", args.kills, args.handovers)
    print(f"\n## Faults of the leading controller ({args.catalog}; lease 3 s, renewed every 0.5 s, margin 1 s)\n")
    print(f"Without faults ({QUIET_S} s): {baseline}\n")
    print("| fault | appends served again after | strict reads served again after | failed appends / reads |")
    print("|---|---|---|---|")
    for name, appends, reads, failed in rows:
        print(f"| {name} | {appends:.1f} s | {reads:.1f} s | {failed} |")
    kills = [(a, r) for name, a, r, _ in rows if name.startswith("kill")]
    if kills:
        appends, reads = zip(*kills)
        print(f"| kill -9, p50 / max | {pct(list(appends), 50):.1f} / {max(appends):.1f} s | {pct(list(reads), 50):.1f} / {max(reads):.1f} s | |")
    if handovers:
        print("\n## Planned handovers (`tandem leader handover`)\n")
        print("| handover | new calls held | longest append in flight | longest strict read in flight | failed appends / reads |")
        print("|---|---|---|---|---|")
        for name, held, appends, reads, failed in handovers:
            print(f"| {name} | {held} ms | {appends:.2f} s | {reads:.2f} s | {failed} |")
    print(f"\n{checks}")


def _run(root: Path, url: str, kills: int, handovers: int) -> tuple[str, list[tuple[str, float, float, str]], list[tuple[str, int, float, float, str]], str]:
    postgres = url.startswith("postgresql")
    proxies = [Proxy(("127.0.0.1", 5432)) for _ in range(2)] if postgres else []
    ports = [_free_port(), _free_port()]

    def controller(i: int, standby: bool) -> ControllerProcess:
        via = url.replace("127.0.0.1:5432", f"127.0.0.1:{proxies[i].port}") if postgres else url
        # Retention long enough that no compaction merges the appends' times meanwhile.
        serve = ["--listen", f"127.0.0.1:{ports[i]}", "--blob-uri", str(root / "blobs"), "--retention-ms", "3600000", *LEASE]
        serve += ["--standby"] if standby else []
        return ControllerProcess(root / f"c{i}", catalog_url=via, log_name=f"serve-{time.monotonic_ns()}.log", serve_args=serve)

    processes = [controller(0, standby=False), controller(1, standby=True)]
    addresses = ",".join(f"127.0.0.1:{port}" for port in ports)
    loops = None
    try:
        with Client.connect(addresses, failover=60) as client:
            client.create_instance("main", replica_timeout_ms=30_000)
            for name in ("r1", "r2"):
                client.add_replica("main", name, size="xsmall")
            client.create_source("s", "id BIGINT NOT NULL, v DOUBLE")
            client.create_dataflow("main", "totals", TOTALS)
            client.peek("main", "totals", consistency="strict", timeout_ms=300_000)
            log("set up: two replicas, the dataflow hydrated")
            loops = Loops(addresses)
            quiet = time.monotonic()
            time.sleep(QUIET_S)
            baseline = loops.durations(quiet, time.monotonic())
            log(f"no fault for {QUIET_S} s: {baseline}")
            rows, handed = [], []
            faults = [f"kill -9 #{n + 1}" for n in range(kills)] + ["SIGSTOP", *(["catalog cut"] if postgres else [])]
            faults += [f"handover #{n + 1}" for n in range(handovers)]
            for fault in faults:
                wait_until(lambda: len(client.leadership().standbys) == 1, 120, "a standby registered")
                # Counted by two renewals since: the leader knows it must stop on its own
                # clock (a standby it never saw does not take a lapsed lease).
                counted = client.leadership().lease_renewals + 2
                wait_until(lambda: client.leadership().lease_renewals >= counted, 60, "the standby counted by the leader")
                leader = client.leadership().leader.address
                i = ports.index(int(leader.rsplit(":", 1)[1]))
                failed_before = {kind: len(times) for kind, times in loops.failed.items()}
                at = time.monotonic()
                if fault.startswith("handover"):
                    held = client.handover().unavailable_ms
                    appends, reads = loops.longest_call("append", at, time.monotonic()), loops.longest_call("read", at, time.monotonic())
                elif fault.startswith("kill"):
                    processes[i].kill()
                elif fault == "SIGSTOP":
                    os.kill(processes[i].pid, signal.SIGSTOP)
                else:
                    proxies[i].cut(processes[i].pid)
                if not fault.startswith("handover"):
                    appends, reads = loops.back_after("append", at), loops.back_after("read", at)
                if fault == "SIGSTOP":
                    os.kill(processes[i].pid, signal.SIGCONT)
                elif fault == "catalog cut":
                    proxies[i].restore()
                try:  # the hung or cut leader stops on its own
                    processes[i].process.wait(60)
                except subprocess.TimeoutExpired:
                    log(f"{fault}: the old leader did not exit within 60 s; killed")
                    processes[i].kill()
                old, processes[i] = processes[i], controller(i, standby=True)
                failed = "/".join(str(len(loops.failed[kind]) - failed_before[kind]) for kind in ("append", "read"))
                if fault.startswith("handover"):
                    said = [line.split(": ", 1)[1] for line in old.log_path.read_text().splitlines() if "handed the lead over to" in line]
                    log(f"{fault}: the old leader {said[-1] if said else 'said nothing'}")
                    handed.append((fault, held, appends, reads, failed))
                    log(f"{fault}: new calls held {held} ms, longest append {appends:.2f} s, strict read {reads:.2f} s, failed {failed}")
                else:
                    rows.append((fault, appends, reads, failed))
                    log(f"{fault}: appends back after {appends:.1f} s, strict reads after {reads:.1f} s, failed {failed}")
            loops.close()
        return baseline, rows, handed, _check(root, url, loops, len(faults) + 1)
    finally:
        if loops is not None:
            loops.close()
        for process in processes:
            if process.process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
        kill_replicas(root / "c0", url)


def _check(root: Path, url: str, loops: Loops, terms: int) -> str:
    """Every acknowledged append once in storage, at its timestamp; every strict read
    equal to the count and sum of the rows stored at or before its timestamp; and one
    controller serving at a time over the `terms` leaders (`_one_at_a_time`)."""
    catalog = Catalog.open(url)
    try:
        source = catalog.collection_by_name("s").id
        collection = catalog.manifest(source).collection
        changes = Storage(catalog, root / "blobs").read_changes(source, collection.since.time - 1, collection.upper.time - 1)
    finally:
        catalog.close()
    stored: dict[int, list[int]] = {}
    for id, at in zip(changes["id"].to_pylist(), changes["_time"].to_pylist()):
        stored.setdefault(id, []).append(at)
    doubled = [id for id, times in stored.items() if len(times) > 1]
    lost = [id for id, at in loops.acked.items() if stored.get(id) != [at]]
    times = sorted(at for ats in stored.values() for at in ats)
    # count(*) and sum(v) of the rows at or before a read's time (a sum over none is NULL).
    wrong = [(i, r, n) for i, r in enumerate(loops.reads) if (r[1], r[2]) != (n := sum(1 for t in times if t <= r[0]), float(n) if n else None)]
    assert not lost and not doubled and not wrong, f"lost or moved {lost[:5]}, doubled {doubled[:5]}, wrong reads {wrong[:3]}"
    runs = _one_at_a_time(loops)
    assert len(runs) == terms, f"the served calls came from {len(runs)} runs of one controller, for {terms} leaders: {runs}"
    failures = "".join(f"\n- {count} x {what}" for what, count in sorted(loops.errors.items()))
    return (
        f"failed calls (each sent again):{failures or ' none'}\n"
        f"{len(loops.acked)} acknowledged appends, each in storage once at its timestamp ({len(changes)} rows stored; "
        f"none lost, none doubled); {len(loops.reads)} strict reads, each equal to the count and sum of the rows "
        f"stored at or before its timestamp; the {sum(len(c) for c in loops.served.values())} served calls, in the order "
        f"they were answered, came from {terms} runs of one controller each, one per leader, and no call a leader "
        f"answered was sent after its successor had answered one"
    )


def _one_at_a_time(loops: Loops) -> list[tuple[str, int]]:
    """The served calls of both loops in the order they were answered, as runs of one
    controller (address, calls); AssertionError if a call answered by one leader was
    sent after the next leader had answered a call: both served at once."""
    calls = sorted((answered, sent, address) for served in loops.served.values() for sent, answered, address in served)
    runs: list[tuple[str, int]] = []
    first_answer: list[float] = []
    last_sent: list[float] = []
    for answered, sent, address in calls:
        if runs and runs[-1][0] == address:
            runs[-1] = (address, runs[-1][1] + 1)
            last_sent[-1] = max(last_sent[-1], sent)
        else:
            runs.append((address, 1))
            first_answer.append(answered)
            last_sent.append(sent)
    overlaps = [i for i in range(1, len(runs)) if last_sent[i - 1] > first_answer[i]]
    assert not overlaps, f"two controllers served at once: {[(runs[i - 1][0], runs[i][0]) for i in overlaps]}"
    return runs


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    main()
