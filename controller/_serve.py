"""`tandem serve`: a controller in the foreground, until the operator stops it.

Rules:
- Its addresses are checked before anything starts (no planner JVM, no catalog epoch):
  an address taken by another process (a second controller, say) is INVALID_ARGUMENT
  naming the flag that chooses another. Started first, a second controller on the same
  catalog would have fenced the first before it found its port taken.
- The log: everything at INFO and above goes to `<data-dir>/logs/controller.log`
  (appended, each line with the process id); the terminal (stderr) gets `log_level`
  and above, by default warnings: what an operator must look at. The ready line, on
  stdout, says where the log is.
- SIGTERM or SIGINT (Ctrl-C) is the operator's stop: the managed replicas' processes
  are stopped too, one line each on stdout, unless `keep_replicas` or standbys are
  registered (the lead goes to one of them: the stop ends the lease), when the exit
  names the pids it left and how to re-adopt or stop them. A kill -9 of the controller
  leaves them for the next controller to reconcile, and so does a fenced controller, one
  that lost the lead (its replicas belong to the newer one), or one that handed it over
  (`tandem leader handover`): that one exits 0 once its successor serves, and
  UNAVAILABLE (non-zero) if the successor never said it does: it may have died since
  the probe, and with no other standby nobody would take its lease once it lapses; a
  supervisor that restarts the controller on failure then brings the lead back.
- Leadership (`controller/_leadership.py`): without `standby` it takes the lead at
  once, fencing any other controller on the catalog; with it, it stands by (the ready
  line says so) until it takes the lead, and then prints the leader's ready line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import sys
from pathlib import Path
from time import monotonic

from catalog import InvalidArgument, ReplicaInfo
from controller._api import ControllerError, HandoverView
from controller._leadership import PROBE_S, Front, LeaseClock, LeaseOptions, Standby, hand_over, keep_lease, this_process
from controller._service import ControllerServer, ask_leadership, ask_to_take_lead
from controller._upkeep import UpkeepOptions
from controller.runtime import Controller
from protocol.security import ServerSecurity

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s controller[%(process)d] %(levelname)s %(name)s: %(message)s"


async def serve(
    *,
    data_dir: Path,
    catalog_url: str | None = None,
    listen: str = "127.0.0.1:6875",
    blob_uri: str | None = None,
    retention_ms: int | None = None,
    gc_grace_ms: int | None = None,
    upkeep_interval_ms: int | None = None,
    security: ServerSecurity = ServerSecurity(),
    http_listen: str | None = "127.0.0.1:6876",
    keep_replicas: bool = False,
    log_level: str = "warning",
    standby: bool = False,
    lease: LeaseOptions = LeaseOptions(),
) -> None:
    """Run a controller until SIGTERM or SIGINT (see the module). An option left None
    keeps its default (`Controller.start`, `UpkeepOptions`). A bad option, blob location
    or address raises `ControllerError` before anything runs. `http_listen` serves the
    status page, `/api/status` and `/metrics` (None: none), once this controller leads.
    A `standby` waits warm for the lead (`controller/_leadership.py`); otherwise it
    takes the lead at once, fencing any other."""
    log_path = _log_to(Path(data_dir).resolve() / "logs" / "controller.log", log_level)
    given = {"retention_ms": retention_ms, "gc_grace_ms": gc_grace_ms, "interval_ms": upkeep_interval_ms}
    try:
        upkeep = UpkeepOptions(**{name: value for name, value in given.items() if value is not None})
    except InvalidArgument as error:
        raise ControllerError("INVALID_ARGUMENT", str(error)) from None
    _check_free(listen, "--listen HOST:PORT")
    if http_listen is not None:
        _check_free(http_listen, "--http-listen HOST:PORT, or --http-listen off")
    controller = await Controller.prepare(
        data_dir, catalog_url, blob_uri=blob_uri, upkeep=upkeep, security=security, on_making_class_archive=_say_making_class_archive
    )
    front = Front(controller.catalog, lease)
    try:
        server = ControllerServer(front, listen, security)
    except OSError as error:  # taken since the check
        await controller.stop()
        raise ControllerError("INVALID_ARGUMENT", f"{error}; choose another with --listen HOST:PORT") from None
    await server.start()
    me = this_process(server.address)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    if standby:
        standing = Standby(controller.catalog, me, lease, front)
        front.standby = standing
        leader = await standing.register()
        print(f"tandem controller standing by on {server.address} (the leader: {leader or 'none yet'}); log in {log_path}", flush=True)
        waiting = asyncio.ensure_future(standing.wait())
        stopped = asyncio.ensure_future(stopping.wait())
        await asyncio.wait([waiting, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():  # stopped while standing by: it ran nothing
            waiting.cancel()
            await server.stop(0)
            await asyncio.to_thread(controller.catalog.leave_leadership, me.id)
            await controller.stop()
            return
        stopped.cancel()
        front.standby = None
        front.hold()  # calls that come while it recovers wait for it, not fail
        cause, found = waiting.result()
        guarded = True  # other standbys may be registered: they take the lease once it lapses
    else:
        found = monotonic()
        _, cause = await asyncio.to_thread(controller.catalog.take_lead, me, lease.lease_ms, lambda state: "started")
        # A standby registered before the take may take the lease once it lapses; one
        # registered after must first be counted by a renewal, which guards the clock.
        guarded = bool((await asyncio.to_thread(controller.catalog.leadership)).standbys)
    # Renewed from now on: a recovery may outlast the lease.
    clock = LeaseClock(lease, renewed_at=found, guarded=guarded)
    lost: list[str] = []

    def lose(why: str) -> None:
        lost.append(why)
        front.stop_serving("this controller lost the lead", None)
        stopping.set()

    handovers: list[asyncio.Future[HandoverView]] = []

    async def hand_over_to(to: str | None) -> HandoverView:
        tell = functools.partial(ask_to_take_lead, security=security, timeout_s=lease.lease_ms / 1000)
        probe = functools.partial(ask_leadership, security=security, timeout_s=PROBE_S)
        handover = asyncio.ensure_future(hand_over(front, controller, me, lease, to, tell, probe))
        handover.add_done_callback(lambda _: front.handed_over and stopping.set())  # even if its successor did not answer
        handovers.append(handover)
        return await asyncio.shield(handover)  # a caller that gives up does not stop it halfway

    front.refusal = "this controller is taking the lead"
    keeping = asyncio.ensure_future(keep_lease(controller.catalog, me, clock, lose, controller.learn_fenced))
    await controller.lead("" if cause == "started" else cause, found)
    if not lost:  # else it lost the lead while recovering: it serves nothing
        front.serve(controller, clock)
        front.hand_over = hand_over_to
    front.release()
    if cause != "started":
        log.warning("took the lead as epoch %d (%s) in %d ms", controller.epoch, cause, 1000 * (monotonic() - found))
    http = ""
    if http_listen is not None:
        try:
            address = controller.http.start(http_listen)
            http = f"; status page on http://{address}/, metrics on http://{address}/metrics"
        except (OSError, ValueError) as error:
            await server.stop(0)
            await controller.stop()
            raise ControllerError("INVALID_ARGUMENT", f"cannot serve HTTP on {http_listen}: {error}; choose another with --http-listen HOST:PORT, or --http-listen off") from None
    print(f"tandem controller (epoch {controller.epoch}) listening on {server.address}{http}; log in {log_path}", flush=True)
    fenced = asyncio.ensure_future(controller.fenced_event.wait())
    fenced.add_done_callback(lambda _: stopping.set())
    await stopping.wait()
    front.hand_over = None  # no handover starts from here on; one under way ends first
    fenced.cancel()
    keeping.cancel()
    if handovers:  # one under way ends first: its successor must be serving
        await asyncio.wait(handovers)
    await server.stop(2)
    if front.handed_over:  # the successor drives the replicas now
        for replica in await controller.stop():
            print(f"left replica {_name(replica)} running (pid {replica.pid}) to the new leader", flush=True)
        if not front.successor_serves:
            raise ControllerError(
                "UNAVAILABLE",
                f"handed the lead over to {front.successor}, which did not say it serves: it, or a standby once its lease "
                "lapses, takes over; a controller started again here takes the lead at once (fencing the successor's)",
            )
        print(f"handed the lead over to {front.leader_address}", flush=True)
        return
    if controller.fenced is not None or lost:  # its replicas and catalog belong to the next leader now
        await controller.stop()
        raise ControllerError("UNAVAILABLE", str(controller.fenced) if controller.fenced is not None else f"this controller no longer leads: {lost[0]}")
    try:
        standbys = (await asyncio.to_thread(controller.catalog.leave_leadership, me.id)).standbys
    except Exception as error:  # the catalog is unreachable: the lease lapses on its own
        log.warning("could not end the lease: %s", error)
        standbys = ()
    if keep_replicas or standbys:
        why = "a standby takes the lead" if standbys and not keep_replicas else "the next `tandem serve` on this catalog adopts it"
        for replica in await controller.stop():
            print(f"left replica {_name(replica)} running (pid {replica.pid}): {why}; `kill -TERM {replica.pid}` stops it", flush=True)
    else:
        for replica in await controller.stop(stop_replicas=True):
            print(f"stopped replica {_name(replica)} (pid {replica.pid})", flush=True)


def _say_making_class_archive() -> None:
    print("making the JVM class archive, once for this Java and Spark install (about a minute); "
          "every Spark JVM started after it starts in about half the time", file=sys.stderr, flush=True)


def _name(replica: ReplicaInfo) -> str:
    return f"{replica.instance}/{replica.name}"


def _log_to(path: Path, terminal_level: str) -> Path:
    """Log INFO and above (DEBUG too when asked for) to `path`, `terminal_level` and
    above to stderr; `path`."""
    level = getattr(logging, terminal_level.upper())
    path.parent.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter(LOG_FORMAT)
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_terminal = logging.StreamHandler(sys.stderr)
    to_file.setLevel(min(level, logging.INFO))
    to_terminal.setLevel(level)
    root = logging.getLogger()
    root.setLevel(min(level, logging.INFO))
    for handler in (to_file, to_terminal):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    return path


def _check_free(listen: str, flag: str) -> None:
    """INVALID_ARGUMENT naming `flag` when `listen` ("host:port") cannot be bound now;
    port 0 (any free port) always can. A malformed address is left to the server that
    binds it, which says so."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) == 0 or int(port) > 65535:
        return
    try:
        with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            probe.bind((host.strip("[]") or "127.0.0.1", int(port)))
    except OSError as error:
        raise ControllerError("INVALID_ARGUMENT", f"cannot listen on {listen}: {error.strerror or error} (another controller?); choose another with {flag}") from None
