"""Virtual memory management on a Linux host: the :class:`memory_agent.vmm.Driver` over
mmap, with memfd files as the physical chunks.

The same semantics as CUDA's cuMem API: an address range is reserved (``PROT_NONE``), a
chunk (a memfd file) is mapped whole at a fixed address in it (``MAP_FIXED | MAP_SHARED``,
so one chunk can be mapped at several addresses and its bytes follow it), and unmapping
puts the reservation back rather than freeing the addresses. It runs the elastic memory
on CPU engines and in CI, where no GPU is.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import torch

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_RESERVATION = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


class HostDriver:
    """mmap-backed virtual memory; chunks are memfd files of whole granules."""

    def __init__(self, granularity: int = 2 << 20) -> None:
        if granularity <= 0 or granularity % mmap.PAGESIZE:
            raise ValueError(f"granularity must be a multiple of the page size {mmap.PAGESIZE}")
        self._granularity = granularity
        self._libc = _libc()
        self._files: dict[int, int] = {}  # handle -> bytes

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _mmap(self, address: int | None, nbytes: int, prot: int, flags: int, fd: int) -> int:
        result = self._libc.mmap(address, nbytes, prot, flags, fd, 0)
        if result is None or result == _FAILED:
            code = ctypes.get_errno()
            raise OSError(code, f"mmap: {os.strerror(code)}")
        return int(result)

    def create(self, nbytes: int) -> int:
        fd = os.memfd_create("nightjar-chunk", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
        except OSError:
            os.close(fd)
            raise
        self._files[fd] = nbytes
        return fd

    def release(self, handle: int) -> None:
        self._files.pop(handle)
        os.close(handle)

    def reserve(self, nbytes: int) -> int:
        return self._mmap(None, nbytes, _PROT_NONE, _RESERVATION, -1)

    def free(self, address: int, nbytes: int) -> None:
        if self._libc.munmap(address, nbytes) != 0:
            raise OSError(ctypes.get_errno(), "munmap failed")

    def map(self, address: int, nbytes: int, handle: int) -> None:
        if self._files.get(handle) != nbytes:  # as CUDA: a chunk maps whole
            raise OSError(errno.EINVAL, f"chunk {handle} is not {nbytes} bytes: it maps whole")
        self._mmap(address, nbytes, _PROT_RW, mmap.MAP_SHARED | _MAP_FIXED, handle)

    def unmap(self, address: int, nbytes: int) -> None:
        self._mmap(address, nbytes, _PROT_NONE, _RESERVATION | _MAP_FIXED, -1)

    def synchronize(self) -> None:
        """Host code runs in order: nothing is in flight."""

    def tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
