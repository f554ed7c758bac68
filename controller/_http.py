"""The controller's HTTP listener (`tandem serve --http-listen`): `/metrics` for
Prometheus, `/` the status page, `/api/status` what the page shows, as JSON.

It runs on its own thread (wsgiref, one thread per request), so a slow scrape or page
never holds up the controller; whatever it reads of the controller's state it reads on
the controller's event loop, in one step (`Controller.status`, the metrics snapshot).
The page is one static file with its script inline: nothing to build, nothing fetched
from elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from controller._api import DataflowView
from controller._upkeep import RETENTION_HOLDER

if TYPE_CHECKING:
    from controller.runtime import Controller

log = logging.getLogger(__name__)

LAG_SAMPLE_S = 5.0  # how often the lag of every collection is sampled for the plots
LAG_HISTORY_S = 3600  # how much of it is kept (in memory only)
EVENTS_SHOWN = 50
READ_TIMEOUT_S = 10.0  # for a request's read of the controller's state


class LagHistory:
    """Wallclock lag (now - write frontier, ms) of every collection over the last hour,
    sampled every `LAG_SAMPLE_S`; a collection that leaves the instance leaves it."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, str], deque[tuple[int, int]]] = {}  # (instance, id) -> (ms, lag)

    def sample(self, controller: Controller, now_ms: int) -> None:
        live = set()
        for name, driver in controller.drivers.items():
            instance = driver.instance
            for id, collection in instance.collections.items():
                lag = instance.wallclock_lag_ms(collection.write_frontier)
                if collection.since.is_empty or lag is None:
                    continue
                live.add((name, id))
                series = self.samples.setdefault((name, id), deque(maxlen=int(LAG_HISTORY_S / LAG_SAMPLE_S)))
                series.append((now_ms, lag))
        for gone in self.samples.keys() - live:
            del self.samples[gone]

    def of(self, instance: str) -> dict[str, list[tuple[int, int]]]:
        return {id: list(series) for (name, id), series in self.samples.items() if name == instance}


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # a scrape every few seconds is not news
        pass


class HttpListener:
    """`/metrics`, `/` and `/api/status` of one controller, once `start`ed."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.lag = LagHistory()
        self._metrics_app = make_wsgi_app(controller.metrics.registry)
        self._page = resources.files("controller").joinpath("status_page.html").read_bytes()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: WSGIServer | None = None
        self._sampler: asyncio.Task | None = None

    def start(self, listen: str) -> str:
        """Serve on `listen` ("host:port", port 0 picks one) from now on; the bound
        "host:port". Call on the controller's event loop. ValueError or OSError when
        `listen` cannot be served."""
        host, _, port = listen.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"expected host:port or off, not {listen!r}")
        self._loop = asyncio.get_running_loop()
        self.controller.metrics.bind(self._loop)
        self._server = make_server(host or "127.0.0.1", int(port), self._app, _ThreadingServer, _QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="http", daemon=True).start()
        self._sampler = self._loop.create_task(self._sample_lag())
        return f"{host or '127.0.0.1'}:{self._server.server_port}"

    def close(self) -> None:
        """Stop serving (blocking until the server's thread ends)."""
        if self._sampler is not None:
            self._loop.call_soon_threadsafe(self._sampler.cancel)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    async def _sample_lag(self) -> None:
        while True:
            self.lag.sample(self.controller, int(time.time() * 1000))
            await asyncio.sleep(LAG_SAMPLE_S)

    # --- Requests (on the server's threads) ---------------------------------------------

    def _app(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path in ("/", "/index.html"):
            return _respond(start_response, "200 OK", "text/html; charset=utf-8", self._page)
        if path == "/api/status":
            try:
                body = json.dumps(self._read(self.status()), default=str).encode()
            except Exception as error:  # the page shows it and tries again
                log.warning("status page: reading the controller's state failed: %s", error)
                return _respond(start_response, "503 Service Unavailable", "application/json", json.dumps({"error": str(error)}).encode())
            return _respond(start_response, "200 OK", "application/json", body)
        return _respond(start_response, "404 Not Found", "text/plain", b"not found: try / , /api/status or /metrics\n")

    def _read(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(READ_TIMEOUT_S)

    async def status(self) -> dict[str, Any]:
        """What `/api/status` answers: `Controller.status` of every instance with the lag
        history of its collections and what each collection is (`kinds`: an index or a
        materialized view, of which dataflow), the sources with their read holds, the
        latest events, and the leadership (`Controller.leadership`)."""
        views = await self.controller.status()
        dataflows = await self.controller.list_dataflows()
        sources = await self.controller.list_sources()
        holds = await asyncio.to_thread(lambda: {s.id: self.controller.catalog.manifest(s.id).holds for s in sources})
        events = await self.controller.events(limit=EVENTS_SHOWN)
        leadership = await self.controller.leadership()
        return {
            "epoch": self.controller.epoch,
            "leadership": dataclasses.asdict(leadership),
            "now_ms": int(time.time() * 1000),
            "instances": [
                {**dataclasses.asdict(view), "lag_history": self.lag.of(view.name), "kinds": _kinds(d for d in dataflows if d.instance == view.name)}
                for view in views
            ],
            "sources": [
                {**dataclasses.asdict(source), "holds": [{"holder": _holder(holder, dataflows), "at": at.time} for holder, at in holds[source.id]]}
                for source in sources
            ],
            "events": [dataclasses.asdict(event) for event in events],
        }


def _kinds(dataflows: Iterable[DataflowView]) -> dict[str, dict[str, str]]:
    """Collection id -> its kind ("index", "materialized view") and dataflow: a dataflow
    with both has two collections of one name."""
    kinds = {}
    for d in dataflows:
        if d.index_id is not None:
            kinds[d.index_id] = {"kind": "index", "dataflow": d.name}
        if d.sink_id is not None:
            kinds[d.sink_id] = {"kind": "materialized view", "dataflow": d.name}
    return kinds


def _holder(holder: str, dataflows: Sequence[DataflowView]) -> str:
    """Who holds a source back, in words: a dataflow (by the first export id its hold
    is named by, `catalog.dataflow_holder`), the retention window, a change feed; any
    other holder as it is named."""
    if holder == RETENTION_HOLDER:
        return "retention window"
    if holder.startswith("subscribe:"):
        return "a change feed (tandem subscribe)"
    instance, _, key = holder.partition("/")
    for d in dataflows:
        if d.instance == instance and key in (d.index_id, d.sink_id):
            return f"dataflow {d.name} of instance {instance}"
    return holder


def _respond(start_response: Callable, status: str, content_type: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))), ("Cache-Control", "no-store")])
    return [body]
