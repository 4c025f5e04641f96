from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStateRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("policy_name", "policy_version", "params_json", "state_json", "decisions_total", "reports_total", "engine_ids", "last_snapshot_unix", "memory_json", "engines_json", "fleet_json")
    POLICY_NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REPORTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_SNAPSHOT_UNIX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_JSON_FIELD_NUMBER: _ClassVar[int]
    ENGINES_JSON_FIELD_NUMBER: _ClassVar[int]
    FLEET_JSON_FIELD_NUMBER: _ClassVar[int]
    policy_name: str
    policy_version: str
    params_json: str
    state_json: str
    decisions_total: int
    reports_total: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    last_snapshot_unix: float
    memory_json: str
    engines_json: str
    fleet_json: str
    def __init__(self, policy_name: _Optional[str] = ..., policy_version: _Optional[str] = ..., params_json: _Optional[str] = ..., state_json: _Optional[str] = ..., decisions_total: _Optional[int] = ..., reports_total: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ..., last_snapshot_unix: _Optional[float] = ..., memory_json: _Optional[str] = ..., engines_json: _Optional[str] = ..., fleet_json: _Optional[str] = ...) -> None: ...

class ListPoliciesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyInfo(_message.Message):
    __slots__ = ("name", "description", "default_params_json", "active")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    default_params_json: str
    active: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., default_params_json: _Optional[str] = ..., active: bool = ...) -> None: ...

class ListPoliciesResponse(_message.Message):
    __slots__ = ("policies",)
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    policies: _containers.RepeatedCompositeFieldContainer[PolicyInfo]
    def __init__(self, policies: _Optional[_Iterable[_Union[PolicyInfo, _Mapping]]] = ...) -> None: ...

class SwapPolicyRequest(_message.Message):
    __slots__ = ("name", "params_json", "keep_state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    KEEP_STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    params_json: str
    keep_state: bool
    def __init__(self, name: _Optional[str] = ..., params_json: _Optional[str] = ..., keep_state: bool = ...) -> None: ...

class SwapPolicyResponse(_message.Message):
    __slots__ = ("policy_name", "policy_version")
    POLICY_NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_name: str
    policy_version: str
    def __init__(self, policy_name: _Optional[str] = ..., policy_version: _Optional[str] = ...) -> None: ...

class SetParametersRequest(_message.Message):
    __slots__ = ("params_json",)
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    params_json: str
    def __init__(self, params_json: _Optional[str] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("path", "created_unix")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    path: str
    created_unix: float
    def __init__(self, path: _Optional[str] = ..., created_unix: _Optional[float] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("path", "snapshot_json")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_JSON_FIELD_NUMBER: _ClassVar[int]
    path: str
    snapshot_json: str
    def __init__(self, path: _Optional[str] = ..., snapshot_json: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("policy_name", "policy_version")
    POLICY_NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_name: str
    policy_version: str
    def __init__(self, policy_name: _Optional[str] = ..., policy_version: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: str
    def __init__(self, policy_version: _Optional[str] = ...) -> None: ...
