"""The dependency direction of DESIGN section 1, read from the source with `ast`.

Every `import` and `from ... import` in every .py file of a package counts, wherever it
sits (module level, inside a function, under `if TYPE_CHECKING:`), and so does
`importlib.import_module("name")` with a literal name. A package may import itself, any
third-party package, and of ours only what the table allows; `history` may import the
standard library and nothing else, and not even `asyncio` or `sqlite3` from it: the pure
model knows nothing of event loops or SQL.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent

OURS = ("history", "protocol", "catalog", "migrations", "storage", "replica_service", "controller")

# Package -> the packages of ours it may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "history": frozenset(),
    "protocol": frozenset({"history"}),
    "catalog": frozenset({"history"}),
    "migrations": frozenset({"catalog", "history"}),  # history through catalog's types
    "storage": frozenset({"catalog", "history"}),
    # catalog: a replica constructs its Storage over a Catalog.
    "replica_service": frozenset({"history", "protocol", "storage", "catalog"}),
    "controller": frozenset(OURS) - {"controller"},
}

# Generated protobuf modules belong to protocol and may import nothing else of ours.
GENERATED_ALLOWED = frozenset({"protocol"})

HISTORY_FORBIDDEN_STDLIB = frozenset({"asyncio", "sqlite3"})

# Not packages of ours: where tests, examples and benchmarks live, and tooling.
NOT_PACKAGES = frozenset({"tests", "examples", "bench", "build", "dist"})


@dataclass(frozen=True)
class ImportSite:
    path: Path
    where: str  # "file:line", relative to the repository root
    module: str  # the absolute dotted name imported ("" for an unresolvable one)
    statement: str

    def __str__(self) -> str:
        return f"{self.where}: {self.statement}"


def python_files(package: str) -> list[Path]:
    directory = ROOT / package
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


def is_generated(path: Path) -> bool:
    return "_pb2" in path.stem


def _resolve_relative(relative: Path, level: int, module: str | None) -> str:
    """The absolute name of `from <level dots><module> import ...` in the file at
    `relative` (to the root), or "" when the dots climb out of the top-level package."""
    parts = list(relative.parts[:-1])  # the file's package
    if level - 1 >= len(parts):
        return ""
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(path: Path, root: Path = ROOT) -> Iterator[ImportSite]:
    relative = path.relative_to(root)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        where = f"{relative}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield ImportSite(path, where, alias.name, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            names = ", ".join(alias.name for alias in node.names)
            statement = f"from {'.' * node.level}{node.module or ''} import {names}"
            module = node.module or ""
            if node.level:
                module = _resolve_relative(relative, node.level, node.module)
            yield ImportSite(path, where, module, statement)
        elif isinstance(node, ast.Call) and _is_import_module_call(node):
            name = node.args[0].value
            yield ImportSite(path, where, name, f"import_module({name!r})")


def _is_import_module_call(node: ast.Call) -> bool:
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
    )
    return (
        named
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and not node.args[0].value.startswith(".")
    )


def violation(package: str, site: ImportSite) -> str | None:
    """Why `site` may not be in `package`, or None when it may."""
    if not site.module:
        return "a relative import that climbs out of its package"
    top = site.module.split(".")[0]
    if top == package:
        return None
    generated = is_generated(site.path)
    allowed = GENERATED_ALLOWED if generated else ALLOWED[package]
    if top in OURS:
        if top in allowed:
            return None
        what = "generated protobuf modules" if generated else package
        return f"{what} may import {sorted(allowed) or 'nothing'} of ours, not {top}"
    if _is_sibling_module(site.path, top):
        return f"an implicit relative import: use `from {package} import {top}`"
    if package == "history":
        if top not in sys.stdlib_module_names:
            return "history may import only the standard library"
        if top in HISTORY_FORBIDDEN_STDLIB:
            return f"history may not import {top}: the pure model knows nothing of it"
    return None


def _is_sibling_module(path: Path, name: str) -> bool:
    """`import compute_pb2` next to compute_pb2.py works only with the package directory
    on sys.path, which it never is once installed."""
    if name in sys.stdlib_module_names:
        return False
    return (path.parent / f"{name}.py").exists() or (path.parent / name / "__init__.py").exists()


def violations(package: str) -> list[str]:
    found = []
    for path in python_files(package):
        for site in imports_of(path):
            reason = violation(package, site)
            if reason is not None:
                found.append(f"{site}  <- {reason}")
    return found


@pytest.mark.parametrize("package", OURS)
def test_package_imports_only_what_design_section_1_allows(package):
    found = violations(package)
    assert not found, f"{package}: forbidden imports:\n" + "\n".join(found)


def test_every_package_in_the_repository_is_covered():
    """A new top-level package must be added to the table, not slip past it."""
    packages = {
        p.parent.name
        for p in ROOT.glob("*/__init__.py")
        if p.parent.name not in NOT_PACKAGES and not p.parent.name.startswith(".")
    }
    assert packages <= set(OURS), (
        f"packages missing from the layering table: {sorted(packages - set(OURS))}"
    )
    assert set(ALLOWED) == set(OURS)


def test_history_is_not_empty():
    """Guards the checks above against passing vacuously on a moved tree."""
    files = python_files("history")
    assert any(path.name == "_history.py" for path in files)
    assert any(site.module == "history._commands" for path in files for site in imports_of(path))


# --- The checker itself ------------------------------------------------------------------


def _sites(tmp_path: Path, package: str, relative: str, source: str) -> list[str]:
    """The violations in `source`, written as `package/relative` under tmp_path."""
    path = tmp_path / package / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")
    return [reason for site in imports_of(path, tmp_path) if (reason := violation(package, site))]


def test_checker_finds_imports_anywhere_in_a_file(tmp_path):
    source = (
        "import json\n"
        "def f():\n"
        "    import grpc\n"
        "    from pyspark.sql import SparkSession\n"
        "if False:\n"
        "    import catalog\n"
        "class C:\n"
        "    def g(self):\n"
        "        import importlib\n"
        "        return importlib.import_module('sqlalchemy.orm')\n"
    )
    reasons = _sites(tmp_path, "history", "_bad.py", source)
    assert len(reasons) == 4, reasons
    assert any("not catalog" in r for r in reasons)


def test_checker_forbids_asyncio_in_history_but_not_elsewhere(tmp_path):
    assert _sites(tmp_path, "history", "_a.py", "import asyncio\n")
    assert not _sites(
        tmp_path, "controller", "_a.py", "import asyncio\nimport history\nimport protocol\n"
    )


def test_checker_resolves_relative_imports(tmp_path):
    assert not _sites(tmp_path, "storage", "_a.py", "from . import _b\nfrom ._b import x\n")
    assert not _sites(tmp_path, "migrations", "versions/v1.py", "from .. import env\n")
    assert _sites(tmp_path, "storage", "_a.py", "from .. import controller\n")


def test_checker_holds_generated_modules_to_protocol(tmp_path):
    assert not _sites(tmp_path, "protocol", "x_pb2.py", "from protocol import y_pb2\nimport grpc\n")
    assert _sites(tmp_path, "protocol", "x_pb2_grpc.py", "import history\n")
    (tmp_path / "protocol" / "y_pb2.py").write_text("")
    assert _sites(tmp_path, "protocol", "x_pb2_grpc.py", "import y_pb2 as y\n")


def test_checker_allows_the_table(tmp_path):
    assert not _sites(
        tmp_path, "replica_service", "_a.py", "import history, protocol, storage, catalog\n"
    )
    assert _sites(tmp_path, "replica_service", "_a.py", "from controller import planner\n")
    assert _sites(tmp_path, "storage", "_a.py", "import protocol\n")
    assert _sites(tmp_path, "catalog", "_a.py", "from storage import Storage\n")
    assert _sites(tmp_path, "protocol", "codec.py", "import catalog\n")
