"""Instances and replicas: operations over an explicit session.

Rules: every function takes the session of the caller's transaction and neither commits
nor rolls back; it checks its arguments and the current state before it changes
anything, and raises a typed error otherwise. Results are frozen records.

An instance's `spark_conf` decides *results*, so it is fixed at creation:
`DETERMINISTIC_SPARK_CONF` merged with the caller's overrides. Resource settings
(master, cores, memory, the driver's address) belong to replicas, which in turn may not
touch a setting that decides results.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from catalog._checks import check_conf, check_int, check_name, check_text
from catalog._errors import AlreadyExists, InvalidArgument, NotFound
from catalog._models import Instance, Replica
from catalog._records import InstanceInfo, ReplicaInfo, instance_info, replica_info
from history import ComputeParameters

DETERMINISTIC_SPARK_CONF: Mapping[str, str] = {
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.sql.files.minPartitionNum": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.ansi.enabled": "true",
    # Replicas hand Arrow tables to Spark, which cuts them into partitions of this many
    # rows: it decides partitioning, and with it the last bits of float sums.
    "spark.sql.execution.arrow.maxRecordsPerBatch": "10000",
}
"""The Spark settings every instance starts from (DESIGN section 7): they fix
partitioning, ANSI mode and the time zone, so every replica computes the same rows."""

RESOURCE_SPARK_CONF = frozenset(
    {
        "spark.master",
        "spark.cores.max",
        "spark.driver.cores",
        "spark.driver.memory",
        "spark.executor.cores",
        "spark.executor.instances",
        "spark.executor.memory",
        # Where executors reach this replica's driver: each replica's own address.
        "spark.driver.host",
        "spark.driver.bindAddress",
    }
)
"""Settings that only decide resources and placement: a replica's business, never an
instance's."""

DEFAULT_MIN_IN_SYNC = 1
DEFAULT_MAX_LAG_MS = 5_000
DEFAULT_REPLICA_TIMEOUT_MS = 30_000
DEFAULT_MAX_HOLD_BACK_MS = 300_000

UNSET: Any = type("Unset", (), {"__repr__": lambda self: "UNSET"})()
"""Marks an `update_replica` argument that keeps its recorded value."""


def _parameters_to_db(parameters: object) -> dict[str, int]:
    if not isinstance(parameters, ComputeParameters):
        raise InvalidArgument(f"parameters must be history.ComputeParameters, not {parameters!r}")
    result = {}
    for field in fields(ComputeParameters):
        value = getattr(parameters, field.name)
        if value is not None:
            result[field.name] = check_int(f"parameter {field.name}", value, minimum=1)
    return result


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be true or false, not {value!r}")
    return value


def _instance_row(session: Session, name: str) -> Instance:
    row = session.get(Instance, name)
    if row is None:
        raise NotFound(f"instance {name!r} does not exist")
    return row


def create_instance(
    session: Session,
    name: str,
    *,
    spark_conf: Mapping[str, str],
    min_in_sync: int,
    max_lag_ms: int,
    replica_timeout_ms: int,
    max_hold_back_ms: int,
    replace_slow: bool,
    parameters: ComputeParameters,
) -> InstanceInfo:
    check_name("instance", name)
    overrides = check_conf("instance spark_conf", spark_conf)
    for key in overrides:
        if key in RESOURCE_SPARK_CONF:
            raise InvalidArgument(
                f"{key} is a resource setting: give it to a replica, not to instance {name!r}"
            )
    row = Instance(
        name=name,
        spark_conf={**DETERMINISTIC_SPARK_CONF, **overrides},
        min_in_sync=check_int("min_in_sync", min_in_sync, minimum=1),
        max_lag_ms=check_int("max_lag_ms", max_lag_ms, minimum=0),
        replica_timeout_ms=check_int("replica_timeout_ms", replica_timeout_ms, minimum=1),
        max_hold_back_ms=check_int("max_hold_back_ms", max_hold_back_ms, minimum=1),
        replace_slow=_check_bool("replace_slow", replace_slow),
        parameters=_parameters_to_db(parameters),
    )
    if session.get(Instance, name) is not None:
        raise AlreadyExists(f"instance {name!r} already exists")
    session.add(row)
    session.flush()
    return instance_info(row)


def update_instance(
    session: Session,
    name: str,
    *,
    min_in_sync: int | None,
    max_lag_ms: int | None,
    replica_timeout_ms: int | None,
    max_hold_back_ms: int | None,
    replace_slow: bool | None,
    parameters: ComputeParameters | None,
) -> InstanceInfo:
    """Options given replace the recorded ones; `parameters` is merged into the recorded
    parameters (a `None` field keeps its value), as `UpdateConfiguration` does."""
    updates: dict[str, Any] = {}
    if min_in_sync is not None:
        updates["min_in_sync"] = check_int("min_in_sync", min_in_sync, minimum=1)
    if max_lag_ms is not None:
        updates["max_lag_ms"] = check_int("max_lag_ms", max_lag_ms, minimum=0)
    if replica_timeout_ms is not None:
        updates["replica_timeout_ms"] = check_int(
            "replica_timeout_ms", replica_timeout_ms, minimum=1
        )
    if max_hold_back_ms is not None:
        updates["max_hold_back_ms"] = check_int("max_hold_back_ms", max_hold_back_ms, minimum=1)
    if replace_slow is not None:
        updates["replace_slow"] = _check_bool("replace_slow", replace_slow)
    newer = None if parameters is None else _parameters_to_db(parameters)
    row = _instance_row(session, name)
    for key, value in updates.items():
        setattr(row, key, value)
    if newer:
        row.parameters = {**row.parameters, **newer}
    session.flush()
    return instance_info(row)


def get_instance(session: Session, name: str) -> InstanceInfo:
    return instance_info(_instance_row(session, name))


def list_instances(session: Session) -> list[InstanceInfo]:
    rows = session.scalars(select(Instance).order_by(Instance.name))
    return [instance_info(row) for row in rows]


# --- Replicas -------------------------------------------------------------------------


def _replica_row(session: Session, instance: str, name: str) -> Replica:
    row = session.get(Replica, (instance, name))
    if row is None:
        _instance_row(session, instance)
        raise NotFound(f"instance {instance!r} has no replica {name!r}")
    return row


def create_replica(
    session: Session,
    instance: str,
    name: str,
    *,
    size: str,
    spark_master: str,
    spark_conf: Mapping[str, str],
    address: str | None,
) -> ReplicaInfo:
    check_name("replica", name)
    check_text("replica size", size, max_length=64)
    check_text("spark_master", spark_master)
    conf = check_conf("replica spark_conf", spark_conf)
    if address is not None:
        check_text("replica address", address)
    instance_row = _instance_row(session, instance)
    for key in conf:
        if key in instance_row.spark_conf or key in DETERMINISTIC_SPARK_CONF:
            raise InvalidArgument(
                f"{key} decides results, so it is a setting of instance {instance!r} "
                f"and the same on every replica; replica {name!r} may not override it"
            )
    if session.get(Replica, (instance, name)) is not None:
        raise AlreadyExists(f"instance {instance!r} already has a replica {name!r}")
    row = Replica(
        instance_name=instance,
        name=name,
        size=size,
        spark_master=spark_master,
        spark_conf=conf,
        managed=address is None,
        address=address,
        pid=None,
        process_start=None,
        incarnation=0,
    )
    session.add(row)
    session.flush()
    return replica_info(row)


def update_replica(
    session: Session,
    instance: str,
    name: str,
    *,
    address: str | None = UNSET,
    pid: int | None = UNSET,
    process_start: str | None = UNSET,
    incarnation: int = UNSET,
) -> ReplicaInfo:
    """Record where a replica runs. An external replica keeps its address; the
    incarnation never regresses. A new pid replaces the process start recorded with the
    last one (None unless given with it)."""
    row = _replica_row(session, instance, name)
    if address is not UNSET:
        if address is not None:
            check_text("replica address", address)
        if not row.managed and address != row.address:
            raise InvalidArgument(
                f"replica {name!r} of {instance!r} is external: its address "
                f"{row.address!r} is fixed (drop it and add it again to move it)"
            )
    if pid is not UNSET and pid is not None:
        check_int("pid", pid, minimum=1)
    if process_start is not UNSET and process_start is not None:
        check_text("process start", process_start, max_length=64)
    if pid is not UNSET and process_start is UNSET:
        process_start = None
    elif pid is UNSET and process_start is not UNSET:
        raise InvalidArgument("a process start is recorded with the pid it is of")
    if incarnation is not UNSET:
        check_int("incarnation", incarnation, minimum=row.incarnation)
    for key, value in (("address", address), ("pid", pid), ("process_start", process_start), ("incarnation", incarnation)):
        if value is not UNSET:
            setattr(row, key, value)
    session.flush()
    return replica_info(row)


def drop_replica(session: Session, instance: str, name: str) -> None:
    session.delete(_replica_row(session, instance, name))
    session.flush()


def get_replica(session: Session, instance: str, name: str) -> ReplicaInfo:
    return replica_info(_replica_row(session, instance, name))


def list_replicas(session: Session, instance: str | None) -> list[ReplicaInfo]:
    query = select(Replica).order_by(Replica.instance_name, Replica.name)
    if instance is not None:
        _instance_row(session, instance)
        query = query.where(Replica.instance_name == instance)
    return [replica_info(row) for row in session.scalars(query)]
