from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemoryStatus(_message.Message):
    __slots__ = ("draft_resident", "draft_state", "total_kv_blocks", "free_kv_blocks", "draft_bytes", "draft_kv_blocks", "kv_capacity_blocks", "pending_action", "last_error", "offloads", "reloads", "failed_reloads", "migrated_blocks", "last_order_ms")
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
    def __init__(self, draft_resident: bool = ..., draft_state: _Optional[str] = ..., total_kv_blocks: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., draft_bytes: _Optional[int] = ..., draft_kv_blocks: _Optional[int] = ..., kv_capacity_blocks: _Optional[int] = ..., pending_action: _Optional[str] = ..., last_error: _Optional[str] = ..., offloads: _Optional[int] = ..., reloads: _Optional[int] = ..., failed_reloads: _Optional[int] = ..., migrated_blocks: _Optional[int] = ..., last_order_ms: _Optional[float] = ...) -> None: ...

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
