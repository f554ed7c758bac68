"""`python -m replica_service`: run one replica process.

Prints one JSON line (`{"address": ..., "pid": ...}`) on stdout once the gRPC server
listens, logs to stderr, and shuts down cleanly on SIGTERM or SIGINT. A process whose
Spark master cannot run it (`spark://` unreachable, or the application not registered)
prints `{"error": ...}` instead, one line naming the master, and exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from catalog import Catalog
from protocol.security import ServerSecurity, add_server_arguments
from replica_service._crashes import CrashRecord
from replica_service._replica import Replica
from replica_service._server import ReplicaServer
from replica_service._spark import (
    SparkSettings,
    SparkUnavailable,
    set_aside_startup_objects,
    start_replica_session,
)
from storage import Storage


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m replica_service", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:0", help="address to bind (default 127.0.0.1:0)")
    parser.add_argument("--catalog", required=True, help="SQLAlchemy URL of the catalog")
    parser.add_argument(
        "--blob-dir",
        "--blob-uri",
        dest="blob_dir",
        required=True,
        metavar="LOCATION",
        help="where storage batch files live: a directory, file:///abs/dir or s3://bucket/prefix",
    )
    parser.add_argument("--spark-master", default="local[1]", help="Spark master (default local[1])")
    parser.add_argument("--driver-memory", default="512m", help="Spark driver memory (default 512m)")
    parser.add_argument(
        "--driver-host",
        default="127.0.0.1",
        help="the address executors reach the Spark driver at: on a cluster, one of this host's "
        "that they can reach (default 127.0.0.1)",
    )
    parser.add_argument(
        "--driver-bind-address", help="the interface the Spark driver listens on (default: the driver host)"
    )
    parser.add_argument(
        "--spark-conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark setting (repeatable)"
    )
    parser.add_argument("--work-dir", type=Path, help="scratch directory (default: a new temporary one)")
    parser.add_argument(
        "--crash-file",
        type=Path,
        help="where to remember, across restarts, the dataflows that were computing when the JVM died",
    )
    parser.add_argument(
        "--http-listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="where to serve Prometheus metrics at /metrics, or off (default: %(default)s, a free port; "
        "the controller shows it in status)",
    )
    parser.add_argument("--log-level", default="INFO")
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    try:
        args.spark_conf = dict(item.split("=", 1) for item in args.spark_conf)
    except ValueError:
        parser.error("--spark-conf takes KEY=VALUE")
    try:  # read now: a bad flag or file stops the start before Spark does
        args.security = ServerSecurity.of(args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    return args


async def serve(args: argparse.Namespace) -> None:
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="tandem-replica-"))
    try:
        await _serve(args, work_dir)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)


async def _serve(args: argparse.Namespace, work_dir: Path) -> None:
    storage = Storage(Catalog.open(args.catalog), args.blob_dir)
    settings = SparkSettings(
        args.spark_master,
        args.driver_memory,
        args.spark_conf,
        driver_host=args.driver_host,
        driver_bind_address=args.driver_bind_address or args.driver_host,
    )
    # The JVM is launched (fork + exec) before gRPC starts its threads: a fork while
    # gRPC's threads run broke the launch (the JVM exited before reporting its port).
    session = start_replica_session(settings, work_dir)
    replica = Replica(storage, settings, work_dir, session, CrashRecord(args.crash_file))
    server = ReplicaServer(replica, args.listen, args.security)
    await server.start()
    set_aside_startup_objects()
    if args.http_listen != "off":
        try:
            replica.metrics.serve(args.http_listen)
        except (OSError, ValueError) as error:
            await server.stop(grace=0)
            raise SystemExit(f"cannot serve metrics on {args.http_listen}: {error}") from None
    print(json.dumps({"address": server.address, "pid": os.getpid()}), flush=True)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()
    logging.getLogger(__name__).info("shutting down")
    await server.stop(grace=2)
    replica.metrics.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format=f"%(asctime)s replica[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        asyncio.run(serve(args))
    except SparkUnavailable as error:
        # For whoever started the process (the orchestrator names it in its refusal).
        print(json.dumps({"error": str(error)}), flush=True)
        logging.getLogger(__name__).error("%s", error)
        sys.exit(2)


if __name__ == "__main__":
    main()
