"""The host VMM driver (memory_agent/vmm_host.py) with one failing call: the real driver,
whose n-th map call from when it is armed fails as CUDA's cuMemMap does when memory runs
out (ENOMEM). The memory agent's tests and `make fuzz`'s failing-driver class use it."""

from __future__ import annotations

import errno

from memory_agent.vmm_host import HostDriver


class FailingDriver(HostDriver):
    """:class:`HostDriver`, failing its ``fail_at``-th map call once it is armed."""

    def __init__(self, granularity: int) -> None:
        super().__init__(granularity)
        self.fail_at: int | None = None
        self.failed = 0  # calls failed so far

    def arm(self, nth_map: int) -> None:
        """Fail the ``nth_map``-th map call from now (1: the next one), once."""
        self.fail_at = nth_map

    def map(self, address: int, nbytes: int, handle: int) -> None:
        if self.fail_at is not None:
            self.fail_at -= 1
            if self.fail_at == 0:
                self.fail_at = None
                self.failed += 1
                raise OSError(errno.ENOMEM, "out of memory (injected)")
        super().map(address, nbytes, handle)
