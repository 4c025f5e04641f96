"""Virtual memory management on an NVIDIA GPU: the :class:`memory_agent.vmm.Driver` over the
CUDA driver's cuMem API, through NVIDIA's ``cuda-bindings`` (cuda-python).

Why these bindings and not kvcached: kvcached (PyPI) builds elastic KV on the same API, but
as its own C++ extension compiled against one torch release and as an allocator that
replaces vLLM's KV pool; here the pool stays vLLM's and only two address ranges need
remapping, so the few driver calls are made directly (cuMemCreate, cuMemAddressReserve,
cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree), with no build step
and no torch ABI to match. ``pip install nightjar-sidecar[gpu]`` brings the bindings.

Tensors view the ranges through ``__cuda_array_interface__`` (torch does not own the
memory). The calls run in torch's primary context of the device.
"""

from __future__ import annotations

from typing import Any

import torch


class CudaError(RuntimeError):
    """A CUDA driver call failed (the message names the call and the driver's error)."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise CudaError(
            "CUDA virtual memory needs NVIDIA's cuda-bindings: pip install 'cuda-bindings>=12.8'"
        ) from exc
    return driver


class _Array:
    """The minimal ``__cuda_array_interface__`` torch needs to view device memory."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class CudaDriver:
    """cuMem calls on one device; chunks are pinned device memory of whole granules."""

    def __init__(self, device: torch.device | int | None = None) -> None:
        self._cu = _driver()
        index = device if isinstance(device, int) else getattr(device, "index", None)
        self._device = torch.device(
            "cuda", torch.cuda.current_device() if index is None else int(index)
        )
        # Make torch's primary context current on this thread before any driver call.
        torch.cuda.init()
        with torch.cuda.device(self._device):
            torch.empty(1, device=self._device)
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self._device.index
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self._device.index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self._granularity = int(
            self._call(
                "cuMemGetAllocationGranularity",
                prop,
                cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        )
        self._handles: dict[int, Any] = {}
        self._next = 1

    def _call(self, name: str, *args: Any) -> Any:
        result = getattr(self._cu, name)(*args)
        error, values = result[0], result[1:]
        if error != self._cu.CUresult.CUDA_SUCCESS:
            _, text = self._cu.cuGetErrorString(error)
            message = text.decode() if isinstance(text, bytes) else str(text)
            raise CudaError(f"{name}: {error.name}: {message}")
        return values[0] if len(values) == 1 else None

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def device(self) -> torch.device:
        return self._device

    def create(self, nbytes: int) -> int:
        handle = self._call("cuMemCreate", nbytes, self._prop, 0)
        key, self._next = self._next, self._next + 1
        self._handles[key] = handle
        return key

    def release(self, handle: int) -> None:
        self._call("cuMemRelease", self._handles.pop(handle))

    def reserve(self, nbytes: int) -> int:
        return int(self._call("cuMemAddressReserve", nbytes, self._granularity, self._ptr(0), 0))

    def _ptr(self, address: int) -> Any:
        return self._cu.CUdeviceptr(address)

    def free(self, address: int, nbytes: int) -> None:
        self._call("cuMemAddressFree", self._ptr(address), nbytes)

    def map(self, address: int, nbytes: int, handle: int) -> None:
        self._call("cuMemMap", self._ptr(address), nbytes, 0, self._handles[handle], 0)
        try:
            self._call("cuMemSetAccess", self._ptr(address), nbytes, [self._access], 1)
        except CudaError:
            self._call("cuMemUnmap", self._ptr(address), nbytes)
            raise

    def unmap(self, address: int, nbytes: int) -> None:
        self._call("cuMemUnmap", self._ptr(address), nbytes)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_Array(address, nbytes), device=self._device)
