"""A short seeded chaos run with real processes (`bench/chaos.py` runs longer ones):
appends and retractions, dataflow creates and drops, peeks, kill -9 of both replicas and
of the controller, proxy cuts, delays and partitions; then every answer is checked
against the same query computed in Python on the storage snapshot at its timestamp.
`TANDEM_CHAOS_SEED` picks another seed; a failure names the seed that replays it."""

from __future__ import annotations

import os

import pytest

from bench import chaos

pytestmark = pytest.mark.spark

SECONDS = 60


def test_a_seeded_chaos_run_gives_no_wrong_answer(tmp_path):
    seed = int(os.environ.get("TANDEM_CHAOS_SEED", "1124"))
    report = chaos.run(tmp_path, SECONDS, seed)
    print(report)
    assert report.answers >= 20, report  # enough reads got through to mean something
    assert not report.mismatches, (
        f"{report}\n" + "\n".join(report.mismatches) + f"\nreplay: .venv/bin/python bench/chaos.py --seconds {SECONDS} --seed {seed}"
    )
