"""A controller process for tests: `tandem serve` on a data directory, killed or stopped
at will, with the replica processes it spawned cleaned up afterwards.

The product's own helper (`controller._process`), which the demo and the examples use
too; re-exported under the names the tests have always imported.
"""

from __future__ import annotations

from controller._process import ControllerProcess, embedded_controller, kill_replicas

__all__ = ["ControllerProcess", "embedded_controller", "kill_replicas"]
