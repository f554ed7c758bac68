"""The dataflows that were computing when this replica's JVM died, across incarnations.

A step that exhausts the JVM's heap kills it (Spark exits the JVM on an
`OutOfMemoryError` in a task), and with it the replica process: the controller then
starts a new incarnation, which would run the same step and die the same way, forever.
So before exiting, the replica records the dataflows whose steps were in flight in a
file that outlives the process (`--crash-file`, kept by the orchestrator per replica);
an incarnation that is asked to build a dataflow recorded `MAX_JVM_DEATHS` times marks
it failed instead of computing it, and reports why. Dataflow ids are never reused, so a
record never blames a new dataflow.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

MAX_JVM_DEATHS = 2
"""Deaths of the JVM during a dataflow's steps after which a replica stops computing it."""


class CrashRecord:
    """The record in `path` (None: nothing is remembered across incarnations)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._deaths: dict[str, dict[str, object]] = {}
        if path is not None and path.exists():
            try:
                self._deaths = json.loads(path.read_text())["dataflows"]
            except (OSError, ValueError, KeyError) as e:
                log.warning("ignoring unreadable crash record %s: %s", path, e)

    def refusal(self, dataflow_id: str) -> str | None:
        """Why this replica will not compute `dataflow_id`, or None."""
        entry = self._deaths.get(dataflow_id)
        if entry is None or int(entry["deaths"]) < MAX_JVM_DEATHS:
            return None
        return (
            f"the replica's JVM died {entry['deaths']} times while computing this dataflow "
            f"(last: {entry['cause']}); it is not computed on this replica again"
        )

    def record(self, dataflow_ids: set[str], cause: str) -> None:
        """Count one death for each of `dataflow_ids` (durably: the process exits next)."""
        if self.path is None or not dataflow_ids:
            return
        for id in dataflow_ids:
            entry = self._deaths.setdefault(id, {"deaths": 0, "cause": ""})
            entry["deaths"] = int(entry["deaths"]) + 1
            entry["cause"] = cause
        temporary = self.path.with_suffix(".tmp")
        with open(temporary, "w") as file:
            json.dump({"dataflows": self._deaths}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)
