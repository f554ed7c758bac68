"""Regenerate the committed protobuf and gRPC modules from the `.proto` files here.

    python -m protocol.codegen          # rewrite protocol/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python -m protocol.codegen --check  # exit 1, naming each stale file, and change nothing

Every `protocol/*.proto` is compiled with `-I <repo root>`, so generated imports are
package-absolute (`from protocol import compute_pb2`). Regeneration goes through a temporary
directory and then makes `protocol/` hold exactly the fresh output: changed files are
rewritten, generated files whose `.proto` is gone are removed. The output depends on the
grpcio-tools version (it stamps its protobuf and grpc versions into the files), so
`--check` is meaningful only with the version the project pins. Never edit generated files
by hand.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Sequence

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
_GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def generate(root: Path, out: Path) -> None:
    """Compile every `root/protocol/*.proto` into `out/protocol/`."""
    protos = sorted(str(path) for path in (root / "protocol").glob("*.proto"))
    # The well-known types (google/protobuf/*.proto), as `python -m grpc_tools.protoc` does.
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos} (its errors are above)")


def changed_files(root: Path = ROOT) -> dict[str, bytes | None]:
    """The generated files in `root/protocol/` that regenerating would change: file name ->
    fresh content, or None for a generated file that should not exist. Empty when fresh."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(root, Path(tmp))
        fresh = _generated_files(Path(tmp) / "protocol")
    committed = _generated_files(root / "protocol")
    return {
        name: fresh.get(name)
        for name in sorted(fresh.keys() | committed.keys())
        if fresh.get(name) != committed.get(name)
    }


def regenerate(root: Path = ROOT) -> list[str]:
    """Make `root/protocol/` hold exactly the fresh generated files; the names changed."""
    changes = changed_files(root)
    for name, content in changes.items():
        path = root / "protocol" / name
        if content is None:
            path.unlink()
        else:
            path.write_bytes(content)
    return list(changes)


def main(argv: Sequence[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m protocol.codegen",
        description="Regenerate the protobuf and gRPC modules in protocol/.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 naming each generated file that is stale",
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = changed_files(root)
        for name in stale:
            print(f"stale: protocol/{name} (run `python -m protocol.codegen`)", file=sys.stderr)
        return 1 if stale else 0
    for name in regenerate(root):
        print(f"regenerated protocol/{name}")
    return 0


def _generated_files(directory: Path) -> dict[str, bytes]:
    return {
        path.name: path.read_bytes()
        for pattern in _GENERATED
        for path in directory.glob(pattern)
    }


if __name__ == "__main__":
    sys.exit(main())
