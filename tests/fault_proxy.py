"""A TCP proxy for failure drills: sits between the controller and a replica and can
delay, hold back, or cut the traffic. Fault injection lives here, in the tests, never in
the product.

It runs its own event loop on a background thread; every control method is thread-safe
and takes effect for connections already open as well as new ones.
"""

from __future__ import annotations

import asyncio
import threading


class FaultProxy:
    """Forwards 127.0.0.1:<port> to `target` ("host:port").

    - `delay(seconds)`: every chunk, both directions, waits this long before it is sent;
    - `partition()`: a network partition: bytes in both directions vanish and new
      connections hang, but nothing is closed, so the far ends see only silence;
    - `cut()`: reset every open connection at once;
    - `heal()`: forward normally again (connections that lived through a partition lost
      bytes, so they are reset: their ends had given up on them anyway).
    """

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._delay = 0.0
        self._partitioned = False  # drop every byte while set
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        while self._partitioned:  # a SYN into the void: the connection just hangs
            await asyncio.sleep(0.05)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, upstream_writer}
        await asyncio.gather(self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                if self._delay:
                    await asyncio.sleep(self._delay)
                if self._partitioned:
                    continue  # lost in the partition
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def delay(self, seconds: float) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_delay", seconds)

    def partition(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_partitioned", True)

    def cut(self) -> None:
        self._loop.call_soon_threadsafe(self._reset_all)

    def heal(self) -> None:
        def heal() -> None:
            if self._partitioned:
                self._reset_all()
            self._partitioned = False
            self._delay = 0.0

        self._loop.call_soon_threadsafe(heal)

    def _reset_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def close(self) -> None:
        """Reset every connection and stop for good (no task is left pending at exit)."""

        async def shut_down() -> None:
            # Reset connections and let their tasks end on their own (a cancelled
            # connection task makes asyncio's server callback raise).
            self._server.close()
            self._partitioned = False
            self._reset_all()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        asyncio.run_coroutine_threadsafe(shut_down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
