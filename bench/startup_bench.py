"""Replica start-up with and without the JVM class archive, side by side.

    .venv/bin/python bench/startup_bench.py [--rounds 4]

Makes the class archive first if it is missing (`replica_service/_class_archive.py`;
the time it took is printed). Then, `--rounds` times, alternating between the two
(without: `TANDEM_CACHE_DIR` pointing at an empty directory, so no JVM finds one):
- one replica process (`python -m replica_service`, local[1], 512 MB, a SQLite catalog
  of its own) spawned: seconds until it prints its address (JVM, SparkSession, gRPC
  server), and the machine's CPU seconds (user + system, from /proc/stat) from the
  spawn until it has exited after SIGTERM: figures for an otherwise idle machine;
- three spawned at once: seconds until the last serves, and each JVM's proportional
  set size (PSS: the archive's pages are shared between the JVMs mapping it).
Medians per case, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replica_service._spark import class_archive, make_class_archive  # noqa: E402


def cpu_seconds() -> float:
    """The machine's CPU time so far (user, nice, system), in seconds."""
    user, nice, system = (int(v) for v in Path("/proc/stat").read_text().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def spawn(work: Path, name: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "replica_service", "--catalog", f"sqlite:///{work / name}.db", "--blob-dir", str(work / "blobs"), "--http-listen", "off"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def pss_mb(replica: subprocess.Popen) -> int:
    """The proportional set size of the replica's JVM (its child), in MB."""
    children = subprocess.run(["pgrep", "-P", str(replica.pid)], capture_output=True, text=True, check=False).stdout.split()
    total = 0
    for child in children:
        for line in Path(f"/proc/{child}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) // 1024
    return total


def stop(replicas: list[subprocess.Popen]) -> None:
    for replica in replicas:
        replica.send_signal(signal.SIGTERM)
    for replica in replicas:
        replica.wait(60)


def one(work: Path, env: dict[str, str]) -> tuple[float, float]:
    """Seconds to serving, and CPU seconds from spawn to exit, of one replica."""
    cpu, started = cpu_seconds(), time.perf_counter()
    replica = spawn(work, "one", env)
    replica.stdout.readline()
    serving = time.perf_counter() - started
    stop([replica])
    return serving, cpu_seconds() - cpu


def three(work: Path, env: dict[str, str]) -> tuple[float, list[int]]:
    """Seconds until the last of three spawned at once serves, and their JVMs' PSS."""
    started = time.perf_counter()
    replicas = [spawn(work, f"three{i}", env) for i in range(3)]
    for replica in replicas:
        replica.stdout.readline()
    serving = time.perf_counter() - started
    time.sleep(2)  # past start-up's last allocations
    sizes = [pss_mb(r) for r in replicas]
    stop(replicas)
    return serving, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    if class_archive() is None:
        started = time.perf_counter()
        if make_class_archive() is None:
            raise SystemExit("the class archive could not be made (see the warning above)")
        print(f"made the class archive in {time.perf_counter() - started:.1f} s")
    archive = class_archive()
    print(f"class archive: {archive} ({archive.stat().st_size / 2**20:.0f} MiB)")

    figures: dict[str, dict[str, list[float]]] = {case: {"one": [], "cpu": [], "three": [], "pss": []} for case in ("with", "without")}
    with tempfile.TemporaryDirectory(prefix="tandem-startup-") as scratch:
        work, empty = Path(scratch), Path(scratch) / "no-archive"
        empty.mkdir()
        envs = {"with": dict(os.environ), "without": {**os.environ, "TANDEM_CACHE_DIR": str(empty)}}
        for number in range(1, args.rounds + 1):
            for case, env in envs.items():
                serving, cpu = one(work, env)
                last, sizes = three(work, env)
                figures[case]["one"].append(serving)
                figures[case]["cpu"].append(cpu)
                figures[case]["three"].append(last)
                figures[case]["pss"].extend(sizes)
                print(f"round {number} {case:7s}: one {serving:.2f} s ({cpu:.1f} s CPU), three at once {last:.2f} s, PSS {sizes} MB", flush=True)

    print("\n| median | with the archive | without | ratio |\n|---|---|---|---|")
    for key, what in (("one", "one replica: spawn to serving, s"), ("cpu", "one replica: CPU, spawn to exit, s"), ("three", "three at once: spawn to the last serving, s"), ("pss", "a JVM's PSS, MB")):
        with_, without = statistics.median(figures["with"][key]), statistics.median(figures["without"][key])
        print(f"| {what} | {with_:.2f} | {without:.2f} | {with_ / without:.2f}x |")


if __name__ == "__main__":
    main()
