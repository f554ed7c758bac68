"""The Tandem controller: per instance, a reducible command history replayed to every
replica, the first response taken, frontiers tracked, failed replicas rehydrated, and
everything recoverable from the catalog.

Modules: `_instance` (the sans-I/O state machine), `_driver` and `_connection` (its
asyncio driver), `_orchestrator` (replica processes), `_planner` (analysis-only Spark),
`runtime` (the running controller behind `ControllerApi`), `_service` (the gRPC API),
`client` (the Python client) and `cli` (`tandem`). Importing this package loads only
the client side: the runtime brings Spark and the catalog, and is imported by `tandem
serve` alone.
"""

from controller._api import ControllerError
from controller.client import Client, TandemError

__all__ = ["Client", "ControllerError", "TandemError"]
