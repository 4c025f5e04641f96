from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemoryStatus(_message.Message):
    __slots__ = ("draft_resident", "draft_state", "total_kv_blocks", "free_kv_blocks", "draft_bytes", "draft_kv_blocks", "kv_capacity_blocks", "pending_action", "last_error", "offloads", "reloads", "failed_reloads", "migrated_blocks", "last_order_ms", "pending_orders", "queue_limit")
    DRAFT_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_ACTION_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    RELOADS_FIELD_NUMBER: _ClassVar[int]
    FAILED_RELOADS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_ORDER_MS_FIELD_NUMBER: _ClassVar[int]
    PENDING_ORDERS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    draft_resident: bool
    draft_state: str
    total_kv_blocks: int
    free_kv_blocks: int
    draft_bytes: int
    draft_kv_blocks: int
    kv_capacity_blocks: int
    pending_action: str
    last_error: str
    offloads: int
    reloads: int
    failed_reloads: int
    migrated_blocks: int
    last_order_ms: float
    pending_orders: _containers.RepeatedCompositeFieldContainer[PendingOrder]
    queue_limit: int
    def __init__(self, draft_resident: bool = ..., draft_state: _Optional[str] = ..., total_kv_blocks: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., draft_bytes: _Optional[int] = ..., draft_kv_blocks: _Optional[int] = ..., kv_capacity_blocks: _Optional[int] = ..., pending_action: _Optional[str] = ..., last_error: _Optional[str] = ..., offloads: _Optional[int] = ..., reloads: _Optional[int] = ..., failed_reloads: _Optional[int] = ..., migrated_blocks: _Optional[int] = ..., last_order_ms: _Optional[float] = ..., pending_orders: _Optional[_Iterable[_Union[PendingOrder, _Mapping]]] = ..., queue_limit: _Optional[int] = ...) -> None: ...

class PendingOrder(_message.Message):
    __slots__ = ("order_id", "action", "source", "running", "expires_in_s")
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    order_id: int
    action: str
    source: str
    running: bool
    expires_in_s: float
    def __init__(self, order_id: _Optional[int] = ..., action: _Optional[str] = ..., source: _Optional[str] = ..., running: bool = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class OffloadDraftRequest(_message.Message):
    __slots__ = ("expand_kv",)
    EXPAND_KV_FIELD_NUMBER: _ClassVar[int]
    expand_kv: bool
    def __init__(self, expand_kv: bool = ...) -> None: ...

class ReloadDraftRequest(_message.Message):
    __slots__ = ("compact_kv",)
    COMPACT_KV_FIELD_NUMBER: _ClassVar[int]
    compact_kv: bool
    def __init__(self, compact_kv: bool = ...) -> None: ...

class ExpandKvRequest(_message.Message):
    __slots__ = ("target_kv_blocks",)
    TARGET_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    target_kv_blocks: int
    def __init__(self, target_kv_blocks: _Optional[int] = ...) -> None: ...

class CompactKvRequest(_message.Message):
    __slots__ = ("target_kv_blocks",)
    TARGET_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    target_kv_blocks: int
    def __init__(self, target_kv_blocks: _Optional[int] = ...) -> None: ...

class CancelOrderRequest(_message.Message):
    __slots__ = ("order_id",)
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    order_id: int
    def __init__(self, order_id: _Optional[int] = ...) -> None: ...

class CancelOrderResponse(_message.Message):
    __slots__ = ("cancelled_order_ids", "status")
    CANCELLED_ORDER_IDS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    cancelled_order_ids: _containers.RepeatedScalarFieldContainer[int]
    status: MemoryStatus
    def __init__(self, cancelled_order_ids: _Optional[_Iterable[int]] = ..., status: _Optional[_Union[MemoryStatus, _Mapping]] = ...) -> None: ...
