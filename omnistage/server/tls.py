"""TLS for omnistage's gRPC hops, from the deploy config's `tls` block (see config.TlsConfig):
the credentials each server listens with and each caller dials with, and channels made with
them. One place, so every hop (gateway -> thinker -> talker -> code2wav, health checks, the
client) agrees.

- `tls.stages`: every stage listens with mutual TLS (it accepts only callers presenting a
  certificate signed by `ca_file`) and every caller of a stage presents the certificate.
- `tls.gateway`: the gateway's gRPC and HTTP ports use TLS; its clients verify it with
  `ca_file` (or their system roots) and authenticate with the API key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from omnistage.config import TlsConfig


class TlsError(ValueError):
    """A TLS file of the config cannot be read; the message names it."""


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TlsError(f"tls.{what}: cannot read {path}: {e.strerror}") from None


def server_credentials(tls: TlsConfig, *, stage: bool) -> grpc.ServerCredentials | None:
    """What a stage (`stage=True`) or the gateway listens with; None: plaintext."""
    if not (tls.stages if stage else tls.gateway):
        return None
    key, cert = _read(tls.key_file, "key_file"), _read(tls.cert_file, "cert_file")
    assert key is not None and cert is not None  # the config checks they are set
    if stage:
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=_read(tls.ca_file, "ca_file"),
                                           require_client_auth=True)  # fmt: skip
    return grpc.ssl_server_credentials([(key, cert)])


def stage_channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials | None:
    """What a caller of a stage dials with (its certificate for mutual TLS); None: plaintext."""
    if not tls.stages:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file, "ca_file"),
                                        private_key=_read(tls.key_file, "key_file"),
                                        certificate_chain=_read(tls.cert_file, "cert_file"))  # fmt: skip


def gateway_channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials | None:
    """What a client of the gateway dials with; None: plaintext."""
    if not tls.gateway:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file, "ca_file"))


def name_override(tls: TlsConfig) -> list[tuple[str, Any]]:
    """Channel options that verify `server_name` in the servers' certificates."""
    return [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []


def aio_channel(target: str, credentials: grpc.ChannelCredentials | None,
                options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:  # fmt: skip
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)
