"""Offload a draft model's weights to host memory and bring them back, verified.

Offload copies every parameter and buffer to host memory (pinned when CUDA exists),
keeps that copy, fingerprints the device tensors, and releases the device memory by
pointing each tensor at an empty one; a later offload of unchanged weights (same
fingerprints) reuses the kept copy instead of copying again. Reload copies the host
tensors back — on a side stream with non-blocking copies on CUDA, so the calling thread
only pays the dispatch — and :meth:`DraftWeights.finish_reload` waits for the copies and
checks every tensor's fingerprint before the draft counts as resident again. A mismatch
(a stale or corrupted copy: the failure vLLM's sleep mode is known for) releases the
reloaded tensors and raises, so speculation stays off.

A draft can be given a *home* (:meth:`DraftWeights.settle`): fixed views its tensors
live in — the KV buffer's top blocks (draft_slot.py). Then offloading copies and releases
nothing (the host copy is already there; the home's bytes go to the KV cache) and a reload
writes the host copy back into the home, so the tensors keep their addresses.

The fingerprint is computed on the tensor's own device: its 32-bit words weighted by
position, summed in 64-bit — it catches changed, swapped or zeroed words.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from typing import Any

import torch


class ReloadError(RuntimeError):
    """Reloaded weights do not match what was offloaded; the draft stays offloaded."""


class DraftState(enum.StrEnum):
    RESIDENT = "resident"
    OFFLOADED = "offloaded"
    RELOADING = "reloading"


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    tensors: int
    bytes: int
    # Time the calling thread spent (dispatch only, for a non-blocking reload on CUDA).
    call_seconds: float


_CHUNK = 1 << 20


def _position_weights(device: torch.device) -> torch.Tensor:
    return torch.arange(_CHUNK, device=device, dtype=torch.int64) % 251 + 1


def _weighted_sum(tensor: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The fingerprint as a 0-d tensor on the tensor's device (nothing waits for it)."""
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    # Two kernels a chunk (the product promotes to int64 inside the multiplication): a
    # draft has hundreds of small tensors, and launches are what verifying them costs.
    parts = []
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK]
        parts.append((chunk * weights[: chunk.numel()]).sum())
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=raw.device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def fingerprint(tensor: torch.Tensor) -> int:
    """Position-weighted sum of the tensor's 32-bit words (bytes when the size is not a
    multiple of 4), in 64-bit wrapping arithmetic, computed where the tensor lives, in
    chunks so that no full-size temporary is made."""
    return fingerprints({"": tensor})[""]


def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """:func:`fingerprint` of each tensor, read back with one synchronisation per device
    rather than one per tensor (a draft has hundreds of tensors)."""
    sums: dict[torch.device, dict[str, torch.Tensor]] = {}
    weights: dict[torch.device, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tensor.device not in weights:
            weights[tensor.device] = _position_weights(tensor.device)
        sums.setdefault(tensor.device, {})[name] = _weighted_sum(tensor, weights[tensor.device])
    prints: dict[str, int] = {}
    for per_device in sums.values():
        values = torch.stack(list(per_device.values())).tolist()
        prints.update(zip(per_device, (int(v) for v in values), strict=True))
    return prints


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


class DraftWeights:
    """Owns the host copy of one draft model's weights while it is offloaded."""

    def __init__(self, module: torch.nn.Module, shared_with: torch.nn.Module | None = None) -> None:
        """``shared_with``: a module whose tensors the draft may alias (an EAGLE head
        shares the target's embedding and LM head); those stay where they are."""
        self.module = module
        self._shared = (
            {t.data_ptr() for t in _tensors(shared_with).values() if t.numel()}
            if shared_with is not None
            else set()
        )
        self.state = DraftState.RESIDENT
        self._host: dict[str, torch.Tensor] = {}
        self._prints: dict[str, int] = {}
        self._device: dict[str, torch.device] = {}
        self._incoming: dict[str, torch.Tensor] = {}
        self._done: Any = None  # CUDA event of a pending reload
        self._home: dict[str, torch.Tensor] = {}  # fixed views the tensors live in, if any
        # Every name of each moved tensor (tied weights: an LM head that is the embedding).
        self._aliases: dict[str, list[str]] = {}

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        return {
            name: t
            for name, t in _tensors(self.module).items()
            if t.data_ptr() not in self._shared or not t.numel()
        }

    def _alias_groups(self) -> dict[str, list[str]]:
        """Each own, non-empty tensor's first name → all its names. Tied weights (one
        Parameter under two names, or two Parameters over the same memory) are one
        tensor: moved once, and every name gets it back."""
        groups: dict[tuple[object, ...], list[str]] = {}
        for name, t in self._own_tensors().items():
            if t.numel():
                key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                groups.setdefault(key, []).append(name)
        return {names[0]: names for names in groups.values()}

    def movable_tensors(self) -> dict[str, torch.Tensor]:
        """The draft's own, non-empty tensors, each once: what an offload moves."""
        tensors = self._own_tensors()
        return {name: tensors[name] for name in self._alias_groups()}

    @property
    def nbytes(self) -> int:
        """Bytes the draft's own tensors occupy on the device while resident."""
        return sum(t.numel() * t.element_size() for t in self.movable_tensors().values())

    @property
    def homed(self) -> bool:
        return bool(self._home)

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """The host copies of an offloaded draft (shapes and dtypes of what comes back)."""
        return dict(self._host)

    def settle(self, home: dict[str, torch.Tensor]) -> Transfer:
        """Move an offloaded draft into ``home`` (a view per offloaded tensor, same shape
        and dtype) and verify it there; from now on it lives at those addresses."""
        if self.state is not DraftState.OFFLOADED or set(home) != set(self._host):
            raise RuntimeError("settle needs an offloaded draft and a view for each tensor")
        self._home = home
        self.start_reload()
        try:
            return self.finish_reload()
        except ReloadError:
            self._home = {}
            raise

    def restore(self) -> None:
        """Bring an offloaded draft back into memory of its own (no home), verified."""
        if self.state is DraftState.OFFLOADED:
            self._home = {}
            self.start_reload()
            self.finish_reload()

    def offload(self) -> Transfer:
        if self.state is not DraftState.RESIDENT:
            raise RuntimeError(f"cannot offload a draft that is {self.state.value}")
        started = time.perf_counter()
        if self._home:
            # The host copy and fingerprints are from settle() and weights do not change:
            # the home's bytes are simply the KV cache's from now on.
            self.state = DraftState.OFFLOADED
            nbytes = sum(t.numel() * t.element_size() for t in self._host.values())
            return Transfer(len(self._host), nbytes, time.perf_counter() - started)
        aliases = self._alias_groups()
        tensors = _tensors(self.module)
        movable = self.movable_tensors()
        prints = fingerprints(movable)
        # Every host copy first (what can fail: pinned memory runs out), then the release:
        # a failed offload leaves the draft resident and this object as it was.
        copies = {
            name: self._host_copy(name, tensor, prints[name]) for name, tensor in movable.items()
        }
        self._aliases, self._host, self._prints = aliases, copies, prints
        for name, tensor in movable.items():
            self._device[name] = tensor.device
            # Release the device memory (under every name); the module keeps its structure.
            empty = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            for alias in aliases[name]:
                tensors[alias].data = empty
        self.state = DraftState.OFFLOADED
        total = sum(host.numel() * host.element_size() for host in copies.values())
        return Transfer(len(copies), total, time.perf_counter() - started)

    def _host_copy(self, name: str, tensor: torch.Tensor, print_: int) -> torch.Tensor:
        """The host copy of ``tensor``: the copy of an earlier offload while it still holds
        these bytes (weights do not change while serving; the fingerprint says whether
        they did), else a new one."""
        host = self._host.get(name)
        if (
            host is not None
            and print_ == self._prints.get(name)
            and (host.shape, host.dtype) == (tensor.shape, tensor.dtype)
        ):
            return host
        host = torch.empty(
            tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available()
        )
        host.copy_(tensor.detach())
        return host

    def start_reload(self) -> Transfer:
        """Begin copying the host copy back; returns after dispatch on CUDA."""
        if self.state is not DraftState.OFFLOADED:
            raise RuntimeError(f"cannot reload a draft that is {self.state.value}")
        started = time.perf_counter()
        on_cuda = any(device.type == "cuda" for device in self._device.values())
        self.state = DraftState.RELOADING  # from here a failure is undone as a reload's
        stream = None
        try:
            # Allocate on the calling stream, which uses the weights afterwards: memory
            # taken on the side stream would go back to that stream's cache when freed.
            for name, host in self._host.items():
                target = self._home.get(name)
                if target is None:
                    target = torch.empty(host.shape, dtype=host.dtype, device=self._device[name])
                self._incoming[name] = target
            stream = torch.cuda.Stream() if on_cuda else None
            if stream is not None:
                # Work queued before (a KV migration out of the home) must finish first.
                stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for name, host in self._host.items():
                    self._incoming[name].copy_(host, non_blocking=on_cuda)
                if stream is not None:
                    self._done = torch.cuda.Event()
                    self._done.record(stream)
        except BaseException:
            if stream is not None:
                stream.synchronize()  # copies queued before the failure still write
            self.abandon_reload()
            raise
        nbytes = sum(t.numel() * t.element_size() for t in self._host.values())
        return Transfer(len(self._host), nbytes, time.perf_counter() - started)

    def abandon_reload(self) -> None:
        """Drop a reload that failed before it verified: the draft stays offloaded (its host
        copy kept). A copy still running is waited for first: its targets are freed."""
        if self.state is not DraftState.RELOADING:
            return
        done, self._done = self._done, None
        try:
            if done is not None:
                done.synchronize()
        finally:
            self._incoming.clear()
            self.state = DraftState.OFFLOADED

    def finish_reload(self) -> Transfer:
        """Wait for the copies, verify them, and make the draft resident again."""
        if self.state is not DraftState.RELOADING:
            raise RuntimeError(f"no reload in progress (draft is {self.state.value})")
        started = time.perf_counter()
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        got = fingerprints(self._incoming)
        bad = [name for name, value in got.items() if value != self._prints[name]]
        if bad:
            self._incoming.clear()
            self.state = DraftState.OFFLOADED
            raise ReloadError(f"reloaded draft weights differ from the offloaded ones: {bad[:5]}")
        tensors = _tensors(self.module)
        for name, incoming in self._incoming.items():
            for alias in self._aliases.get(name, [name]):
                tensors[alias].data = incoming
        self._incoming.clear()
        self.state = DraftState.RESIDENT
        nbytes = sum(t.numel() * t.element_size() for t in self._host.values())
        return Transfer(len(self._host), nbytes, time.perf_counter() - started)
