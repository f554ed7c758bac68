"""The `tandem` client commands' own start-up: interpreter, imports, arguments, one RPC.

    .venv/bin/python bench/cli_startup_bench.py [--runs 7] [--address HOST:PORT] [--root DIR]

Each command runs `--runs` times as `python -m controller.cli ...` (what the `tandem`
script runs), against `--address`: by default a loopback port nothing listens on, so
the RPC is refused at once and what is timed is the start-up alone; given a running
controller's address, the time of a real call. Printed per command: the median and the
least wall time, and from one more run under `python -X importtime` the cumulative
import time of the command's own modules (the top-level imports of `controller.cli` and
what it loads later) and which heavy modules were loaded at all: pyspark, SQLAlchemy,
Alembic, storage and catalog (the catalog's SQLAlchemy comes with them),
pyarrow.compute, pyarrow.parquet. `python -c pass` is the interpreter's own floor.
`--root` runs the CLI of another source tree (e.g. an export of an older commit) with
this interpreter, for a before and after.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("pyspark", "sqlalchemy", "alembic", "storage", "catalog", "pyarrow.compute", "pyarrow.parquet")


def refused_address() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def commands(csv_path: Path) -> list[tuple[str, list[str]]]:
    return [
        ("python -c pass", []),
        ("tandem --help", ["--help"]),
        ("tandem status", ["status"]),
        ("tandem instance list", ["instance", "list"]),
        ("tandem peek shop totals --key eu", ["peek", "shop", "totals", "--key", "eu"]),
        ("tandem events", ["events"]),
        ("tandem source append orders --csv F", ["source", "append", "orders", "--csv", str(csv_path)]),
    ]


def argv(args: list[str], address: str) -> list[str]:
    if not args:
        return [sys.executable, "-c", "pass"]
    return [sys.executable, "-m", "controller.cli", *args, *([] if args == ["--help"] else ["--address", address])]


def timed(command: list[str], env: dict[str, str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def imports(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, list[str]]:
    """The cumulative import time (s) of the top-level modules the command imported,
    less the interpreter's own start-up (`site`, `encodings`, ...), and the heavy ones."""
    run = subprocess.run([command[0], "-X", "importtime", *command[1:]], env=env, cwd=cwd, capture_output=True, text=True, check=False)
    total, loaded = 0, set()
    for line in run.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|")
        module = name.strip()
        if module.split(".")[0] in HEAVY or module in HEAVY:
            loaded.add(module if module in HEAVY else module.split(".")[0])
        depth = len(name) - len(name.lstrip())
        if depth == 1 and cumulative.strip().isdigit() and module not in ("site", "encodings", "_frozen_importlib_external", "zipimport", "codecs"):
            total += int(cumulative)
    return total / 1e6, sorted(loaded)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--address", help="a running controller (default: a refused loopback port)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the source tree whose CLI to run (default: this one)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(args.root.resolve()), os.environ.get("PYTHONPATH")]))}
    address = args.address or refused_address()
    load = os.getloadavg()[0]
    print(f"root {args.root.resolve()}, {os.cpu_count()} cores, load average {load:.2f} at the start, {args.runs} runs each, address {address}" + ("" if args.address else " (refused: start-up alone)"))
    print("| command | median | least | imports | heavy modules loaded |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        csv_path = Path(scratch) / "orders.csv"
        csv_path.write_text("id,region,amount\n1,eu,10\n2,us,25.5\n")
        for name, command_args in commands(csv_path):
            command = argv(command_args, address)
            # Run elsewhere: `python -m` puts the working directory first on the path.
            times = [timed(command, env, Path(scratch)) for _ in range(args.runs)]
            seconds, heavy = imports(command, env, Path(scratch))
            print(f"| `{name}` | {statistics.median(times) * 1000:.0f} ms | {min(times) * 1000:.0f} ms | {seconds * 1000:.0f} ms | {', '.join(heavy) or 'none'} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
