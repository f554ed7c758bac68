"""The JVM class archive (`replica_service/_class_archive.py`): made once, by one of
concurrent callers, whole and checked or not at all; mapped by every JVM launched after
it; one cut short (which would crash the JVM) not used."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from replica_service import _class_archive, _spark

ROOT = Path(__file__).resolve().parent.parent


def runs(train: str, check: str = "") -> list[str]:
    """Stand-ins for the training and check runs: Python code run with `verb` and
    `path`, the archive's file."""
    code = f"import sys, time; verb, path = sys.argv[1:3]\nif verb == '--train': {train}\nelse: {check or 'pass'}"
    return [sys.executable, "-c", code]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_concurrent_callers_make_the_archive_once(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "runs"
    monkeypatch.setattr(_class_archive, "COMMAND", runs(f"open({str(log)!r}, 'a').write('trained '); time.sleep(0.5); open(path, 'w').write('classes')"))
    assert _class_archive.archive_option("-Xss2m") == ""

    stem = _class_archive._stem("-Xss2m")
    cache.mkdir()
    stem.with_name(f"{stem.name}.99999.partial").write_text("left by a builder killed mid-way")

    with ThreadPoolExecutor(4) as pool:
        made = set(pool.map(lambda _: _class_archive.build("-Xss2m"), range(4)))

    (archive,) = made
    assert archive.read_text() == "classes" and log.read_text() == "trained "
    assert archive.name.endswith("-7.jsa")  # its size
    assert sorted(p.suffix for p in cache.iterdir()) == [".jsa", ".lock"]  # the stale one gone
    assert _class_archive.archive_option("-Xss2m") == f"-XX:SharedArchiveFile={archive}"
    assert _class_archive.archive_path("-Xss4m") is None  # other JVM options, another archive


def test_a_build_says_which_run_is_under_way(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50: the demo was silent for 70-80 s while it made the archive; a caller
    that shows progress is told of each run as it starts, and only when one runs."""
    monkeypatch.setattr(_class_archive, "COMMAND", runs("open(path, 'w').write('classes')"))
    told: list[str] = []
    assert _class_archive.build("-Xss2m", on_run=told.append) is not None
    assert told == [_class_archive.RUNS["--train"], _class_archive.RUNS["--check"]]
    assert _class_archive.build("-Xss2m", on_run=told.append) is not None and len(told) == 2  # made: no run


@pytest.mark.parametrize(
    "train, check, logged",
    [
        ("open(path, 'w').write('half'); sys.exit('no heap')", "", "the training run failed (exit 1): no heap"),
        ("open(path, 'w').write('classes')", "sys.exit('Unable to use shared archive')", "no JVM could map it (exit 1): Unable to use shared archive"),
        ("open(path, 'w').write('half'); time.sleep(30)", "", "--train took over 1 s"),
    ],
    ids=["training_failed", "check_failed", "training_timed_out"],
)
def test_a_failed_run_leaves_no_archive(cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, train: str, check: str, logged: str) -> None:
    monkeypatch.setattr(_class_archive, "COMMAND", runs(train, check))
    with caplog.at_level(logging.WARNING):
        assert _class_archive.build("-Xss2m", timeout_s=1) is None
    assert logged in caplog.text
    assert [p.suffix for p in cache.iterdir()] == [".lock"]  # nothing half-written
    assert _class_archive.archive_option("-Xss2m") == ""


def test_the_cache_keeps_the_newest_archives(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other installs' archives (made for other JVM options here), older with each; the
    one published is returned even if another vanishes while the cache is pruned."""
    cache.mkdir()
    others = []
    for age in range(_class_archive.KEEP + 1):
        stem = _class_archive._stem(f"-Xss{age + 1}m")
        others.append(stem.with_name(f"{stem.name}-7.jsa"))
        others[-1].write_text("classes")
        os.utime(others[-1], ns=(10**18 - age * 10**9,) * 2)
    # An archive gone between the listing and its stat (another install's builder
    # pruned it): a link to nothing.
    (cache / "spark-gone-7.jsa").symlink_to(cache / "nothing")
    monkeypatch.setattr(_class_archive, "COMMAND", runs("open(path, 'w').write('classes')"))

    newest = _class_archive.build("-Xss64m")

    assert sorted(cache.glob("*.jsa")) == sorted([newest, *others[: _class_archive.KEEP - 1]])
    assert _class_archive.archive_path(f"-Xss{_class_archive.KEEP + 1}m") is None


def test_an_archive_cut_short_is_not_used(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_class_archive, "COMMAND", runs("open(path, 'w').write('classes')"))
    archive = _class_archive.build("-Xss2m")
    assert archive is not None
    archive.chmod(0o644)
    archive.write_text("class")  # a JVM mapping it would die of SIGBUS
    assert _class_archive.archive_option("-Xss2m") == ""


def test_a_cache_that_cannot_be_written_means_no_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "taken").write_text("a file where the cache directory would be")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "taken" / "tandem"))
    with caplog.at_level(logging.WARNING):
        assert _class_archive.build("-Xss2m") is None
    assert "no JVM class archive" in caplog.text


MAPPED = """
import tempfile
from pathlib import Path
from replica_service import _spark
session = _spark.start_session(_spark.SparkSettings("local[1]"), Path(tempfile.mkdtemp()))
maps = Path(f"/proc/{session.sparkContext._gateway.proc.pid}/maps").read_text()
archives = sorted({line.split()[-1] for line in maps.splitlines() if line.endswith(".jsa")})
print(session.range(7).count(), *archives)
"""


def _mapped() -> tuple[str, list[str]]:
    """Start a session in a new process: its answer to a query, and the archives its JVM
    maps, the JDK's own archive of its classes aside."""
    run = subprocess.run([sys.executable, "-c", MAPPED], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    answer, *archives = run.stdout.split()
    return answer, [a for a in archives if "/lib/server/" not in a]


@pytest.mark.spark
def test_a_jvm_launched_maps_the_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = _class_archive.archive_path(_spark.DRIVER_JVM_OPTIONS)
    assert archive is not None, "the suite makes it first (conftest.py)"
    assert _mapped() == ("7", [str(archive)])

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # none there
    assert _mapped() == ("7", [])
