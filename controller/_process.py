"""A controller in a process of its own, for the demo, the examples and the tests:
`tandem serve` on a data directory, started, killed (SIGKILL) or stopped at will; the
replica processes it spawned, found again in the catalog and ended; and the two things
every walk-through needs, a loop of peeks on a thread and a wait for a condition.

    with embedded_controller() as controller, Client.connect(controller.address) as client:
        ...

Rules:
- The controller runs `python -m controller.cli serve --listen 127.0.0.1:0` with this
  interpreter, in a session of its own (a Ctrl-C in the terminal reaches the caller,
  which then cleans up, not the controller), with the data directory as its working
  directory (whatever Spark leaves in the working directory stays there) and its log in
  `<data-dir>/<log_name>`. It is ready once it prints "tandem controller (epoch N)
  listening on ADDRESS"; `address` and `epoch` are read from that line. A standby
  (`--standby`) is ready once it says it stands by (epoch 0); `await_lead` waits for
  it to lead.
- Managed replicas run in sessions of their own and outlive their controller's crash
  (that is what lets a restarted controller reconcile with them): `kill` leaves them,
  and `kill_replicas` ends them, from the pids the catalog records. `stop` (SIGTERM,
  the operator's stop) ends them with the controller, unless it was started with
  `--keep-replicas`.
- Importing this module loads the client side only; the catalog (SQLAlchemy) is loaded
  by `kill_replicas` when it runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

from controller.client import Client, TandemError

T = TypeVar("T")

# The directory holding our packages, first on the child's path, so the controller
# runs the same code as its caller (an uninstalled checkout included).
_ROOT = Path(__file__).resolve().parent.parent
_READY = re.compile(r"tandem controller \(epoch (\d+)\) listening on ([^;\s]+)(?:; status page on http://(\S+)/, metrics on [^;\s]+)?(?:; log in .*)?$")

_STANDING_BY = re.compile(r"tandem controller standing by on ([^;\s]+) ")

READY_TIMEOUT_S = 180.0  # a cold planner JVM on a loaded 2-core machine
STOP_TIMEOUT_S = 30.0


class ControllerProcess:
    """A `tandem serve` process on `data_dir`, started by the constructor (see `start`),
    with `serve_args` as more options of `tandem serve` (e.g. `--retention-ms`).
    After `kill` or `stop`, `start` runs a new one on the same directory and log."""

    def __init__(
        self,
        data_dir: Path | str,
        *,
        catalog_url: str | None = None,
        log_name: str = "controller.log",
        ready_timeout: float = READY_TIMEOUT_S,
        serve_args: Sequence[str] = (),
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.catalog_url = catalog_url
        self.serve_args = list(serve_args)
        self.log_path = self.data_dir / log_name
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start the controller and return once it listens, with `address` and `epoch`
        set; RuntimeError, with the end of its log, if it exits or stays silent for
        `ready_timeout` seconds first. Refused while a controller of this object runs."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"the controller (pid {self.process.pid}) is still running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "controller.cli", "serve"]
        command += ["--data-dir", str(self.data_dir), "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
        if self.catalog_url:
            command += ["--catalog", self.catalog_url]
        command += self.serve_args
        path = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command,
                cwd=self.data_dir,
                env={**os.environ, "PYTHONPATH": path},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        try:
            self.epoch, self.address, self.metrics_address = self._await_ready(self.ready_timeout)
        except BaseException:  # Ctrl-C included: never leave a controller behind
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def await_lead(self, timeout: float) -> None:
        """For a standby (`--standby`): return once it took the lead and listens as the
        leader, with `epoch` and `metrics_address` set (RuntimeError if it exits, or
        after `timeout` seconds: then it is killed)."""
        self.epoch, self.address, self.metrics_address = self._await_ready(timeout)

    def _await_ready(self, timeout: float) -> tuple[int, str, str | None]:
        """The ready line's epoch, address and metrics address; a standby's epoch is 0
        (no metrics) until `await_lead`."""
        timer = threading.Timer(timeout, self.process.kill)
        timer.start()
        try:
            line = self.process.stdout.readline().decode(errors="replace")
        finally:
            timer.cancel()
        standing = _STANDING_BY.search(line)
        if standing is not None:
            return 0, standing[1], None
        match = _READY.search(line)
        if match is None:
            code = self.process.wait()
            raise RuntimeError(
                f"the controller exited ({code}) before it listened; the end of "
                f"{self.log_path}:\n{_tail(self.log_path)}"
            )
        return int(match[1]), match[2], match[3]

    def kill(self) -> None:
        """SIGKILL, as a crash would; its replicas live on."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stdout.close()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> str:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; what it
        printed on its way out (a line per replica it stopped, or left running with
        `--keep-replicas`)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.process.poll() is None:
            self.kill()  # it printed nothing more we could wait for
            return ""
        said = self.process.stdout.read().decode(errors="replace")
        self.kill()
        return said


def kill_replicas(data_dir: Path | str, catalog_url: str | None = None) -> list[int]:
    """SIGKILL every managed replica process the catalog of `data_dir` (or at
    `catalog_url`) records, with its process group, and wait (briefly) until they are
    gone. Returns the pids that were alive. A data directory without a catalog has none."""
    from catalog import Catalog, default_url  # SQLAlchemy: loaded only when needed
    from controller._orchestrator import pid_alive

    if catalog_url is None and not (Path(data_dir) / "catalog.db").exists():
        return []
    catalog = Catalog.open(catalog_url or default_url(data_dir))
    try:
        # Not a later process given a dead replica's pid.
        pids = [r.pid for r in catalog.list_replicas() if r.managed and pid_alive(r.pid, r.process_start)]
    finally:
        catalog.close()
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)  # a replica leads its own session and group
        except ProcessLookupError:
            pass
    _wait_gone(pids, timeout=10.0)
    return pids


@contextmanager
def embedded_controller(
    data_dir: Path | str | None = None, *, keep: bool = False
) -> Iterator[ControllerProcess]:
    """A controller on the embedded defaults (SQLite catalog, local blobs, local
    replicas) in `data_dir`, or in a new temporary directory. On the way out, however it
    is left (an error, Ctrl-C, SIGTERM), the controller is stopped, every replica the
    catalog records is killed, and a temporary directory is removed unless `keep`."""
    directory = Path(tempfile.mkdtemp(prefix="tandem-")) if data_dir is None else Path(data_dir)
    with ExitStack() as cleanup:  # runs every step below, last first, even if one fails
        if data_dir is None and not keep:
            cleanup.callback(shutil.rmtree, directory, ignore_errors=True)
        previous = _terminate_as_exit()
        if previous is not None:
            cleanup.callback(signal.signal, signal.SIGTERM, previous)
        cleanup.callback(kill_replicas, directory)
        controller = ControllerProcess(directory)
        cleanup.callback(controller.stop)
        yield controller


class PeekLoop:
    """Peeks dataflow `name` of `instance` over and over, on a thread of its own with a
    client of its own, from entering the block until leaving it. `answered` counts the
    answers by replica; `failures` holds every failed peek, and every answer whose rows
    are not `expect` (when given); `timings` holds one `(started, finished, ok)` per peek,
    in `time.monotonic()` seconds, `ok` False for those in `failures`. `peek_args` go to
    `Client.peek` (a 20 s timeout by default); `pause` seconds between peeks leave the
    CPU to the replicas."""

    def __init__(
        self,
        address: str,
        instance: str,
        name: str,
        *,
        expect: list[dict[str, Any]] | None = None,
        pause: float = 0.02,
        **peek_args: Any,
    ) -> None:
        self.address, self.instance, self.name = address, instance, name
        self.expect, self.pause = expect, pause
        self.peek_args = {"timeout_ms": 20_000, **peek_args}
        self.answered: Counter[str] = Counter()
        self.failures: list[str] = []
        self.timings: list[tuple[float, float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peek-loop", daemon=True)

    def __enter__(self) -> PeekLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(self.peek_args["timeout_ms"] / 1000 + 15)

    def _loop(self) -> None:
        with Client(self.address) as client:
            while not self._stop.is_set():
                started, failure = time.monotonic(), None
                try:
                    result = client.peek(self.instance, self.name, **self.peek_args)
                except TandemError as error:
                    failure = f"{error.code.name}: {error.message}"
                else:
                    self.answered[result.replica or "?"] += 1
                    if self.expect is not None and result.rows != self.expect:
                        failure = f"{result.replica} answered {result.rows}"
                if failure is not None:
                    self.failures.append(failure)
                self.timings.append((started, time.monotonic(), failure is None))
                self._stop.wait(self.pause)

    def summary(self) -> str:
        """"N answered (r1 a, r2 b), F failed"."""
        by = ", ".join(f"{name} {count}" for name, count in sorted(self.answered.items()))
        return f"{sum(self.answered.values())} answered ({by}), {len(self.failures)} failed"


def wait_until(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """The first truthy value of `predicate()`, polled every 0.25 s; TimeoutError
    naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(0.25)


def _terminate_as_exit() -> Any:
    """Make SIGTERM leave through the `finally`s, as Ctrl-C does; returns the handler to
    restore, or None off the main thread (where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, terminate)


def _wait_gone(pids: list[int], timeout: float) -> None:
    from controller._orchestrator import pid_alive

    deadline = time.monotonic() + timeout
    while any(pid_alive(pid) and not _zombie(pid) for pid in pids):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    """A dead process nobody has reaped yet (kill(pid, 0) still finds it)."""
    from controller._orchestrator import proc_stat

    fields = proc_stat(pid)
    return bool(fields) and fields[0] == b"Z"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
