from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMPORT_KIND_UNSPECIFIED: _ClassVar[ImportKind]
    IMPORT_KIND_STORAGE: _ClassVar[ImportKind]
    IMPORT_KIND_INDEX: _ClassVar[ImportKind]

class DataflowStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATAFLOW_STRATEGY_UNSPECIFIED: _ClassVar[DataflowStrategy]
    DATAFLOW_STRATEGY_RECOMPUTE: _ClassVar[DataflowStrategy]
    DATAFLOW_STRATEGY_INCREMENTAL: _ClassVar[DataflowStrategy]

class PredicateOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREDICATE_OP_UNSPECIFIED: _ClassVar[PredicateOp]
    PREDICATE_OP_EQ: _ClassVar[PredicateOp]
    PREDICATE_OP_NE: _ClassVar[PredicateOp]
    PREDICATE_OP_LT: _ClassVar[PredicateOp]
    PREDICATE_OP_LE: _ClassVar[PredicateOp]
    PREDICATE_OP_GT: _ClassVar[PredicateOp]
    PREDICATE_OP_GE: _ClassVar[PredicateOp]
    PREDICATE_OP_IN: _ClassVar[PredicateOp]
    PREDICATE_OP_IS_NULL: _ClassVar[PredicateOp]
    PREDICATE_OP_IS_NOT_NULL: _ClassVar[PredicateOp]

class RefusalCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_CODE_UNSPECIFIED: _ClassVar[RefusalCode]
    REFUSAL_CODE_STALE_EPOCH: _ClassVar[RefusalCode]
    REFUSAL_CODE_PROTOCOL_VIOLATION: _ClassVar[RefusalCode]
IMPORT_KIND_UNSPECIFIED: ImportKind
IMPORT_KIND_STORAGE: ImportKind
IMPORT_KIND_INDEX: ImportKind
DATAFLOW_STRATEGY_UNSPECIFIED: DataflowStrategy
DATAFLOW_STRATEGY_RECOMPUTE: DataflowStrategy
DATAFLOW_STRATEGY_INCREMENTAL: DataflowStrategy
PREDICATE_OP_UNSPECIFIED: PredicateOp
PREDICATE_OP_EQ: PredicateOp
PREDICATE_OP_NE: PredicateOp
PREDICATE_OP_LT: PredicateOp
PREDICATE_OP_LE: PredicateOp
PREDICATE_OP_GT: PredicateOp
PREDICATE_OP_GE: PredicateOp
PREDICATE_OP_IN: PredicateOp
PREDICATE_OP_IS_NULL: PredicateOp
PREDICATE_OP_IS_NOT_NULL: PredicateOp
REFUSAL_CODE_UNSPECIFIED: RefusalCode
REFUSAL_CODE_STALE_EPOCH: RefusalCode
REFUSAL_CODE_PROTOCOL_VIOLATION: RefusalCode

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Frontier(_message.Message):
    __slots__ = ("time", "empty")
    TIME_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    time: int
    empty: Empty
    def __init__(self, time: _Optional[int] = ..., empty: _Optional[_Union[Empty, _Mapping]] = ...) -> None: ...

class Scalar(_message.Message):
    __slots__ = ("null_value", "bool_value", "int_value", "double_value", "string_value")
    NULL_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    null_value: Empty
    bool_value: bool
    int_value: int
    double_value: float
    string_value: str
    def __init__(self, null_value: _Optional[_Union[Empty, _Mapping]] = ..., bool_value: _Optional[bool] = ..., int_value: _Optional[int] = ..., double_value: _Optional[float] = ..., string_value: _Optional[str] = ...) -> None: ...

class ScalarList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[Scalar]
    def __init__(self, values: _Optional[_Iterable[_Union[Scalar, _Mapping]]] = ...) -> None: ...

class StringList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class InstanceConfig(_message.Message):
    __slots__ = ("name", "spark_conf")
    class SparkConfEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPARK_CONF_FIELD_NUMBER: _ClassVar[int]
    name: str
    spark_conf: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., spark_conf: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ComputeParameters(_message.Message):
    __slots__ = ("max_result_rows", "heartbeat_interval_ms", "input_poll_interval_ms")
    MAX_RESULT_ROWS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    INPUT_POLL_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    max_result_rows: int
    heartbeat_interval_ms: int
    input_poll_interval_ms: int
    def __init__(self, max_result_rows: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., input_poll_interval_ms: _Optional[int] = ...) -> None: ...

class Import(_message.Message):
    __slots__ = ("name", "id", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: str
    kind: ImportKind
    def __init__(self, name: _Optional[str] = ..., id: _Optional[str] = ..., kind: _Optional[_Union[ImportKind, str]] = ...) -> None: ...

class IndexExport(_message.Message):
    __slots__ = ("id", "key")
    ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    id: str
    key: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., key: _Optional[_Iterable[str]] = ...) -> None: ...

class SinkExport(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DataflowDescription(_message.Message):
    __slots__ = ("name", "sql", "imports", "index_exports", "sink_exports", "as_of", "until", "schema", "strategy")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SQL_FIELD_NUMBER: _ClassVar[int]
    IMPORTS_FIELD_NUMBER: _ClassVar[int]
    INDEX_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    SINK_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    AS_OF_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    name: str
    sql: str
    imports: _containers.RepeatedCompositeFieldContainer[Import]
    index_exports: _containers.RepeatedCompositeFieldContainer[IndexExport]
    sink_exports: _containers.RepeatedCompositeFieldContainer[SinkExport]
    as_of: Frontier
    until: Frontier
    schema: str
    strategy: DataflowStrategy
    def __init__(self, name: _Optional[str] = ..., sql: _Optional[str] = ..., imports: _Optional[_Iterable[_Union[Import, _Mapping]]] = ..., index_exports: _Optional[_Iterable[_Union[IndexExport, _Mapping]]] = ..., sink_exports: _Optional[_Iterable[_Union[SinkExport, _Mapping]]] = ..., as_of: _Optional[_Union[Frontier, _Mapping]] = ..., until: _Optional[_Union[Frontier, _Mapping]] = ..., schema: _Optional[str] = ..., strategy: _Optional[_Union[DataflowStrategy, str]] = ...) -> None: ...

class Predicate(_message.Message):
    __slots__ = ("column", "op", "scalar", "values")
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    column: str
    op: PredicateOp
    scalar: Scalar
    values: ScalarList
    def __init__(self, column: _Optional[str] = ..., op: _Optional[_Union[PredicateOp, str]] = ..., scalar: _Optional[_Union[Scalar, _Mapping]] = ..., values: _Optional[_Union[ScalarList, _Mapping]] = ...) -> None: ...

class OrderBy(_message.Message):
    __slots__ = ("column", "descending", "nulls_last")
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    DESCENDING_FIELD_NUMBER: _ClassVar[int]
    NULLS_LAST_FIELD_NUMBER: _ClassVar[int]
    column: str
    descending: bool
    nulls_last: bool
    def __init__(self, column: _Optional[str] = ..., descending: _Optional[bool] = ..., nulls_last: _Optional[bool] = ...) -> None: ...

class RowSetFinishing(_message.Message):
    __slots__ = ("key", "filter", "order_by", "offset", "limit", "projection")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    ORDER_BY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_FIELD_NUMBER: _ClassVar[int]
    key: ScalarList
    filter: _containers.RepeatedCompositeFieldContainer[Predicate]
    order_by: _containers.RepeatedCompositeFieldContainer[OrderBy]
    offset: int
    limit: int
    projection: StringList
    def __init__(self, key: _Optional[_Union[ScalarList, _Mapping]] = ..., filter: _Optional[_Iterable[_Union[Predicate, _Mapping]]] = ..., order_by: _Optional[_Iterable[_Union[OrderBy, _Mapping]]] = ..., offset: _Optional[int] = ..., limit: _Optional[int] = ..., projection: _Optional[_Union[StringList, _Mapping]] = ...) -> None: ...

class IndexTarget(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class SqlTarget(_message.Message):
    __slots__ = ("sql", "imports")
    SQL_FIELD_NUMBER: _ClassVar[int]
    IMPORTS_FIELD_NUMBER: _ClassVar[int]
    sql: str
    imports: _containers.RepeatedCompositeFieldContainer[Import]
    def __init__(self, sql: _Optional[str] = ..., imports: _Optional[_Iterable[_Union[Import, _Mapping]]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("nonce", "min_applied")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    MIN_APPLIED_FIELD_NUMBER: _ClassVar[int]
    nonce: str
    min_applied: int
    def __init__(self, nonce: _Optional[str] = ..., min_applied: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("controller_epoch", "nonce", "resume", "costliest_first")
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    COSTLIEST_FIRST_FIELD_NUMBER: _ClassVar[int]
    controller_epoch: int
    nonce: str
    resume: Resume
    costliest_first: bool
    def __init__(self, controller_epoch: _Optional[int] = ..., nonce: _Optional[str] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., costliest_first: _Optional[bool] = ...) -> None: ...

class CreateInstance(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: InstanceConfig
    def __init__(self, config: _Optional[_Union[InstanceConfig, _Mapping]] = ...) -> None: ...

class InitializationComplete(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateConfiguration(_message.Message):
    __slots__ = ("params",)
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    params: ComputeParameters
    def __init__(self, params: _Optional[_Union[ComputeParameters, _Mapping]] = ...) -> None: ...

class CreateDataflow(_message.Message):
    __slots__ = ("desc",)
    DESC_FIELD_NUMBER: _ClassVar[int]
    desc: DataflowDescription
    def __init__(self, desc: _Optional[_Union[DataflowDescription, _Mapping]] = ...) -> None: ...

class Schedule(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class AllowCompaction(_message.Message):
    __slots__ = ("id", "frontier")
    ID_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_FIELD_NUMBER: _ClassVar[int]
    id: str
    frontier: Frontier
    def __init__(self, id: _Optional[str] = ..., frontier: _Optional[_Union[Frontier, _Mapping]] = ...) -> None: ...

class Peek(_message.Message):
    __slots__ = ("uuid", "index", "sql", "timestamp", "finishing", "timeout_ms")
    UUID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SQL_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    FINISHING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    index: IndexTarget
    sql: SqlTarget
    timestamp: int
    finishing: RowSetFinishing
    timeout_ms: int
    def __init__(self, uuid: _Optional[str] = ..., index: _Optional[_Union[IndexTarget, _Mapping]] = ..., sql: _Optional[_Union[SqlTarget, _Mapping]] = ..., timestamp: _Optional[int] = ..., finishing: _Optional[_Union[RowSetFinishing, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class CancelPeek(_message.Message):
    __slots__ = ("uuid",)
    UUID_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    def __init__(self, uuid: _Optional[str] = ...) -> None: ...

class Subscribe(_message.Message):
    __slots__ = ("uuid", "id", "as_of", "snapshot")
    UUID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    AS_OF_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    id: str
    as_of: int
    snapshot: bool
    def __init__(self, uuid: _Optional[str] = ..., id: _Optional[str] = ..., as_of: _Optional[int] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class CancelSubscribe(_message.Message):
    __slots__ = ("uuid",)
    UUID_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    def __init__(self, uuid: _Optional[str] = ...) -> None: ...

class ComputeCommand(_message.Message):
    __slots__ = ("hello", "create_instance", "initialization_complete", "update_configuration", "create_dataflow", "schedule", "allow_compaction", "peek", "cancel_peek", "subscribe", "cancel_subscribe")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CREATE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZATION_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_CONFIGURATION_FIELD_NUMBER: _ClassVar[int]
    CREATE_DATAFLOW_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_COMPACTION_FIELD_NUMBER: _ClassVar[int]
    PEEK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_PEEK_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    create_instance: CreateInstance
    initialization_complete: InitializationComplete
    update_configuration: UpdateConfiguration
    create_dataflow: CreateDataflow
    schedule: Schedule
    allow_compaction: AllowCompaction
    peek: Peek
    cancel_peek: CancelPeek
    subscribe: Subscribe
    cancel_subscribe: CancelSubscribe
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., create_instance: _Optional[_Union[CreateInstance, _Mapping]] = ..., initialization_complete: _Optional[_Union[InitializationComplete, _Mapping]] = ..., update_configuration: _Optional[_Union[UpdateConfiguration, _Mapping]] = ..., create_dataflow: _Optional[_Union[CreateDataflow, _Mapping]] = ..., schedule: _Optional[_Union[Schedule, _Mapping]] = ..., allow_compaction: _Optional[_Union[AllowCompaction, _Mapping]] = ..., peek: _Optional[_Union[Peek, _Mapping]] = ..., cancel_peek: _Optional[_Union[CancelPeek, _Mapping]] = ..., subscribe: _Optional[_Union[Subscribe, _Mapping]] = ..., cancel_subscribe: _Optional[_Union[CancelSubscribe, _Mapping]] = ...) -> None: ...

class FrontiersResponse(_message.Message):
    __slots__ = ("id", "write_frontier")
    ID_FIELD_NUMBER: _ClassVar[int]
    WRITE_FRONTIER_FIELD_NUMBER: _ClassVar[int]
    id: str
    write_frontier: Frontier
    def __init__(self, id: _Optional[str] = ..., write_frontier: _Optional[_Union[Frontier, _Mapping]] = ...) -> None: ...

class PeekRows(_message.Message):
    __slots__ = ("arrow_ipc", "row_count", "digest")
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    row_count: int
    digest: str
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., row_count: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class PeekError(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class PeekCanceled(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeekResponse(_message.Message):
    __slots__ = ("uuid", "rows", "error", "canceled")
    UUID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CANCELED_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    rows: PeekRows
    error: PeekError
    canceled: PeekCanceled
    def __init__(self, uuid: _Optional[str] = ..., rows: _Optional[_Union[PeekRows, _Mapping]] = ..., error: _Optional[_Union[PeekError, _Mapping]] = ..., canceled: _Optional[_Union[PeekCanceled, _Mapping]] = ...) -> None: ...

class DataflowStatus(_message.Message):
    __slots__ = ("id", "hydrated", "error", "digest", "last_step_ms", "rows_changed", "steps", "digest_time", "hydration_tasks_done", "hydration_tasks_total", "pending_times", "pending_rows", "last_step_times", "retries", "retry_error", "needs_new_session")
    ID_FIELD_NUMBER: _ClassVar[int]
    HYDRATED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    ROWS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_TIME_FIELD_NUMBER: _ClassVar[int]
    HYDRATION_TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    HYDRATION_TASKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PENDING_TIMES_FIELD_NUMBER: _ClassVar[int]
    PENDING_ROWS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    RETRY_ERROR_FIELD_NUMBER: _ClassVar[int]
    NEEDS_NEW_SESSION_FIELD_NUMBER: _ClassVar[int]
    id: str
    hydrated: bool
    error: str
    digest: str
    last_step_ms: int
    rows_changed: int
    steps: int
    digest_time: int
    hydration_tasks_done: int
    hydration_tasks_total: int
    pending_times: int
    pending_rows: int
    last_step_times: int
    retries: int
    retry_error: str
    needs_new_session: str
    def __init__(self, id: _Optional[str] = ..., hydrated: _Optional[bool] = ..., error: _Optional[str] = ..., digest: _Optional[str] = ..., last_step_ms: _Optional[int] = ..., rows_changed: _Optional[int] = ..., steps: _Optional[int] = ..., digest_time: _Optional[int] = ..., hydration_tasks_done: _Optional[int] = ..., hydration_tasks_total: _Optional[int] = ..., pending_times: _Optional[int] = ..., pending_rows: _Optional[int] = ..., last_step_times: _Optional[int] = ..., retries: _Optional[int] = ..., retry_error: _Optional[str] = ..., needs_new_session: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("heartbeat", "dataflows", "dataflows_kept", "dataflows_built", "pid", "errors", "metrics_address")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DATAFLOWS_FIELD_NUMBER: _ClassVar[int]
    DATAFLOWS_KEPT_FIELD_NUMBER: _ClassVar[int]
    DATAFLOWS_BUILT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    heartbeat: int
    dataflows: _containers.RepeatedCompositeFieldContainer[DataflowStatus]
    dataflows_kept: int
    dataflows_built: int
    pid: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    metrics_address: str
    def __init__(self, heartbeat: _Optional[int] = ..., dataflows: _Optional[_Iterable[_Union[DataflowStatus, _Mapping]]] = ..., dataflows_kept: _Optional[int] = ..., dataflows_built: _Optional[int] = ..., pid: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class SubscribeChanges(_message.Message):
    __slots__ = ("time", "arrow_ipc", "row_count")
    TIME_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    time: int
    arrow_ipc: bytes
    row_count: int
    def __init__(self, time: _Optional[int] = ..., arrow_ipc: _Optional[bytes] = ..., row_count: _Optional[int] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("uuid", "lower", "upper", "changes", "error")
    UUID_FIELD_NUMBER: _ClassVar[int]
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    lower: int
    upper: int
    changes: _containers.RepeatedCompositeFieldContainer[SubscribeChanges]
    error: str
    def __init__(self, uuid: _Optional[str] = ..., lower: _Optional[int] = ..., upper: _Optional[int] = ..., changes: _Optional[_Iterable[_Union[SubscribeChanges, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: RefusalCode
    message: str
    def __init__(self, code: _Optional[_Union[RefusalCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class HelloAck(_message.Message):
    __slots__ = ("resumed", "applied")
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    resumed: bool
    applied: int
    def __init__(self, resumed: _Optional[bool] = ..., applied: _Optional[int] = ...) -> None: ...

class ComputeResponse(_message.Message):
    __slots__ = ("nonce", "frontiers", "peek", "status", "refusal", "hello_ack", "subscribe")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    FRONTIERS_FIELD_NUMBER: _ClassVar[int]
    PEEK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    nonce: str
    frontiers: FrontiersResponse
    peek: PeekResponse
    status: StatusResponse
    refusal: Refusal
    hello_ack: HelloAck
    subscribe: SubscribeResponse
    def __init__(self, nonce: _Optional[str] = ..., frontiers: _Optional[_Union[FrontiersResponse, _Mapping]] = ..., peek: _Optional[_Union[PeekResponse, _Mapping]] = ..., status: _Optional[_Union[StatusResponse, _Mapping]] = ..., refusal: _Optional[_Union[Refusal, _Mapping]] = ..., hello_ack: _Optional[_Union[HelloAck, _Mapping]] = ..., subscribe: _Optional[_Union[SubscribeResponse, _Mapping]] = ...) -> None: ...
