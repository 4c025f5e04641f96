"""A real Redis server for tests (Debian's `redis-server`, installed by `make install-apt`).

    with RedisRig(tmp_path) as rig:
        link_to(rig.url)
        rig.kill9()          # Redis gone mid-run
        rig.start()          # back on the same port, empty

It starts `redis-server` on a free loopback port with no persistence (its files in the
work directory), optionally with a password, a memory limit or TLS (with ``tls``: the
server's certificate and its CA, clients must present one of that CA: mutual TLS), and
waits until it answers PING. A missing binary is an error, never a skip: the tests need
the real thing.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisRig:
    """One `redis-server` process; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        workdir: Path,
        *,
        password: str = "",
        maxmemory: str = "",
        tls: dict[str, Any] | None = None,
        binary: str = "redis-server",
    ) -> None:
        self.workdir = Path(workdir)
        self.password = password
        self.maxmemory = maxmemory
        # The conftest pki's "ca", "server" and "client": TLS only, mutual.
        self.tls = tls
        self.binary = shutil.which(binary) or ""
        if not self.binary:
            raise RuntimeError(f"{binary} not found: run `make install-apt` (Debian redis-server)")
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        extra: dict[str, Any] = {}
        if self.tls:
            extra = {
                "ssl": True,
                "ssl_ca_certs": str(self.tls["ca"].files.cert),
                "ssl_certfile": str(self.tls["client"].cert),
                "ssl_keyfile": str(self.tls["client"].key),
            }
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password or None, **extra
        )

    def start(self, timeout: float = 15.0) -> RedisRig:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ports = ["--port", str(self.port)]
        if self.tls:
            ports = ["--port", "0", "--tls-port", str(self.port)]
            ports += ["--tls-cert-file", str(self.tls["server"].cert)]
            ports += ["--tls-key-file", str(self.tls["server"].key)]
            ports += ["--tls-ca-cert-file", str(self.tls["ca"].files.cert)]
            ports += ["--tls-auth-clients", "yes"]
        args = [
            self.binary,
            *ports,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log()}")
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer: {self.log()}")

    def log(self) -> str:
        return (self.workdir / "redis.log").read_text(errors="replace")

    def kill9(self) -> None:
        """Redis gone at once (SIGKILL): connections drop, the port refuses."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """Redis hung (SIGSTOP): connections stay open, nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> RedisRig:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
