"""The KV buffer and the draft's weights in reserved address ranges that share physical
memory: the draft's chunks are mapped under the KV buffer's top blocks while it is
offloaded, and back under the draft's own range for a reload.

Both ranges are reserved once and never move, so tensors viewed over them — the KV cache
vLLM binds to its layers, the draft's parameters — keep their addresses, and CUDA graphs
captured with them stay valid through any number of offloads and reloads. What changes is
only which physical chunk backs which granule (:mod:`memory_agent.vmm_plan` says which).

While the draft is resident, the KV granules its chunks would back are mapped to a small
*scratch* memory shared by all of them (the same physical chunks under many addresses), so
a stray read or write of a withheld block lands somewhere harmless instead of faulting the
engine. Chunks map whole (CUDA refuses part of one), so the scratch is a chunk as long as
the longest run (at most :data:`SCRATCH_GRANULES`) plus power-of-two chunks for the rest
of longer runs: one call per run in the usual case of runs of one length. The KV cache's
contents there are meaningless, as those blocks are withheld.

Every transition either completes or is undone step by step and raises
:class:`VmmError`, leaving the mappings as they were. The caller synchronises the device
before a transition (the driver's :meth:`Driver.synchronize`): nothing may be reading a
range while its memory is swapped.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from memory_agent.vmm_plan import ElasticPlan

log = logging.getLogger(__name__)

# The largest scratch chunk in granules: runs up to this long take one map call (a
# layer-outermost buffer's runs are a few granules); scratch costs under twice this.
SCRATCH_GRANULES = 16


class VmmError(RuntimeError):
    """A virtual-memory call failed; the mappings are as they were before the transition."""


class Driver(Protocol):
    """Virtual memory management calls: CUDA's cuMem API (vmm_cuda.py) or mmap (vmm_host.py).
    Every size and address is a multiple of :attr:`granularity`."""

    @property
    def granularity(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def create(self, nbytes: int) -> int:
        """A new physical chunk; returns its handle."""
        ...

    def release(self, handle: int) -> None: ...

    def reserve(self, nbytes: int) -> int:
        """A new address range with nothing mapped; returns its start."""
        ...

    def free(self, address: int, nbytes: int) -> None: ...

    def map(self, address: int, nbytes: int, handle: int) -> None:
        """Map a whole chunk of ``nbytes`` at ``address``, readable and writable."""
        ...

    def unmap(self, address: int, nbytes: int) -> None: ...

    def synchronize(self) -> None:
        """Wait until no queued work can still touch mapped memory."""
        ...

    def tensor(self, address: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor viewing ``nbytes`` at ``address`` (it does not own the memory)."""
        ...


class Residence(enum.StrEnum):
    DRAFT = "draft"  # the chunks back the draft's range; the top blocks are withheld
    KV = "kv"  # the chunks back the KV buffer's top blocks; the draft is offloaded


def scratch_pieces(length: int, scratch: int) -> list[int]:
    """A run of ``length`` granules as scratch chunks: ``scratch`` granules long, then the
    rest in powers of two."""
    rest = length % scratch
    powers = [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]
    return [scratch] * (length // scratch) + powers


@dataclasses.dataclass(frozen=True, slots=True)
class SwapTiming:
    """One transition: driver calls made and the time they took (the caller's thread)."""

    calls: int
    seconds: float


class ElasticMemory:
    """Owns both reserved ranges, every physical chunk and every mapping (one per engine)."""

    def __init__(self, driver: Driver, plan: ElasticPlan) -> None:
        self.driver = driver
        self.plan = plan
        granule = plan.granule
        if granule % driver.granularity:
            raise ValueError(f"plan granule {granule} is not a multiple of {driver.granularity}")
        self._handles: list[int] = []
        self._sizes: dict[int, int] = {}  # handle -> bytes
        self._reserved: list[tuple[int, int]] = []
        self._mapped: dict[int, tuple[int, int]] = {}  # address -> (bytes, handle)
        self.residence = Residence.DRAFT
        try:
            self.kv_address = self._reserve(plan.kv_granules * granule)
            self.draft_address = self._reserve(plan.draft_granules * granule)
            for start, length in plan.fixed_runs():
                self._map_new(self.kv_address + start * granule, length * granule)
            longest = max((length for _, length in plan.swap_runs), default=0)
            self.scratch_granules = min(longest, SCRATCH_GRANULES)
            self._scratch = {
                size: self._create(size * granule)
                for size in sorted(
                    {p for _, n in plan.swap_runs for p in scratch_pieces(n, self.scratch_granules)}
                )
            }
            for start, length in plan.swap_runs:
                self._map_scratch(self.kv_address + start * granule, length)
            # The draft's range: one chunk per swap run, end to end, then the remainder.
            self._chunks: list[tuple[int, int, int]] = []  # (draft address, kv address, bytes)
            self._chunk_handles: list[int] = []
            for offset, (start, length) in zip(plan.draft_offsets(), plan.swap_runs, strict=True):
                address = self.draft_address + offset * granule
                handle = self._map_new(address, length * granule)
                self._chunks.append((address, self.kv_address + start * granule, length * granule))
                self._chunk_handles.append(handle)
            if plan.remainder_granules:
                self._map_new(
                    self.draft_address + plan.swap_granules * granule,
                    plan.remainder_granules * granule,
                )
        except BaseException:
            self.close()
            raise

    # -- views --------------------------------------------------------------------------

    @property
    def kv_nbytes(self) -> int:
        return self.plan.kv_granules * self.plan.granule

    @property
    def draft_nbytes(self) -> int:
        return self.plan.draft_granules * self.plan.granule

    def kv_tensor(self) -> torch.Tensor:
        return self.driver.tensor(self.kv_address, self.kv_nbytes)

    def draft_tensor(self) -> torch.Tensor:
        return self.driver.tensor(self.draft_address, self.draft_nbytes)

    def mappings(self) -> dict[int, tuple[int, int]]:
        """address -> (bytes, handle) of everything mapped now."""
        return dict(self._mapped)

    @property
    def calls_per_move(self) -> int:
        """Driver calls of one offload or reload: per run, the chunk's unmap and map and
        the scratch pieces' map or unmap."""
        return sum(
            2 + len(scratch_pieces(length, self.scratch_granules))
            for _, length in self.plan.swap_runs
        )

    @property
    def physical_bytes(self) -> int:
        """Physical memory held (every chunk, scratch included), whoever it backs."""
        return sum(self._sizes.values())

    # -- transitions --------------------------------------------------------------------

    def to_kv(self) -> SwapTiming:
        """Offload: the draft's chunks go under the KV buffer's top blocks."""
        return self._swap(Residence.DRAFT, Residence.KV)

    def to_draft(self) -> SwapTiming:
        """Reload: the chunks go back under the draft's range (contents: whatever KV left)."""
        return self._swap(Residence.KV, Residence.DRAFT)

    def _swap(self, current: Residence, target: Residence) -> SwapTiming:
        if self.residence is not current:
            raise VmmError(f"the draft's memory already backs the {self.residence.value} range")
        started = time.perf_counter()
        self.driver.synchronize()
        undo: list[Callable[[], None]] = []
        calls = 0
        try:
            for (draft, kv, nbytes), handle in zip(self._chunks, self._chunk_handles, strict=True):
                if target is Residence.KV:
                    calls += self._unmap(draft, undo)
                    calls += self._unmap_scratch(kv, nbytes, undo)
                    calls += self._map(kv, nbytes, handle, undo)
                else:
                    calls += self._unmap(kv, undo)
                    calls += self._map_scratch(kv, nbytes // self.plan.granule, undo)
                    calls += self._map(draft, nbytes, handle, undo)
        except BaseException as exc:
            for step in reversed(undo):
                step()
            raise VmmError(f"moving the draft's memory to the {target.value} range: {exc}") from exc
        self.residence = target
        return SwapTiming(calls, time.perf_counter() - started)

    # -- bookkeeping: every driver call goes through these ------------------------------

    def _reserve(self, nbytes: int) -> int:
        address = self.driver.reserve(nbytes)
        self._reserved.append((address, nbytes))
        return address

    def _create(self, nbytes: int) -> int:
        handle = self.driver.create(nbytes)
        self._handles.append(handle)
        self._sizes[handle] = nbytes
        return handle

    def _map_new(self, address: int, nbytes: int) -> int:
        handle = self._create(nbytes)
        self._map(address, nbytes, handle, None)
        return handle

    def _map(
        self, address: int, nbytes: int, handle: int, undo: list[Callable[[], None]] | None
    ) -> int:
        self.driver.map(address, nbytes, handle)
        self._mapped[address] = (nbytes, handle)
        if undo is not None:
            undo.append(lambda: self._undo_map(address))
        return 1

    def _undo_map(self, address: int) -> None:
        self._unmap(address, None)

    def _undo_unmap(self, address: int, nbytes: int, handle: int) -> None:
        self._map(address, nbytes, handle, None)

    def _unmap(self, address: int, undo: list[Callable[[], None]] | None) -> int:
        nbytes, handle = self._mapped.pop(address)
        try:
            self.driver.unmap(address, nbytes)
        except BaseException:
            self._mapped[address] = (nbytes, handle)
            raise
        if undo is not None:
            undo.append(lambda: self._undo_unmap(address, nbytes, handle))
        return 1

    def _map_scratch(
        self, address: int, granules: int, undo: list[Callable[[], None]] | None = None
    ) -> int:
        calls = 0
        for piece in scratch_pieces(granules, self.scratch_granules):
            nbytes = piece * self.plan.granule
            calls += self._map(address, nbytes, self._scratch[piece], undo)
            address += nbytes
        return calls

    def _unmap_scratch(self, address: int, nbytes: int, undo: list[Callable[[], None]]) -> int:
        calls = 0
        end = address + nbytes
        while address < end:
            size = self._mapped[address][0]
            calls += self._unmap(address, undo)
            address += size
        return calls

    def close(self) -> None:
        """Unmap everything, release every chunk and free both ranges (idempotent). Tensors
        viewing the ranges must not be used afterwards."""
        if self._mapped or self._handles or self._reserved:
            self.driver.synchronize()
        for address, (nbytes, _) in list(self._mapped.items()):
            self.driver.unmap(address, nbytes)
        self._mapped.clear()
        for handle in self._handles:
            self.driver.release(handle)
        self._handles.clear()
        self._sizes.clear()
        for address, nbytes in self._reserved:
            self.driver.free(address, nbytes)
        self._reserved.clear()
