"""A draft model whose weights live in an :class:`ElasticMemory`'s draft range.

At start the weights are copied to (pinned) host memory once, fingerprinted, and settled
into views over the draft's reserved range, packed end to end; the module's parameters
then point there for good. Offloading remaps the range's physical chunks under the KV
buffer's top blocks — no copy, the host copy is kept — and a reload maps them back and
writes the host copy into the same addresses, verified before the draft counts as
resident (:class:`DraftWeights`). CUDA graphs that read the weights stay valid.
"""

from __future__ import annotations

import time

import torch

from memory_agent.draft_weights import DraftState, DraftWeights, Transfer
from memory_agent.vmm import ElasticMemory, Residence
from memory_agent.vmm_plan import pack_tensors


def draft_range_bytes(weights: DraftWeights) -> int:
    """Bytes the draft's range needs for these weights, packed end to end."""
    tensors = weights.movable_tensors()
    return pack_tensors([t.numel() * t.element_size() for t in tensors.values()])[1]


class ElasticDraft:
    """The draft half of the agent's :class:`DraftDevice` over virtual memory."""

    def __init__(self, weights: DraftWeights, memory: ElasticMemory) -> None:
        """``weights``: a draft in memory of its own, resident or already offloaded (to free
        its device memory before the KV buffer was made); it moves into the range."""
        self.weights = weights
        self.memory = memory
        if weights.state is DraftState.RESIDENT:
            weights.offload()
        host = weights.host_tensors()
        sizes = [t.numel() * t.element_size() for t in host.values()]
        offsets, total = pack_tensors(sizes)
        if total > memory.draft_nbytes:
            weights.restore()
            raise ValueError(f"the draft needs {total} bytes, its range has {memory.draft_nbytes}")
        raw = memory.draft_tensor()
        home = {
            name: raw[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            for (name, tensor), offset, size in zip(host.items(), offsets, sizes, strict=True)
        }
        weights.settle(home)
        if memory.driver.device.type == "cuda":
            torch.cuda.empty_cache()  # the draft's own memory goes back to the device

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    def offload(self) -> Transfer:
        """The draft's chunks go to the KV buffer (nothing is copied)."""
        started = time.perf_counter()
        self.memory.to_kv()  # undoes itself when a driver call fails (VmmError)
        try:
            moved = self.weights.offload()
        except BaseException:
            self.memory.to_draft()
            raise
        return Transfer(moved.tensors, moved.bytes, time.perf_counter() - started)

    def start_reload(self) -> Transfer:
        """Map the chunks back under the draft's range and start the copy into it (on a
        side stream on CUDA). After a failed verification the chunks are already back."""
        started = time.perf_counter()
        if self.memory.residence is Residence.KV:
            self.memory.to_draft()
        moved = self.weights.start_reload()
        return Transfer(moved.tensors, moved.bytes, time.perf_counter() - started)

    def finish_reload(self) -> Transfer:
        return self.weights.finish_reload()

    def abandon_reload(self) -> None:
        """After a failed reload: the draft offloaded, its chunks back under the KV
        buffer's top blocks (VmmError when a driver call fails: they stay where they are)."""
        self.weights.abandon_reload()
        if self.memory.residence is Residence.DRAFT and not self.resident:
            self.memory.to_kv()

    @property
    def resident(self) -> bool:
        return self.weights.state is DraftState.RESIDENT
