"""The committed generated code in omnistage/v1 matches what protogen makes from protos/."""

from __future__ import annotations

from pathlib import Path

from omnistage.cli import protogen


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    protogen.generate(tmp_path)
    fresh = _snapshot(tmp_path / protogen.PACKAGE)
    committed = _snapshot(protogen.REPO_ROOT / protogen.PACKAGE)
    assert fresh, "protogen produced nothing"
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"omnistage/v1 is stale, run `python -m omnistage.protogen`: {stale}"


def test_generation_is_reproducible(tmp_path: Path) -> None:
    protogen.generate(tmp_path / "a")
    protogen.generate(tmp_path / "b")
    assert _snapshot(tmp_path / "a" / protogen.PACKAGE) == _snapshot(tmp_path / "b" / protogen.PACKAGE)


def test_generated_modules_import() -> None:
    from omnistage.v1 import gateway_pb2, gateway_pb2_grpc, stage_pb2, stage_pb2_grpc, tensor_pb2

    assert tensor_pb2.DType.Value("BF16") == tensor_pb2.BF16
    assert stage_pb2.Start().mode == stage_pb2.ASYNC_CHUNK
    assert hasattr(stage_pb2_grpc, "StageServicer") and hasattr(gateway_pb2_grpc, "GatewayStub")
    req = gateway_pb2.GenerateRequest(prompt="hi", want_audio=True)
    req.sampling["thinker"].temperature = 0.7
    assert gateway_pb2.GenerateRequest.FromString(req.SerializeToString()) == req
