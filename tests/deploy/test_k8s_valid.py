"""Kubernetes manifests validate against the OpenAPI-derived JSON schemas that
kubernetes-validate ships (offline), in strict mode (no unknown fields), for a pinned version."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from omnistage.cli.deploy_render import render
from omnistage.config import DeployConfig

from .conftest import DEPLOY, yaml_docs

K8S_VERSION = "1.33.0"  # kubernetes-validate 1.37.0 ships v1.28 .. v1.37 schemas


def _validate(doc: dict[str, Any]) -> None:
    # SchemaNotFoundError (an unknown kind/apiVersion) propagates: nothing is skipped.
    used = kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert used == "1.33"


def _manifests(files: dict[str, str]) -> list[dict[str, Any]]:
    return [d for rel, text in files.items() if not rel.endswith("kustomization.yaml") for d in yaml_docs(text)]


def test_committed_manifests_validate() -> None:
    files = {p.name: p.read_text() for p in sorted((DEPLOY / "k8s").glob("*.yaml"))}
    docs = _manifests(files)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 4 and kinds.count("Service") == 4
    assert kinds.count("HorizontalPodAutoscaler") == 3 and kinds.count("ConfigMap") == 1
    for doc in docs:
        _validate(doc)


def test_gpu_manifests_validate(gpu_cfg: DeployConfig) -> None:
    for doc in _manifests(render(gpu_cfg, "k8s")):
        _validate(doc)


def test_strict_mode_catches_unknown_fields() -> None:
    bad = _manifests(render(DeployConfig(), "k8s"))[0]
    bad["spec"]["replicaz"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (built-in kustomize) not installed")
def test_kustomize_builds_and_overlay_sets_image_namespace_model(tmp_path: Path, gpu_cfg: DeployConfig) -> None:
    """`kubectl kustomize` (offline) builds the base and a README-style overlay."""
    base = tmp_path / "base"
    for rel, text in render(gpu_cfg, "k8s").items():
        (base / Path(rel).name).parent.mkdir(parents=True, exist_ok=True)
        (base / Path(rel).name).write_text(text)
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        "namespace: speech\n"
        "resources: [../base]\n"
        "images: [{name: omnistage, newName: registry.example.com/omnistage, newTag: v1}]\n"
        "patches:\n"
        "- target: {kind: Deployment}\n"
        "  patch: |\n"
        "    - op: replace\n"
        "      path: /spec/template/spec/volumes/3/persistentVolumeClaim/claimName\n"
        "      value: qwen3-omni-weights\n"
    )
    for path in (DEPLOY / "k8s", overlay):
        out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        docs = yaml_docs(out.stdout)
        for doc in docs:
            _validate(doc)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert len(deployments) == 4
    for d in deployments:
        assert d["metadata"]["namespace"] == "speech"
        pod = d["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "registry.example.com/omnistage:v1"
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims == ["qwen3-omni-weights"]
