from protocol import compute_pb2 as _compute_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Consistency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSISTENCY_UNSPECIFIED: _ClassVar[Consistency]
    CONSISTENCY_SERIALIZABLE: _ClassVar[Consistency]
    CONSISTENCY_STRICT: _ClassVar[Consistency]
CONSISTENCY_UNSPECIFIED: Consistency
CONSISTENCY_SERIALIZABLE: Consistency
CONSISTENCY_STRICT: Consistency

class GetVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetVersionResponse(_message.Message):
    __slots__ = ("server_version", "controller_epoch")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    controller_epoch: int
    def __init__(self, server_version: _Optional[str] = ..., controller_epoch: _Optional[int] = ...) -> None: ...

class GetLeadershipRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControllerView(_message.Message):
    __slots__ = ("role", "address", "host", "pid", "heard_ms_ago")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HEARD_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    host: str
    pid: int
    heard_ms_ago: int
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., heard_ms_ago: _Optional[int] = ...) -> None: ...

class LeadershipView(_message.Message):
    __slots__ = ("epoch", "leader", "lease_remaining_ms", "lease_renewals", "standbys")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_RENEWALS_FIELD_NUMBER: _ClassVar[int]
    STANDBYS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    leader: ControllerView
    lease_remaining_ms: int
    lease_renewals: int
    standbys: _containers.RepeatedCompositeFieldContainer[ControllerView]
    def __init__(self, epoch: _Optional[int] = ..., leader: _Optional[_Union[ControllerView, _Mapping]] = ..., lease_remaining_ms: _Optional[int] = ..., lease_renewals: _Optional[int] = ..., standbys: _Optional[_Iterable[_Union[ControllerView, _Mapping]]] = ...) -> None: ...

class HandoverRequest(_message.Message):
    __slots__ = ("to",)
    TO_FIELD_NUMBER: _ClassVar[int]
    to: str
    def __init__(self, to: _Optional[str] = ...) -> None: ...

class HandoverResponse(_message.Message):
    __slots__ = ("previous", "leader", "epoch", "unavailable_ms")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_MS_FIELD_NUMBER: _ClassVar[int]
    previous: str
    leader: str
    epoch: int
    unavailable_ms: int
    def __init__(self, previous: _Optional[str] = ..., leader: _Optional[str] = ..., epoch: _Optional[int] = ..., unavailable_ms: _Optional[int] = ...) -> None: ...

class TakeLeadRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class StringMap(_message.Message):
    __slots__ = ("entries",)
    class EntriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.ScalarMap[str, str]
    def __init__(self, entries: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CollectionView(_message.Message):
    __slots__ = ("id", "name", "since", "write_frontier", "wallclock_lag_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    WRITE_FRONTIER_FIELD_NUMBER: _ClassVar[int]
    WALLCLOCK_LAG_MS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    since: int
    write_frontier: int
    wallclock_lag_ms: int
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., since: _Optional[int] = ..., write_frontier: _Optional[int] = ..., wallclock_lag_ms: _Optional[int] = ...) -> None: ...

class DataflowStatusView(_message.Message):
    __slots__ = ("hydrated", "error", "digest", "last_step_ms", "rows_changed", "steps", "hydration_tasks_done", "hydration_tasks_total", "pending_times", "pending_rows", "last_step_times", "retries", "retry_error")
    HYDRATED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    ROWS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    HYDRATION_TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    HYDRATION_TASKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PENDING_TIMES_FIELD_NUMBER: _ClassVar[int]
    PENDING_ROWS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    RETRY_ERROR_FIELD_NUMBER: _ClassVar[int]
    hydrated: bool
    error: str
    digest: str
    last_step_ms: int
    rows_changed: int
    steps: int
    hydration_tasks_done: int
    hydration_tasks_total: int
    pending_times: int
    pending_rows: int
    last_step_times: int
    retries: int
    retry_error: str
    def __init__(self, hydrated: _Optional[bool] = ..., error: _Optional[str] = ..., digest: _Optional[str] = ..., last_step_ms: _Optional[int] = ..., rows_changed: _Optional[int] = ..., steps: _Optional[int] = ..., hydration_tasks_done: _Optional[int] = ..., hydration_tasks_total: _Optional[int] = ..., pending_times: _Optional[int] = ..., pending_rows: _Optional[int] = ..., last_step_times: _Optional[int] = ..., retries: _Optional[int] = ..., retry_error: _Optional[str] = ...) -> None: ...

class ReplicaView(_message.Message):
    __slots__ = ("name", "size", "spark_master", "address", "managed", "state", "epoch", "pid", "in_sync", "hydrated", "lag_ms", "peeks_won", "dataflows_kept", "dataflows_built", "resumes", "replays", "errors", "dataflows", "consecutive_failures", "last_failure", "next_retry_ms", "wallclock_lag_ms", "diverged", "slow", "metrics_address")
    class DataflowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: DataflowStatusView
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[DataflowStatusView, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SPARK_MASTER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MANAGED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    HYDRATED_FIELD_NUMBER: _ClassVar[int]
    LAG_MS_FIELD_NUMBER: _ClassVar[int]
    PEEKS_WON_FIELD_NUMBER: _ClassVar[int]
    DATAFLOWS_KEPT_FIELD_NUMBER: _ClassVar[int]
    DATAFLOWS_BUILT_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    DATAFLOWS_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    NEXT_RETRY_MS_FIELD_NUMBER: _ClassVar[int]
    WALLCLOCK_LAG_MS_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_FIELD_NUMBER: _ClassVar[int]
    SLOW_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: str
    spark_master: str
    address: str
    managed: bool
    state: str
    epoch: int
    pid: int
    in_sync: bool
    hydrated: bool
    lag_ms: int
    peeks_won: int
    dataflows_kept: int
    dataflows_built: int
    resumes: int
    replays: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    dataflows: _containers.MessageMap[str, DataflowStatusView]
    consecutive_failures: int
    last_failure: str
    next_retry_ms: int
    wallclock_lag_ms: int
    diverged: str
    slow: bool
    metrics_address: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[str] = ..., spark_master: _Optional[str] = ..., address: _Optional[str] = ..., managed: _Optional[bool] = ..., state: _Optional[str] = ..., epoch: _Optional[int] = ..., pid: _Optional[int] = ..., in_sync: _Optional[bool] = ..., hydrated: _Optional[bool] = ..., lag_ms: _Optional[int] = ..., peeks_won: _Optional[int] = ..., dataflows_kept: _Optional[int] = ..., dataflows_built: _Optional[int] = ..., resumes: _Optional[int] = ..., replays: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ..., dataflows: _Optional[_Mapping[str, DataflowStatusView]] = ..., consecutive_failures: _Optional[int] = ..., last_failure: _Optional[str] = ..., next_retry_ms: _Optional[int] = ..., wallclock_lag_ms: _Optional[int] = ..., diverged: _Optional[str] = ..., slow: _Optional[bool] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class InstanceView(_message.Message):
    __slots__ = ("name", "health", "min_in_sync", "max_lag_ms", "replica_timeout_ms", "max_hold_back_ms", "replace_slow", "history_length", "history_reductions", "commands_pushed", "replicas", "collections", "unavailable_dataflows", "divergences", "events")
    class UnavailableDataflowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    MIN_IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_MS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_HOLD_BACK_MS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_SLOW_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    HISTORY_REDUCTIONS_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIONS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_DATAFLOWS_FIELD_NUMBER: _ClassVar[int]
    DIVERGENCES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    health: str
    min_in_sync: int
    max_lag_ms: int
    replica_timeout_ms: int
    max_hold_back_ms: int
    replace_slow: bool
    history_length: int
    history_reductions: int
    commands_pushed: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaView]
    collections: _containers.RepeatedCompositeFieldContainer[CollectionView]
    unavailable_dataflows: _containers.ScalarMap[str, str]
    divergences: int
    events: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., health: _Optional[str] = ..., min_in_sync: _Optional[int] = ..., max_lag_ms: _Optional[int] = ..., replica_timeout_ms: _Optional[int] = ..., max_hold_back_ms: _Optional[int] = ..., replace_slow: _Optional[bool] = ..., history_length: _Optional[int] = ..., history_reductions: _Optional[int] = ..., commands_pushed: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaView, _Mapping]]] = ..., collections: _Optional[_Iterable[_Union[CollectionView, _Mapping]]] = ..., unavailable_dataflows: _Optional[_Mapping[str, str]] = ..., divergences: _Optional[int] = ..., events: _Optional[_Iterable[str]] = ...) -> None: ...

class SourceView(_message.Message):
    __slots__ = ("id", "name", "schema", "since", "upper", "arrow_schema")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    ARROW_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    schema: str
    since: int
    upper: int
    arrow_schema: bytes
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., schema: _Optional[str] = ..., since: _Optional[int] = ..., upper: _Optional[int] = ..., arrow_schema: _Optional[bytes] = ...) -> None: ...

class DataflowView(_message.Message):
    __slots__ = ("id", "instance", "name", "sql", "schema", "index_id", "index_key", "sink_id", "compaction_window_ms", "strategy", "replicas")
    class ReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: DataflowStatusView
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[DataflowStatusView, _Mapping]] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SQL_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_KEY_FIELD_NUMBER: _ClassVar[int]
    SINK_ID_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_WINDOW_MS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    id: str
    instance: str
    name: str
    sql: str
    schema: str
    index_id: str
    index_key: _compute_pb2.StringList
    sink_id: str
    compaction_window_ms: int
    strategy: str
    replicas: _containers.MessageMap[str, DataflowStatusView]
    def __init__(self, id: _Optional[str] = ..., instance: _Optional[str] = ..., name: _Optional[str] = ..., sql: _Optional[str] = ..., schema: _Optional[str] = ..., index_id: _Optional[str] = ..., index_key: _Optional[_Union[_compute_pb2.StringList, _Mapping]] = ..., sink_id: _Optional[str] = ..., compaction_window_ms: _Optional[int] = ..., strategy: _Optional[str] = ..., replicas: _Optional[_Mapping[str, DataflowStatusView]] = ...) -> None: ...

class ReadResult(_message.Message):
    __slots__ = ("rows_arrow", "timestamp", "replica")
    ROWS_ARROW_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    rows_arrow: bytes
    timestamp: int
    replica: str
    def __init__(self, rows_arrow: _Optional[bytes] = ..., timestamp: _Optional[int] = ..., replica: _Optional[str] = ...) -> None: ...

class CreateInstanceRequest(_message.Message):
    __slots__ = ("name", "min_in_sync", "max_lag_ms", "replica_timeout_ms", "spark_conf", "max_hold_back_ms", "replace_slow")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIN_IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_MS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SPARK_CONF_FIELD_NUMBER: _ClassVar[int]
    MAX_HOLD_BACK_MS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_SLOW_FIELD_NUMBER: _ClassVar[int]
    name: str
    min_in_sync: int
    max_lag_ms: int
    replica_timeout_ms: int
    spark_conf: StringMap
    max_hold_back_ms: int
    replace_slow: bool
    def __init__(self, name: _Optional[str] = ..., min_in_sync: _Optional[int] = ..., max_lag_ms: _Optional[int] = ..., replica_timeout_ms: _Optional[int] = ..., spark_conf: _Optional[_Union[StringMap, _Mapping]] = ..., max_hold_back_ms: _Optional[int] = ..., replace_slow: _Optional[bool] = ...) -> None: ...

class DropInstanceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DropInstanceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceView]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceView, _Mapping]]] = ...) -> None: ...

class AddReplicaRequest(_message.Message):
    __slots__ = ("instance", "name", "size", "spark_master", "spark_conf", "address", "driver_host", "driver_bind_address", "wait", "timeout_ms")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SPARK_MASTER_FIELD_NUMBER: _ClassVar[int]
    SPARK_CONF_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRIVER_HOST_FIELD_NUMBER: _ClassVar[int]
    DRIVER_BIND_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    instance: str
    name: str
    size: str
    spark_master: str
    spark_conf: StringMap
    address: str
    driver_host: str
    driver_bind_address: str
    wait: bool
    timeout_ms: int
    def __init__(self, instance: _Optional[str] = ..., name: _Optional[str] = ..., size: _Optional[str] = ..., spark_master: _Optional[str] = ..., spark_conf: _Optional[_Union[StringMap, _Mapping]] = ..., address: _Optional[str] = ..., driver_host: _Optional[str] = ..., driver_bind_address: _Optional[str] = ..., wait: _Optional[bool] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class DropReplicaRequest(_message.Message):
    __slots__ = ("instance", "name", "force")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    instance: str
    name: str
    force: bool
    def __init__(self, instance: _Optional[str] = ..., name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DropReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResizeRequest(_message.Message):
    __slots__ = ("instance", "size", "timeout_ms", "on_timeout")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ON_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    instance: str
    size: str
    timeout_ms: int
    on_timeout: str
    def __init__(self, instance: _Optional[str] = ..., size: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., on_timeout: _Optional[str] = ...) -> None: ...

class ResizeResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaView]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaView, _Mapping]]] = ...) -> None: ...

class CreateSourceRequest(_message.Message):
    __slots__ = ("name", "schema")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    schema: str
    def __init__(self, name: _Optional[str] = ..., schema: _Optional[str] = ...) -> None: ...

class JsonRows(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rows: _Optional[_Iterable[str]] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("source", "rows_arrow", "rows_json", "idempotency_key")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ROWS_ARROW_FIELD_NUMBER: _ClassVar[int]
    ROWS_JSON_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    source: str
    rows_arrow: bytes
    rows_json: JsonRows
    idempotency_key: str
    def __init__(self, source: _Optional[str] = ..., rows_arrow: _Optional[bytes] = ..., rows_json: _Optional[_Union[JsonRows, _Mapping]] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("timestamp",)
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    timestamp: int
    def __init__(self, timestamp: _Optional[int] = ...) -> None: ...

class DropSourceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DropSourceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSourcesResponse(_message.Message):
    __slots__ = ("sources",)
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[SourceView]
    def __init__(self, sources: _Optional[_Iterable[_Union[SourceView, _Mapping]]] = ...) -> None: ...

class CreateDataflowRequest(_message.Message):
    __slots__ = ("instance", "name", "sql", "index_key", "materialize", "compaction_window_ms", "strategy")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SQL_FIELD_NUMBER: _ClassVar[int]
    INDEX_KEY_FIELD_NUMBER: _ClassVar[int]
    MATERIALIZE_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_WINDOW_MS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    instance: str
    name: str
    sql: str
    index_key: _compute_pb2.StringList
    materialize: bool
    compaction_window_ms: int
    strategy: str
    def __init__(self, instance: _Optional[str] = ..., name: _Optional[str] = ..., sql: _Optional[str] = ..., index_key: _Optional[_Union[_compute_pb2.StringList, _Mapping]] = ..., materialize: _Optional[bool] = ..., compaction_window_ms: _Optional[int] = ..., strategy: _Optional[str] = ...) -> None: ...

class DropDataflowRequest(_message.Message):
    __slots__ = ("instance", "name")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    instance: str
    name: str
    def __init__(self, instance: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class DropDataflowResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDataflowsRequest(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: str
    def __init__(self, instance: _Optional[str] = ...) -> None: ...

class ListDataflowsResponse(_message.Message):
    __slots__ = ("dataflows",)
    DATAFLOWS_FIELD_NUMBER: _ClassVar[int]
    dataflows: _containers.RepeatedCompositeFieldContainer[DataflowView]
    def __init__(self, dataflows: _Optional[_Iterable[_Union[DataflowView, _Mapping]]] = ...) -> None: ...

class PeekRequest(_message.Message):
    __slots__ = ("instance", "name", "key", "where", "order_by", "limit", "offset", "columns", "timestamp", "consistency", "timeout_ms")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    ORDER_BY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    instance: str
    name: str
    key: _compute_pb2.ScalarList
    where: _containers.RepeatedCompositeFieldContainer[_compute_pb2.Predicate]
    order_by: _containers.RepeatedCompositeFieldContainer[_compute_pb2.OrderBy]
    limit: int
    offset: int
    columns: _compute_pb2.StringList
    timestamp: int
    consistency: Consistency
    timeout_ms: int
    def __init__(self, instance: _Optional[str] = ..., name: _Optional[str] = ..., key: _Optional[_Union[_compute_pb2.ScalarList, _Mapping]] = ..., where: _Optional[_Iterable[_Union[_compute_pb2.Predicate, _Mapping]]] = ..., order_by: _Optional[_Iterable[_Union[_compute_pb2.OrderBy, _Mapping]]] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ..., columns: _Optional[_Union[_compute_pb2.StringList, _Mapping]] = ..., timestamp: _Optional[int] = ..., consistency: _Optional[_Union[Consistency, str]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("instance", "sql", "timestamp", "consistency", "timeout_ms")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SQL_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    instance: str
    sql: str
    timestamp: int
    consistency: Consistency
    timeout_ms: int
    def __init__(self, instance: _Optional[str] = ..., sql: _Optional[str] = ..., timestamp: _Optional[int] = ..., consistency: _Optional[_Union[Consistency, str]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: str
    def __init__(self, instance: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceView]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceView, _Mapping]]] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("instance", "after", "limit")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    instance: str
    after: int
    limit: int
    def __init__(self, instance: _Optional[str] = ..., after: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class EventView(_message.Message):
    __slots__ = ("id", "at_ms", "instance", "kind", "replica", "message")
    ID_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: int
    at_ms: int
    instance: str
    kind: str
    replica: str
    message: str
    def __init__(self, id: _Optional[int] = ..., at_ms: _Optional[int] = ..., instance: _Optional[str] = ..., kind: _Optional[str] = ..., replica: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[EventView]
    def __init__(self, events: _Optional[_Iterable[_Union[EventView, _Mapping]]] = ...) -> None: ...

class ListStorageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HoldView(_message.Message):
    __slots__ = ("holder", "owner", "frontier", "held_back_ms")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_FIELD_NUMBER: _ClassVar[int]
    HELD_BACK_MS_FIELD_NUMBER: _ClassVar[int]
    holder: str
    owner: str
    frontier: int
    held_back_ms: int
    def __init__(self, holder: _Optional[str] = ..., owner: _Optional[str] = ..., frontier: _Optional[int] = ..., held_back_ms: _Optional[int] = ...) -> None: ...

class StorageView(_message.Message):
    __slots__ = ("id", "name", "kind", "since", "upper", "holds")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    kind: str
    since: int
    upper: int
    holds: _containers.RepeatedCompositeFieldContainer[HoldView]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[str] = ..., since: _Optional[int] = ..., upper: _Optional[int] = ..., holds: _Optional[_Iterable[_Union[HoldView, _Mapping]]] = ...) -> None: ...

class ListStorageResponse(_message.Message):
    __slots__ = ("collections",)
    COLLECTIONS_FIELD_NUMBER: _ClassVar[int]
    collections: _containers.RepeatedCompositeFieldContainer[StorageView]
    def __init__(self, collections: _Optional[_Iterable[_Union[StorageView, _Mapping]]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("instance", "name", "as_of", "up_to", "snapshot", "progress")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    AS_OF_FIELD_NUMBER: _ClassVar[int]
    UP_TO_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    instance: str
    name: str
    as_of: int
    up_to: int
    snapshot: bool
    progress: bool
    def __init__(self, instance: _Optional[str] = ..., name: _Optional[str] = ..., as_of: _Optional[int] = ..., up_to: _Optional[int] = ..., snapshot: _Optional[bool] = ..., progress: _Optional[bool] = ...) -> None: ...

class SubscribeBatch(_message.Message):
    __slots__ = ("arrow_ipc", "progress")
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    progress: int
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., progress: _Optional[int] = ...) -> None: ...
