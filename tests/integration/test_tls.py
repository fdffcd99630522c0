"""TLS and authentication through the real stack: the gateway on TLS with an API key, every
stage on mutual TLS. Certificates are made here with the system's openssl."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from gateway.client import generate
from omnistage.cli.serve import Stack, start_stack
from omnistage.server.health_check import health_status
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from tests.integration.conftest import run, stack_config

KEY = "test-key-123"


def _trust(certs: dict[str, Path]) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certs["cert"]))


def _self_signed(d: Path, name: str, san: str) -> tuple[Path, Path]:
    """A self-signed CA certificate for `san` and its key (openssl), as (cert, key)."""
    cert, key = d / f"{name}.pem", d / f"{name}-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2",
                    "-subj", "/CN=omnistage-test", "-addext", f"subjectAltName={san}",
                    "-addext", "basicConstraints=critical,CA:TRUE",
                    "-addext", "keyUsage=critical,digitalSignature,keyCertSign",
                    "-addext", "extendedKeyUsage=serverAuth,clientAuth"], check=True, capture_output=True)  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is missing (it makes this test's certificates)")
    d = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(d, "cert", "IP:127.0.0.1,DNS:localhost")
    other, other_key = _self_signed(d, "other", "DNS:example.org")
    return {"cert": cert, "key": key, "other": other, "other_key": other_key}


def test_tls_files_that_would_not_do_are_refused_at_start_by_name(
    certs: dict[str, Path], tmp_path: Path, tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A key that is not the certificate's, a file that is no PEM, a certificate `ca_file` did
    not sign or that does not name the address: one line naming the file and why, before any
    process starts, exit 2 (they were a port "taken by another process", or 658 lines of
    handshake failures and "not healthy after 180 s")."""
    from omnistage.cli.main import known_errors
    from omnistage.config import TlsConfig
    from omnistage.server.tls import TlsError, check_files

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    good = {"gateway": True, "stages": True, "cert_file": str(certs["cert"]), "key_file": str(certs["key"]),
            "ca_file": str(certs["cert"])}  # fmt: skip
    check_files(TlsConfig(**good), "127.0.0.1")
    for change, needle in (({"key_file": str(certs["other_key"])}, "key values mismatch"),
                           ({"cert_file": str(garbage)}, "not a PEM certificate and its private key"),
                           ({"ca_file": str(garbage)}, "tls.ca_file .*: not a PEM certificate"),
                           ({"ca_file": str(certs["other"])}, "refuses it: self-signed certificate"),
                           ({"server_name": "example.com"}, "Hostname mismatch"),
                           ({"stages": False, "ca_file": None}, "with the system's roots"),
                           ({"key_file": str(tmp_path / "missing.pem")}, "tls.key_file: cannot read")):  # fmt: skip
        with pytest.raises(TlsError, match=needle):
            check_files(TlsConfig(**(good | change)), "127.0.0.1")
    moved = good | {"cert_file": str(certs["other"]), "key_file": str(certs["other_key"]),
                    "ca_file": str(certs["other"])}  # fmt: skip
    with pytest.raises(TlsError, match=r"IP address mismatch, certificate is not valid for '127\.0\.0\.1'") as err:
        start_stack(stack_config(tls=moved), model=str(tiny_dir), log_dir=tmp_path / "logs")
    import typer

    with pytest.raises(typer.Exit) as ended, known_errors():
        raise err.value
    assert ended.value.exit_code == 2
    check_files(TlsConfig(**moved), "0.0.0.0")  # (listening everywhere: no one address to check)
    # a gateway alone: its clients' roots and names are theirs; the config's ca_file and server_name are checked
    alone = good | {"stages": False, "ca_file": None}
    check_files(TlsConfig(**alone), "127.0.0.1", dialled_here=False)
    check_files(TlsConfig(**moved), "127.0.0.1", dialled_here=False)
    with pytest.raises(TlsError, match="self-signed certificate"):
        check_files(TlsConfig(**(good | {"stages": False, "ca_file": str(certs["other"])})), "127.0.0.1",
                    dialled_here=False)  # fmt: skip
    with pytest.raises(TlsError, match="key values mismatch"):
        check_files(TlsConfig(**(alone | {"key_file": str(certs["other_key"])})), "127.0.0.1", dialled_here=False)
    # files given with TLS off: said (the stack started in plaintext without a word)
    with caplog.at_level("WARNING", logger="omnistage.server.tls"):
        check_files(TlsConfig(**(good | {"gateway": False, "stages": False})), "127.0.0.1")
    assert "tls: cert_file, key_file, ca_file set but tls.gateway and tls.stages are both false" in caplog.text


@pytest.fixture(scope="module")
def tls_stack(tiny_dir: Path, certs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tls = {"gateway": True, "stages": True, "cert_file": str(certs["cert"]), "key_file": str(certs["key"]),
           "ca_file": str(certs["cert"])}  # fmt: skip
    cfg = stack_config(talker={"replicas": 1}, tls=tls)
    with start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path_factory.mktemp("tls-logs"), api_key=KEY) as s:
        yield s


def test_a_request_with_tls_and_the_key_is_served(tls_stack: Stack, certs: dict[str, Path]) -> None:
    ca = certs["cert"].read_bytes()
    reply = run(generate(tls_stack.gateway_address, "hi", thinker_max_tokens=3, talker_max_tokens=4, timeout=60,
                         api_key=KEY, tls_ca=ca))  # fmt: skip
    assert reply.token_ids and reply.pcm.size > 0
    r = httpx.post(f"https://{tls_stack.http_address}/v1/chat/completions", verify=_trust(certs),
                   headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    # a certificate for another name than the address dialled (tls.server_name): the client names it
    named = run(generate(tls_stack.gateway_address, "hi", thinker_max_tokens=3, want_audio=False, timeout=60,
                         api_key=KEY, tls_ca=ca, tls_server_name="localhost"))  # fmt: skip
    assert named.token_ids == run(generate(tls_stack.gateway_address, "hi", thinker_max_tokens=3, want_audio=False,
                                           timeout=60, api_key=KEY, tls_ca=ca)).token_ids  # fmt: skip
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a name the certificate does not have
        run(generate(tls_stack.gateway_address, "hi", thinker_max_tokens=3, want_audio=False, timeout=30,
                     api_key=KEY, tls_ca=ca, tls_server_name="example.com"))  # fmt: skip
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_without_the_key_the_call_is_unauthenticated(tls_stack: Stack, certs: dict[str, Path]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(generate(tls_stack.gateway_address, "hi", thinker_max_tokens=3, timeout=30, request_id="no-key-1",
                     tls_ca=certs["cert"].read_bytes()))  # fmt: skip
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ("x-request-id", "no-key-1") in tuple(err.value.trailing_metadata() or ())  # named, as HTTP's 401 is
    r = httpx.post(f"https://{tls_stack.http_address}/v1/chat/completions", verify=_trust(certs), timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 401
    # each refusal has its access line, saying why (an operator sees which clients lack the key)
    log = tls_stack.log_dir / "gateway-0.log"
    deadline = time.monotonic() + 10
    wanted = ("request_id=no-key-1 stage_request_id=- api=grpc outcome=UNAUTHENTICATED",
              "api=http outcome=UNAUTHENTICATED")
    while time.monotonic() < deadline and not all(w in log.read_text() for w in wanted):
        time.sleep(0.2)
    lines = [line for line in log.read_text().splitlines() if "omnistage.access" in line]
    for w in wanted:
        assert any(w in line and "API key" in line for line in lines), (w, lines[-3:])


def test_plaintext_to_a_tls_port_fails(tls_stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(generate(tls_stack.gateway_address, "hi", thinker_max_tokens=3, timeout=10, api_key=KEY))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    for name in ("thinker", "talker", "code2wav"):
        assert health_status(tls_stack.addresses(name)[0], 3.0) != "SERVING", name


def test_a_stage_refuses_callers_without_a_client_certificate(tls_stack: Stack, certs: dict[str, Path]) -> None:
    """TLS that verifies the stage but presents no certificate: the handshake fails, and no
    call reaches the stage (a direct call cannot bypass the gateway)."""
    server_only = grpc.ssl_channel_credentials(root_certificates=certs["cert"].read_bytes())

    async def call() -> Any:
        async with grpc.aio.secure_channel(tls_stack.addresses("thinker")[0], server_only) as ch:
            return await stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=5)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(call())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    mutual = grpc.ssl_channel_credentials(root_certificates=certs["cert"].read_bytes(),
                                          private_key=certs["key"].read_bytes(),
                                          certificate_chain=certs["cert"].read_bytes())  # fmt: skip
    assert health_status(tls_stack.addresses("thinker")[0], 5.0, credentials=mutual) == "SERVING"


def test_the_bench_reaches_a_gateway_with_tls_and_a_key(tls_stack: Stack, certs: dict[str, Path]) -> None:
    """`omnistage bench --target ... --api-key --tls-ca` (its drivers dialled plaintext and sent
    no key: every request failed)."""
    from benchmarks.front_doors import main
    from benchmarks.harness import BenchOptions, failed_levels

    opts = BenchOptions(target=tls_stack.gateway_address, http=True, http_target=tls_stack.http_address,
                        api_key=KEY, tls_ca=certs["cert"], server_name="localhost", concurrency=[1], num_requests=1,
                        thinker_max_tokens=3, talker_max_tokens=4, warmup=0, progress=False, quiet=True)  # fmt: skip
    result = main(opts)
    assert failed_levels(result) == [] and result["failed"] == {"grpc c=1": 0, "http c=1": 0}, result["failed"]
    # the HTTP driver counts the server's text tokens, not its deltas (held-back text joins them)
    tokens = {lv["name"]: [r["text_tokens"] for r in lv["requests"]] for lv in result["configurations"]}
    assert tokens["http c=1"] == tokens["grpc c=1"] == [3], tokens
    # its result never holds the key; a --target's own config is not known to it
    assert KEY not in json.dumps(result) and result["stack_config"] is None


def test_tls_with_the_default_roots_reaches_the_gateway(tls_stack: Stack, certs: dict[str, Path],
                                                        tmp_path: Path) -> None:  # fmt: skip
    """`omnistage client --tls` and `omnistage bench --tls`: a gateway whose certificate the
    clients' default roots trust (a public CA's; here the test CA, named by the variables that
    point those roots elsewhere) is reached with no CA file. Without --tls-ca they dialled
    plaintext, so no such gateway could be reached."""
    import os
    import sys

    trusted = {**os.environ, "OMNISTAGE_API_KEY": KEY, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(certs["cert"]),
               "SSL_CERT_FILE": str(certs["cert"])}  # fmt: skip
    client = [sys.executable, "-m", "omnistage.cli", "client", "hi", "--target", tls_stack.gateway_address,
              "--no-audio", "--max-tokens", "3", "--json", "--tls"]  # fmt: skip
    done = subprocess.run(client, env=trusted, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 3
    # the same without those roots: the test CA is no public one, so the handshake is refused
    untrusted = {k: v for k, v in trusted.items() if k not in ("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", "SSL_CERT_FILE")}
    refused = subprocess.run(client, env=untrusted, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr, refused.stderr
    bench = [sys.executable, "-m", "omnistage.cli", "bench", "--target", tls_stack.gateway_address, "--http",
             "--http-target", tls_stack.http_address, "--tls", "--server-name", "localhost", "--concurrency", "1",
             "--num-requests", "1", "--thinker-max-tokens", "3", "--talker-max-tokens", "4", "--warmup", "0",
             "--no-progress", "--json", str(tmp_path / "bench.json")]  # fmt: skip
    done = subprocess.run(bench, env=trusted, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "bench.json").read_text())["failed"] == {"grpc c=1": 0, "http c=1": 0}
