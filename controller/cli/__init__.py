"""`tandem`, the command line of a controller, built on `controller.client.Client`.

    tandem demo                      # the tour: start here
    tandem serve --data-dir ./tandem-data
    tandem instance create prod --min-in-sync 1
    tandem replica add prod r1 --size small
    tandem source create orders --schema "id BIGINT NOT NULL, region STRING, amount DOUBLE"
    tandem source append orders --csv orders.csv
    tandem dataflow create prod totals --sql "SELECT region, sum(amount) AS total FROM orders
        GROUP BY region" --index-key region
    tandem peek prod totals --where region=eu
    tandem status prod --watch
    tandem events --instance prod --follow

Rules:
- Every command but `serve` and `demo` takes `--address` (default `$TANDEM_ADDRESS`, else
  127.0.0.1:6875) and `--json` (JSON on stdout for scripts, instead of aligned tables);
  against a secured controller, `--token-file` (default `$TANDEM_TOKEN`), `--tls-ca` and
  `--tls-client-cert`/`--tls-client-key`. `serve` takes the server's side: `--tls-cert`,
  `--tls-key`, `--tls-client-ca`, `--auth-token-file`.
- Exit codes: 0 done; 1 refused or failed, with `error: <STATUS>: <message>` on stderr;
  2 a usage error (argparse); 130 interrupted.
- Each leaf command is a handler `(client, args) -> data` and a text renderer of that
  data; `--json` prints the data itself, so both outputs always say the same. Tables
  and progress are drawn by rich; progress only on a terminal (on stderr).
- Literals on the command line (`--key`, `--where` values) are read as JSON when they
  parse (42, 1.5, true, null, "42", [1, 2]) and as plain strings otherwise (eu, 2024-01-31).

Modules: `_parser` (the arguments), `_commands` (what each command does), `_render`
(tables and text), `_files` (rows from CSV, JSON lines and Parquet files).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from controller.cli._parser import _parser
from controller.cli._render import format_table
from controller.client import TandemError

__all__ = ["format_table", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The `tandem` console script: run one command; the exit code (see the module)."""
    try:
        args = _parser().parse_args(argv)
        args.run(args)
    except SystemExit as exit:  # argparse: 2 on a usage error, 0 after --help
        return exit.code if isinstance(exit.code, int) else 1
    except TandemError as error:
        print(f"error: {error.code.name}: {error.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0

