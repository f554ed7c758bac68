"""`tandem serve` as an operator runs it (issue 50): real controller and replica
processes. Its stop stops the replicas it runs, unless `--keep-replicas`, when the next
controller adopts them; its terminal shows warnings, its log file the rest; an address
another controller holds is refused at once, naming the flag that picks another.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from controller._orchestrator import pid_alive
from controller._process import ControllerProcess, kill_replicas, wait_until
from controller.client import Client

pytestmark = pytest.mark.spark


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def serve(data_dir, *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "controller.cli", "serve", "--data-dir", str(data_dir), *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_a_stop_stops_the_replicas_unless_kept_and_addresses_taken_are_named(tmp_path):
    data = tmp_path / "data"
    kept = ControllerProcess(data, log_name="kept.log", serve_args=["--keep-replicas"])
    try:
        with Client.connect(kept.address) as client:
            client.create_instance("shop")
            client.add_replica("shop", "r1", size="xsmall")
            (r1,) = client.status("shop")[0].replicas

        # A second controller on the addresses this one holds is refused before it
        # starts anything (it would have fenced this one first), naming the flag.
        other = tmp_path / "other"
        refused = serve(other, "--listen", "127.0.0.1:0", "--http-listen", kept.metrics_address)
        assert refused.returncode == 1 and refused.stderr.startswith(f"error: INVALID_ARGUMENT: cannot listen on {kept.metrics_address}: ")
        assert refused.stderr.rstrip().endswith("choose another with --http-listen HOST:PORT, or --http-listen off"), refused.stderr
        refused = serve(other, "--listen", kept.address, "--http-listen", "off")
        assert refused.returncode == 1 and refused.stderr.rstrip().endswith("choose another with --listen HOST:PORT"), refused.stderr
        assert not (other / "catalog.db").exists()

        said = kept.stop()
        assert said.splitlines() == [
            f"left replica shop/r1 running (pid {r1.pid}): the next `tandem serve` on this catalog adopts it; `kill -TERM {r1.pid}` stops it"
        ]
        assert pid_alive(r1.pid)
        # The terminal had warnings only (no Alembic, no routine events); the log file has all.
        assert not [line for line in kept.log_path.read_text().splitlines() if " INFO " in line], kept.log_path.read_text()
        logged = (data / "logs" / "controller.log").read_text()
        assert " INFO alembic.runtime.migration: Running upgrade" in logged
        assert " INFO controller._driver: instance shop: replica r1 added" in logged, logged

        adopter = ControllerProcess(data, log_name="adopter.log")
        with Client.connect(adopter.address) as client:
            wait_until(lambda: (r := client.status("shop")[0].replicas[0]).state == "active" and r.pid == r1.pid, 120, "r1 adopted")
        assert adopter.stop().splitlines() == [f"stopped replica shop/r1 (pid {r1.pid})"]
        assert not pid_alive(r1.pid)
        # Its JVM was killed with its group; init reaps it a moment later.
        wait_until(lambda: not group_alive(r1.pid), 10, "r1's JVM gone")
    finally:
        kill_replicas(data)
