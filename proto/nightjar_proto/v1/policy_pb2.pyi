from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestSignals(_message.Message):
    __slots__ = ("request_id", "context_tokens", "recent_accepts", "kl_divergence", "draft_entropy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECENT_ACCEPTS_FIELD_NUMBER: _ClassVar[int]
    KL_DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_tokens: int
    recent_accepts: _containers.RepeatedScalarFieldContainer[int]
    kl_divergence: float
    draft_entropy: float
    def __init__(self, request_id: _Optional[str] = ..., context_tokens: _Optional[int] = ..., recent_accepts: _Optional[_Iterable[int]] = ..., kl_divergence: _Optional[float] = ..., draft_entropy: _Optional[float] = ...) -> None: ...

class StepContext(_message.Message):
    __slots__ = ("engine_id", "step_index", "batch_size", "num_waiting", "free_kv_blocks", "total_kv_blocks", "max_draft_lag_tokens", "draft_resident", "previous_gamma", "max_gamma", "learner_key", "requests", "context_tokens", "min_draft_passes", "runtime")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LAG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    LEARNER_KEY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_PASSES_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    step_index: int
    batch_size: int
    num_waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    max_draft_lag_tokens: int
    draft_resident: bool
    previous_gamma: int
    max_gamma: int
    learner_key: str
    requests: _containers.RepeatedCompositeFieldContainer[RequestSignals]
    context_tokens: int
    min_draft_passes: int
    runtime: EngineRuntime
    def __init__(self, engine_id: _Optional[str] = ..., step_index: _Optional[int] = ..., batch_size: _Optional[int] = ..., num_waiting: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., max_draft_lag_tokens: _Optional[int] = ..., draft_resident: bool = ..., previous_gamma: _Optional[int] = ..., max_gamma: _Optional[int] = ..., learner_key: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[RequestSignals, _Mapping]]] = ..., context_tokens: _Optional[int] = ..., min_draft_passes: _Optional[int] = ..., runtime: _Optional[_Union[EngineRuntime, _Mapping]] = ...) -> None: ...

class EngineRuntime(_message.Message):
    __slots__ = ("engine_version", "model_runner", "async_scheduling", "method")
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_RUNNER_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    engine_version: str
    model_runner: str
    async_scheduling: bool
    method: str
    def __init__(self, engine_version: _Optional[str] = ..., model_runner: _Optional[str] = ..., async_scheduling: bool = ..., method: _Optional[str] = ...) -> None: ...

class StepOutcome(_message.Message):
    __slots__ = ("decision_id", "engine_id", "gamma", "step_seconds", "generated_tokens", "drafted_tokens", "accepted_tokens", "requests", "prefill_tokens", "draft_gamma", "request_accepted_tokens")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_GAMMA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    decision_id: str
    engine_id: str
    gamma: int
    step_seconds: float
    generated_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestAccepts]
    prefill_tokens: int
    draft_gamma: int
    request_accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, decision_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., gamma: _Optional[int] = ..., step_seconds: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestAccepts, _Mapping]]] = ..., prefill_tokens: _Optional[int] = ..., draft_gamma: _Optional[int] = ..., request_accepted_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestAccepts(_message.Message):
    __slots__ = ("request_id", "accepted_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class RequestGamma(_message.Message):
    __slots__ = ("request_id", "gamma")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    gamma: int
    def __init__(self, request_id: _Optional[str] = ..., gamma: _Optional[int] = ...) -> None: ...

class MemoryDirective(_message.Message):
    __slots__ = ("action", "target_kv_blocks", "reason")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACTION_UNSPECIFIED: _ClassVar[MemoryDirective.Action]
        OFFLOAD_DRAFT_EXPAND_KV: _ClassVar[MemoryDirective.Action]
        COMPACT_KV_RELOAD_DRAFT: _ClassVar[MemoryDirective.Action]
    ACTION_UNSPECIFIED: MemoryDirective.Action
    OFFLOAD_DRAFT_EXPAND_KV: MemoryDirective.Action
    COMPACT_KV_RELOAD_DRAFT: MemoryDirective.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    action: MemoryDirective.Action
    target_kv_blocks: int
    reason: str
    def __init__(self, action: _Optional[_Union[MemoryDirective.Action, str]] = ..., target_kv_blocks: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class GammaTable(_message.Message):
    __slots__ = ("table_id", "policy_version", "first_batch_size", "gammas", "exploring", "speculation_off", "step_index", "valid_steps", "valid_ms", "memory_directive", "policy_name", "reason", "request_gammas", "reads_request_signals", "any_speculation_state", "exploit_gammas")
    TABLE_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FIRST_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GAMMAS_FIELD_NUMBER: _ClassVar[int]
    EXPLORING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_OFF_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    VALID_STEPS_FIELD_NUMBER: _ClassVar[int]
    VALID_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    POLICY_NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GAMMAS_FIELD_NUMBER: _ClassVar[int]
    READS_REQUEST_SIGNALS_FIELD_NUMBER: _ClassVar[int]
    ANY_SPECULATION_STATE_FIELD_NUMBER: _ClassVar[int]
    EXPLOIT_GAMMAS_FIELD_NUMBER: _ClassVar[int]
    table_id: str
    policy_version: str
    first_batch_size: int
    gammas: _containers.RepeatedScalarFieldContainer[int]
    exploring: _containers.RepeatedScalarFieldContainer[bool]
    speculation_off: bool
    step_index: int
    valid_steps: int
    valid_ms: float
    memory_directive: MemoryDirective
    policy_name: str
    reason: str
    request_gammas: _containers.RepeatedCompositeFieldContainer[RequestGamma]
    reads_request_signals: bool
    any_speculation_state: bool
    exploit_gammas: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table_id: _Optional[str] = ..., policy_version: _Optional[str] = ..., first_batch_size: _Optional[int] = ..., gammas: _Optional[_Iterable[int]] = ..., exploring: _Optional[_Iterable[bool]] = ..., speculation_off: bool = ..., step_index: _Optional[int] = ..., valid_steps: _Optional[int] = ..., valid_ms: _Optional[float] = ..., memory_directive: _Optional[_Union[MemoryDirective, _Mapping]] = ..., policy_name: _Optional[str] = ..., reason: _Optional[str] = ..., request_gammas: _Optional[_Iterable[_Union[RequestGamma, _Mapping]]] = ..., reads_request_signals: bool = ..., any_speculation_state: bool = ..., exploit_gammas: _Optional[_Iterable[int]] = ...) -> None: ...

class RanStep(_message.Message):
    __slots__ = ("decision_id", "context", "gamma", "exploited")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    EXPLOITED_FIELD_NUMBER: _ClassVar[int]
    decision_id: str
    context: StepContext
    gamma: int
    exploited: bool
    def __init__(self, decision_id: _Optional[str] = ..., context: _Optional[_Union[StepContext, _Mapping]] = ..., gamma: _Optional[int] = ..., exploited: bool = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("seq", "context", "ran_steps", "outcomes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RAN_STEPS_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    context: StepContext
    ran_steps: _containers.RepeatedCompositeFieldContainer[RanStep]
    outcomes: _containers.RepeatedCompositeFieldContainer[StepOutcome]
    def __init__(self, seq: _Optional[int] = ..., context: _Optional[_Union[StepContext, _Mapping]] = ..., ran_steps: _Optional[_Iterable[_Union[RanStep, _Mapping]]] = ..., outcomes: _Optional[_Iterable[_Union[StepOutcome, _Mapping]]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("seq", "error", "policy_version", "table", "skipped", "skipped_reason")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    error: StepError
    policy_version: str
    table: GammaTable
    skipped: int
    skipped_reason: str
    def __init__(self, seq: _Optional[int] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., policy_version: _Optional[str] = ..., table: _Optional[_Union[GammaTable, _Mapping]] = ..., skipped: _Optional[int] = ..., skipped_reason: _Optional[str] = ...) -> None: ...
