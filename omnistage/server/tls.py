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

import ipaddress
import logging
import re
import ssl
from pathlib import Path
from typing import Any

import grpc

from omnistage.config import TlsConfig

log = logging.getLogger(__name__)


class TlsError(ValueError):
    """A TLS file of the config cannot be read; the message names it."""


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TlsError(f"tls.{what}: cannot read {path}: {e.strerror}") from None


def check_files(tls: TlsConfig, host: str, *, dialled_here: bool = True) -> None:
    """TlsError naming what is wrong with the config's TLS files, found by a TLS handshake in
    memory between a server and a client set up as the stack's are: a key that is not the
    certificate's, a file that is no PEM, a certificate that has expired, that `ca_file` (else
    the system's roots) did not sign, or that does not name the address dialled (`server_name`,
    else `host` unless it is a wildcard). Otherwise these surface only as failed connections, at
    the start-up timeout. `dialled_here` False (a gateway alone: who dials it, by which name and
    with which roots, is its clients' business): the certificate is verified only against
    `ca_file` and `server_name`, where the config names them."""
    if not (tls.gateway or tls.stages):
        given = [f for f in ("cert_file", "key_file", "ca_file", "server_name") if getattr(tls, f)]
        if given:  # files set up for TLS that nothing uses: the stack starts in plaintext
            log.warning("tls: %s set but tls.gateway and tls.stages are both false: every port is plaintext",
                        ", ".join(given))  # fmt: skip
        return
    for what in ("cert_file", "key_file", "ca_file"):
        _read(getattr(tls, what), what)  # unreadable: said first
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        server.load_cert_chain(tls.cert_file or "", tls.key_file)
    except (ssl.SSLError, ValueError) as e:
        raise TlsError(f"tls.cert_file {tls.cert_file} and tls.key_file {tls.key_file}: not a PEM certificate and "
                       f"its private key ({_why(e)})") from None  # fmt: skip
    if not (dialled_here or tls.ca_file):
        return
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    name = tls.server_name or (host if dialled_here and not ipaddress.ip_address(host).is_unspecified else None)
    client.check_hostname = name is not None
    try:
        if tls.ca_file:
            client.load_verify_locations(tls.ca_file)
        else:
            client.load_default_certs()  # (the gateway's clients fall back to the system's roots)
        if tls.stages:  # mutual: the stages ask every caller for the same certificate
            server.verify_mode = ssl.CERT_REQUIRED
            server.load_verify_locations(tls.ca_file)
            client.load_cert_chain(tls.cert_file or "", tls.key_file)
    except ssl.SSLError as e:
        raise TlsError(f"tls.ca_file {tls.ca_file}: not a PEM certificate ({_why(e)})") from None
    why = _handshake(server, client, name)
    if why:
        signer = f"tls.ca_file {tls.ca_file}" if tls.ca_file else "the system's roots (no tls.ca_file)"
        raise TlsError(f"tls.cert_file {tls.cert_file}: a client verifying it with {signer}"
                       + (f" for {name}" if name else "") + f" refuses it: {why}")


def _why(e: Exception) -> str:
    """OpenSSL's reason, without the C source line ssl puts in its message."""
    reason = getattr(e, "reason", None)
    if reason:
        return str(reason).replace("_", " ").lower()
    return re.sub(r"^\[\w+\]\s*|\s*\(_ssl\.c:\d+\)$", "", str(e.args[-1] if e.args else e))


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str | None) -> str:
    """Run a TLS handshake in memory; why it failed ("": it did not)."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.wrap_bio(s_in, s_out, server_side=True)
    c = client.wrap_bio(c_in, c_out, server_hostname=name)
    done = {"s": False, "c": False}
    for _ in range(20):  # a handshake is a few round trips
        for side, end, out, peer_in in (("c", c, c_out, s_in), ("s", s, s_out, c_in)):
            if not done[side]:
                try:
                    end.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLCertVerificationError as e:
                    return e.verify_message or str(e)
                except ssl.SSLError as e:
                    return _why(e)
            peer_in.write(out.read())
        if all(done.values()):
            return ""
    return "the handshake did not finish"


def server_credentials(tls: TlsConfig, *, stage: bool, host: str) -> grpc.ServerCredentials | None:
    """What a stage (`stage=True`) or the gateway listens with on `host`; None: plaintext.
    TlsError when the files would not do (`check_files`)."""
    if not (tls.stages if stage else tls.gateway):
        return None
    check_files(tls, host, dialled_here=stage)  # (the stages' callers are the stack's own processes)
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
    return _verify_name(tls.server_name)


def _verify_name(server_name: str | None) -> list[tuple[str, Any]]:
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def gateway_channel(target: str, tls_ca: bytes | None = None, server_name: str | None = None, *,
                    tls: bool = False) -> grpc.aio.Channel:  # fmt: skip
    """A client's channel to a gateway: plaintext unless `tls` or `tls_ca`; TLS verified with the PEM
    roots `tls_ca`, else gRPC's default roots (those grpcio ships, or the file named by
    $GRPC_DEFAULT_SSL_ROOTS_FILE_PATH), for `server_name` (default: the target's host)."""
    if tls_ca is None and not tls:
        return grpc.aio.insecure_channel(target)
    return aio_channel(target, grpc.ssl_channel_credentials(root_certificates=tls_ca), _verify_name(server_name))


def aio_channel(target: str, credentials: grpc.ChannelCredentials | None,
                options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:  # fmt: skip
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)
