"""TLS and mutual TLS on the sidecar's TCP listener, and the client side of it.

The Unix socket needs no TLS (file permissions guard it, nightjar_common/uds.py); a TCP port
that leaves the host does. The server's certificate and key, and the CA that client
certificates must chain to (mutual TLS), are PEM files. They are re-read when they change
(checked at each new TLS handshake), so a rotated certificate (cert-manager, a renewed
Secret) is served without a restart; a rotated set that cannot be read keeps the last good
one and says so in the log.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)


class TlsError(ValueError):
    """A certificate, key or CA file cannot be read or does not fit together."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServerTls:
    """PEM files of the server: its certificate chain and key, and the CA its clients'
    certificates must chain to ("" = clients are not asked for one)."""

    cert: str
    key: str
    client_ca: str = ""

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca)

    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert, self.key, self.client_ca) if p)


@dataclasses.dataclass(frozen=True, slots=True)
class ClientTls:
    """PEM files of a client: the CA that signed the server's certificate ("" = the
    system's roots), and for mutual TLS its own certificate and key; ``server_name``
    overrides the name checked against the server's certificate ("" = the target's host)."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TlsError("a client certificate needs its key and a key its certificate")


def read_pem(path: str, what: str) -> bytes:
    """The PEM file's bytes; TlsError saying what is wrong when it cannot be used."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read the {what} {path}: {exc}") from exc
    if b"-----BEGIN " not in data:
        raise TlsError(f"the {what} {path} is not a PEM file")
    return data


def _certificate_configuration(files: ServerTls) -> Any:
    cert = read_pem(files.cert, "TLS certificate")
    key = read_pem(files.key, "TLS key")
    ca = read_pem(files.client_ca, "client CA") if files.client_ca else None
    # gRPC takes a key that does not match the certificate and fails each handshake later;
    # the stdlib's loader checks the pair now, so a half-rotated Secret keeps the last good.
    try:
        ssl.create_default_context().load_cert_chain(files.cert, files.key)
    except (ssl.SSLError, OSError) as exc:
        raise TlsError(
            f"the TLS key {files.key} does not fit the certificate {files.cert}: {exc}"
        ) from exc
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


class _Reloader:
    """gRPC's certificate fetcher: a new configuration when a file changed, else None."""

    def __init__(self, files: ServerTls) -> None:
        self._files = files
        self._lock = threading.Lock()
        self._seen = self._identity()

    def _identity(self) -> tuple[tuple[int, int], ...]:
        seen = []
        for path in self._files.paths():
            try:
                st = os.stat(path)
            except OSError:
                seen.append((-1, -1))
                continue
            seen.append((st.st_ino, st.st_mtime_ns))
        return tuple(seen)

    def __call__(self) -> Any:
        with self._lock:
            seen = self._identity()
            if seen == self._seen:
                return None
            try:
                configuration = _certificate_configuration(self._files)
            except TlsError as exc:
                log.error("TLS files changed but cannot be used (%s): keeping the last good", exc)
                return None  # retried at the next handshake: _seen is not updated
            self._seen = seen
            log.info("TLS certificate files changed: serving the new ones")
            return configuration


def server_credentials(files: ServerTls) -> grpc.ServerCredentials:
    """Credentials for ``add_secure_port``; TlsError when a file cannot be used now."""
    initial = _certificate_configuration(files)
    return grpc.dynamic_ssl_server_credentials(
        initial, _Reloader(files), require_client_authentication=files.mutual
    )


def channel_credentials(files: ClientTls) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(files.ca, "CA certificate") if files.ca else None,
        private_key=read_pem(files.key, "client key") if files.key else None,
        certificate_chain=read_pem(files.cert, "client certificate") if files.cert else None,
    )


def open_channel(
    target: str, files: ClientTls | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to ``target``: TLS when ``files`` is given, else plaintext."""
    if files is None:
        return grpc.insecure_channel(target, options=list(options))
    opts = list(options)
    if files.server_name:
        opts.append(("grpc.ssl_target_name_override", files.server_name))
    return grpc.secure_channel(target, channel_credentials(files), options=opts)
