"""The committed generated modules match their `.proto` files, and the check that says
so names what is stale."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from protocol import codegen

GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def test_committed_generated_modules_are_fresh():
    result = subprocess.run(
        [sys.executable, "-m", "protocol.codegen", "--check"],
        cwd=codegen.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"run `python -m protocol.codegen`:\n{result.stderr}"


def _copy_protocol(to: Path) -> Path:
    """A repo root under `to` holding a copy of the .proto files and generated modules."""
    (to / "protocol").mkdir()
    for pattern in ("*.proto", *GENERATED):
        for path in (codegen.ROOT / "protocol").glob(pattern):
            shutil.copy(path, to / "protocol")
    return to


def test_check_names_stale_and_orphaned_files(tmp_path, capsys):
    root = _copy_protocol(tmp_path)
    stale = root / "protocol" / "compute_pb2.py"
    stale.write_text(stale.read_text() + "# edited by hand\n")
    (root / "protocol" / "gone_pb2.py").write_text("# its .proto was deleted\n")

    assert codegen.main(["--check"], root=root) == 1
    err = capsys.readouterr().err
    assert "stale: protocol/compute_pb2.py" in err
    assert "stale: protocol/gone_pb2.py" in err
    assert "controller_pb2" not in err
    assert "edited by hand" in stale.read_text()  # --check changes nothing


def test_regenerating_makes_the_check_pass(tmp_path):
    root = _copy_protocol(tmp_path)
    (root / "protocol" / "controller_pb2.pyi").unlink()
    (root / "protocol" / "gone_pb2_grpc.py").write_text("")

    assert codegen.regenerate(root) == ["controller_pb2.pyi", "gone_pb2_grpc.py"]
    assert codegen.changed_files(root) == {}
    assert not (root / "protocol" / "gone_pb2_grpc.py").exists()
