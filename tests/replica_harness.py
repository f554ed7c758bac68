"""A replica process and a small scripted controller for tests: real process, real gRPC.

`ReplicaProcess` runs `python -m replica_service` and reads its ready line.
`ScriptedClient` opens a `CommandStream` (offering to resume a session, if asked), sends
commands, and collects every response on a background thread, so tests can wait for the
`HelloAck`, frontiers, peek answers and heartbeats.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import pyarrow as pa

import history as h
from protocol import HelloAck, Refusal, command_to_proto, compute_pb2_grpc, ipc_to_table, response_from_proto

REPO = Path(__file__).resolve().parent.parent


class ReplicaProcess:
    """`python -m replica_service` in its own process group; `stop()` ends it."""

    def __init__(
        self,
        catalog_url: str,
        blob_dir: Path,
        *,
        master: str = "local[1]",
        spark_conf: dict[str, str] | None = None,
        log_path: Path | None = None,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        command = [sys.executable, "-m", "replica_service", "--catalog", catalog_url, "--blob-dir", str(blob_dir), "--spark-master", master, *args]
        for key, value in (spark_conf or {}).items():
            command += ["--spark-conf", f"{key}={value}"]
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=self._log, start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        )
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"replica exited with {self.process.wait()} before it was ready (log: {log_path})")
        ready = json.loads(line)
        self.address: str = ready["address"]
        self.pid: int = ready["pid"]

    def exit_code(self, timeout: float) -> int:
        """The process's exit code once it has exited by itself within `timeout`; else it
        is killed, and the test fails with the end of its log, which says why it lived on."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the replica did not exit within {timeout} s; its log ends:\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the log that are not stack traces (indented)."""
        if self.log_path is None:
            return "(no log kept)"
        kept = [line for line in self.log_path.read_text(errors="replace").splitlines() if line and not line[0].isspace()]
        return "\n".join(kept[-lines:])

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.process.returncode


@dataclass
class Responses:
    """Everything one connection received, in order, guarded by a condition."""

    first: object | None = None  # the first response: a HelloAck or a Refusal
    ack: HelloAck | None = None
    frontiers: dict[str, h.Frontier] = field(default_factory=dict)
    peeks: dict[str, h.PeekResult] = field(default_factory=dict)
    peek_counts: dict[str, int] = field(default_factory=dict)
    statuses: list[h.StatusResponse] = field(default_factory=list)
    subscriptions: dict[str, list[h.SubscribeResponse]] = field(default_factory=dict)  # uuid -> its reports
    refusal: Refusal | None = None
    frontier_log: list[h.FrontiersResponse] = field(default_factory=list)
    nonces: set[str] = field(default_factory=set)
    ended: bool = False


class ScriptedClient:
    """One controller connection, driven synchronously by a test. `sent` lists the
    commands sent after `Hello`, in order."""

    def __init__(self, address: str, *, epoch: int = 1, nonce: str | None = None, resume: h.Resume | None = None) -> None:
        self.nonce = nonce or uuid.uuid4().hex
        self.sent: list[h.ComputeCommand] = []
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 * 1024 * 1024)])
        self._outbox: queue.Queue = queue.Queue()
        self.responses = Responses()
        # When each peek's first answer arrived, stamped on the reader thread, so that
        # round trips exclude the waiting thread's wake-up.
        self.peek_arrivals: dict[str, float] = {}
        self._condition = threading.Condition()
        stub = compute_pb2_grpc.ComputeReplicaStub(self.channel)
        self._call = stub.CommandStream(iter(self._outbox.get, None))
        self._outbox.put(command_to_proto(h.Hello(epoch, self.nonce, resume)))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                nonce, response = response_from_proto(message)
                with self._condition:
                    self._record(nonce, response)
                    self._condition.notify_all()
        except grpc.RpcError:
            pass
        with self._condition:
            self.responses.ended = True
            self._condition.notify_all()

    def _record(self, nonce: str, response) -> None:
        r = self.responses
        r.nonces.add(nonce)
        if r.first is None:
            r.first = response
        if isinstance(response, HelloAck):
            r.ack = response
        elif isinstance(response, h.FrontiersResponse):
            r.frontier_log.append(response)
            r.frontiers[response.id] = response.write_frontier
        elif isinstance(response, h.PeekResponse):
            self.peek_arrivals.setdefault(response.uuid, time.perf_counter())
            r.peeks[response.uuid] = response.result
            r.peek_counts[response.uuid] = r.peek_counts.get(response.uuid, 0) + 1
        elif isinstance(response, h.StatusResponse):
            r.statuses.append(response)
        elif isinstance(response, h.SubscribeResponse):
            r.subscriptions.setdefault(response.uuid, []).append(response)
        else:
            r.refusal = response

    def send(self, *commands: h.ComputeCommand) -> None:
        for command in commands:
            self.sent.append(command)
            self._outbox.put(command_to_proto(command))

    def wait_for(self, predicate: Callable[[Responses], object], timeout: float = 60, what: str = "condition") -> object:
        deadline = time.monotonic() + timeout
        with self._condition:
            while not (value := predicate(self.responses)):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.responses.ended and not predicate(self.responses)):
                    raise TimeoutError(f"waited {timeout}s for {what}; got frontiers {self.responses.frontiers}, refusal {self.responses.refusal}")
                self._condition.wait(remaining)
            return value

    @property
    def ack(self) -> HelloAck:
        """The replica's `HelloAck` (waited for), after checking it came first."""
        ack = self.wait_for(lambda r: r.ack, 30, "the HelloAck")
        assert self.responses.first is ack, f"the first response was {self.responses.first}"
        return ack

    def wait_frontier(self, id: str, past: int, timeout: float = 90) -> h.Frontier:
        return self.wait_for(
            lambda r: r.frontiers.get(id) if id in r.frontiers and r.frontiers[id].is_complete(past) else None,
            timeout,
            f"{id} to pass {past}",
        )

    def peek(self, target: h.PeekTarget, timestamp: int, finishing: h.RowSetFinishing = h.RowSetFinishing(), timeout: float = 90) -> h.PeekResult:
        return self.timed_peek(target, timestamp, finishing, timeout)[1]

    def timed_peek(self, target: h.PeekTarget, timestamp: int, finishing: h.RowSetFinishing = h.RowSetFinishing(), timeout: float = 90) -> tuple[float, h.PeekResult]:
        """One peek: (seconds from sending it to its answer's arrival, the answer)."""
        peek_id = uuid.uuid4().hex
        sent = time.perf_counter()
        self.send(h.Peek(peek_id, target, timestamp, finishing, int(timeout * 1000)))
        result = self.wait_for(lambda r: r.peeks.get(peek_id), timeout + 5, f"peek {peek_id}")
        return self.peek_arrivals[peek_id] - sent, result

    def peek_table(self, target: h.PeekTarget, timestamp: int, finishing: h.RowSetFinishing = h.RowSetFinishing()) -> pa.Table:
        result = self.peek(target, timestamp, finishing)
        assert isinstance(result, h.PeekRows), result
        return ipc_to_table(result.arrow_ipc)

    def latest_status(self, timeout: float = 10) -> h.StatusResponse:
        seen = len(self.responses.statuses)
        return self.wait_for(lambda r: r.statuses[-1] if len(r.statuses) > seen else None, timeout, "a heartbeat")

    def close(self) -> None:
        self._outbox.put(None)
        self._call.cancel()
        self.channel.close()
