"""A controller process for tests: `tandem serve` on a data directory, killed or stopped
at will, with the replica processes it spawned cleaned up afterwards."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from catalog import Catalog, default_url
from controller._orchestrator import pid_alive

REPO = Path(__file__).resolve().parent.parent


class ControllerProcess:
    def __init__(self, data_dir: Path, *, catalog_url: str | None = None, log_name: str = "controller.log") -> None:
        self.data_dir = data_dir
        self.catalog_url = catalog_url
        command = [sys.executable, "-m", "controller.cli", "serve", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0"]
        if catalog_url:
            command += ["--catalog", catalog_url]
        data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(data_dir / log_name, "ab")
        self.process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=self._log, start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)}
        )
        line = self.process.stdout.readline().decode()
        match = re.search(r"listening on (\S+)", line)
        if not match:
            raise RuntimeError(f"controller did not start ({self.process.wait()}); see {data_dir / log_name}")
        self.address = match.group(1)

    def kill(self) -> None:
        """kill -9: the replicas it spawned live on (they run in sessions of their own)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._log.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def kill_replicas(data_dir: Path, catalog_url: str | None = None) -> None:
    """Kill every replica process the catalog under `data_dir` records."""
    catalog = Catalog.open(catalog_url or default_url(data_dir))
    try:
        for replica in catalog.list_replicas():
            if replica.managed and pid_alive(replica.pid):
                try:
                    os.killpg(replica.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    finally:
        catalog.close()
