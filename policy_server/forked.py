"""Whole-state work in a forked child process, off the GIL the decisions need.

A snapshot, a whole-state GetState and a restore's checks are Python work over the whole
learned state. On a thread of the sidecar they share one GIL with the event loop that
answers every engine, so each engine's decision waits for their turns (tens of ms at a
state of tens of MB, the deadline 2 ms). A forked child instead gets a copy-on-write
view of the process at the instant of the fork (Redis's BGSAVE): taken holding the locks
the caller names, that view is one consistent instant of the state; the child does the
work on a CPU of its own and hands back a small JSON value and a payload of bytes, and
the parent's thread waits outside the GIL.

Fork safety: the child is the forking thread alone; a lock another thread held at the
fork stays held in the child for good, so the work must take no lock (nothing of gRPC,
logging, metrics or the service's locks) and only read and compute on plain data. The
child leaves by os._exit: no atexit handler, no gRPC shutdown, no flush of buffers it
shares with the parent. Children run one at a time, each for at most its timeout
(killed past it).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import select
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

from nightjar_common import errors
from policy_server import bulk_bytes

T = TypeVar("T")
# What the child writes its payload with.
Sink = Callable[[bytes], None]

# The longest a child may run before it is killed (a snapshot of the largest state takes
# seconds on a slow host).
CHILD_TIMEOUT_S = 300.0
# The child's CPU priority below the sidecar's: on a host with few CPUs the decisions'
# process gets the CPU first; the child only delays its own admin call.
CHILD_NICE = 10

# CPython 3.12+ warns of fork in a process with threads (a lock held by another thread
# stays held in the child): the child takes none by design (module docstring).
warnings.filterwarnings(
    "ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning
)


def _parent_death_signal() -> Callable[[], None]:
    """What makes the child killed when the sidecar dies (Linux's prctl PR_SET_PDEATHSIG),
    resolved here in the parent: loading a library in the child could wait for a lock
    another thread held at the fork. Elsewhere nothing: the child ends with its work."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None
    return lambda: prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


# A child outlives a killed sidecar otherwise, holding its listening socket meanwhile.
_DIE_WITH_PARENT = _parent_death_signal()


def can_fork() -> bool:
    """Whether this platform forks (POSIX); elsewhere the work runs in process."""
    return hasattr(os, "fork")


class ChildError(Exception):
    """The work raised in the child: the names of its exception's classes (its MRO) and
    its message."""

    def __init__(self, kinds: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.kinds = kinds
        self.message = message

    def is_a(self, *classes: type[BaseException]) -> bool:
        return any(cls.__name__ in self.kinds for cls in classes)

    def rebuilt(self) -> Exception:
        """The error to raise in the parent: the NightjarError the child raised (the same
        class, the same message, so the same status code), else this one."""
        for name in self.kinds:
            cls = getattr(errors, name, None)
            if isinstance(cls, type) and issubclass(cls, errors.NightjarError):
                return cls(self.message)
        return self


class ChildLost(errors.AbortedError):
    """The child ran past its timeout (and was killed) or ended without answering (killed
    by the system, out of memory): nothing it was to do was done."""


@dataclasses.dataclass(frozen=True, slots=True)
class ChildResult:
    value: Any  # the work's JSON value
    payload: bytes  # what the work wrote to its sink


class Children:
    """Runs work in forked children, one at a time (each holds a copy of what it reads
    while it runs: at most one such copy exists)."""

    def __init__(self, timeout_s: float = CHILD_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._one = threading.Lock()

    def run(
        self,
        freeze: contextlib.AbstractContextManager[T],
        work: Callable[[T, Sink], Any],
    ) -> tuple[T, ChildResult]:
        """Enter ``freeze`` (the locks that make the view consistent, and what was read
        under them), fork, leave it; the child runs ``work(frozen, sink)``. The frozen
        value and the child's result; ChildError when the work raised, ChildLost when the
        child timed out or died."""
        with self._one:
            status_r, status_w = os.pipe()
            payload = bulk_bytes.memory_file("nightjar-child")
            try:
                parent = os.getpid()
                with freeze as frozen:
                    pid = os.fork()
                    if pid == 0:
                        _child(lambda sink: work(frozen, sink), status_w, payload, parent)
                os.close(status_w)
                status_w = -1
                status = self._status(pid, status_r)
                if "error" in status:
                    kinds, message = status["error"]
                    raise ChildError(tuple(kinds), message)
                size = os.fstat(payload).st_size
                return frozen, ChildResult(status["value"], bulk_bytes.read_all(payload, size))
            finally:
                for fd in (status_r, status_w, payload):
                    if fd >= 0:
                        os.close(fd)

    def _status(self, pid: int, status_r: int) -> dict[str, Any]:
        """The child's status line, read until it exits; the child reaped."""
        chunks = []
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([status_r], [], [], max(left, 0.0))
                if not ready:
                    os.kill(pid, signal.SIGKILL)
                    raise ChildLost(
                        f"the child process doing the work ran past {self.timeout_s:g} s "
                        "and was stopped; nothing was changed"
                    )
                chunk = os.read(status_r, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            _, code = os.waitpid(pid, 0)
        if not chunks:
            raise ChildLost(
                f"the child process doing the work ended without an answer "
                f"({_ended(code)}: out of memory?); nothing was changed"
            )
        status: dict[str, Any] = json.loads(b"".join(chunks))
        return status


def _ended(code: int) -> str:
    if os.WIFSIGNALED(code):
        return f"signal {os.WTERMSIG(code)}"
    return f"exit status {os.waitstatus_to_exitcode(code)}"


def _child(work: Callable[[Sink], Any], status_w: int, payload: int, parent: int) -> NoReturn:
    """The child's whole life: the work, its status on the pipe, os._exit."""
    code = 0
    try:
        _DIE_WITH_PARENT()
        if os.getppid() != parent:  # the sidecar died before the signal was asked for
            os._exit(1)
        # A collection would touch, and so copy, every page of the parent's heap.
        gc.disable()
        # The parent's handlers would stop the parent's server from here.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        os.nice(CHILD_NICE)
        value = work(lambda data: bulk_bytes.write_all(payload, data))
        line = json.dumps({"value": value}, allow_nan=False)
    except BaseException as exc:  # all of it goes to the parent, which raises it
        line = json.dumps({"error": [[cls.__name__ for cls in type(exc).__mro__], str(exc)]})
    try:
        bulk_bytes.write_all(status_w, line.encode())
    except BaseException:  # the pipe is gone: the parent sees no answer
        code = 1
    os._exit(code)


@contextlib.contextmanager
def nothing_held() -> Iterator[None]:
    """A freeze for work that needs no consistent view (it reads its own input)."""
    yield
