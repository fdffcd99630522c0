"""The committed deploy files are the rendering of deploy/omnistage.yaml, and the render maps the
config the same way onto compose and Kubernetes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from omnistage.cli.deploy_render import MODEL_DIR, MODEL_PVC, container_config, render, render_to_dir
from omnistage.config import STAGES, DeployConfig, load_config, parse_config
from omnistage.server.grpc_common import LIVENESS_SERVICE

from .conftest import DEFAULT_YAML, DEPLOY, yaml_docs

RERENDER = "stale: run `omnistage deploy render --config deploy/omnistage.yaml --target {t} --out deploy` and commit"


@pytest.mark.parametrize("target", ["compose", "k8s"])
def test_committed_files_are_fresh(default_cfg: DeployConfig, target: str) -> None:
    files = render(default_cfg, target)
    for rel, text in files.items():
        path = DEPLOY / rel
        assert path.is_file(), f"{path} missing; " + RERENDER.format(t=target)
        assert path.read_bytes() == text.encode(), f"{path} " + RERENDER.format(t=target)
    if target == "k8s":  # nothing left over from an older rendering
        on_disk = {p.relative_to(DEPLOY).as_posix() for p in (DEPLOY / "k8s").rglob("*") if p.is_file()}
        assert on_disk == set(files), f"unexpected files in deploy/k8s: {sorted(on_disk - set(files))}"


def test_render_is_deterministic(gpu_cfg: DeployConfig) -> None:
    for target in ("compose", "k8s"):
        assert render(gpu_cfg, target) == render(gpu_cfg.model_copy(deep=True), target)


def test_unknown_target_is_refused(default_cfg: DeployConfig) -> None:
    with pytest.raises(ValueError, match="--target"):
        render(default_cfg, "nomad")


def _k8s(cfg: DeployConfig) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for rel, text in render(cfg, "k8s").items():
        if rel.endswith("kustomization.yaml"):
            continue
        for doc in yaml_docs(text):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def _compose(cfg: DeployConfig) -> dict[str, Any]:
    return yaml.safe_load(render(cfg, "compose")["docker-compose.yaml"])["services"]


def test_two_talker_replicas_reach_both_targets(default_cfg: DeployConfig) -> None:
    data = default_cfg.model_dump()
    data["talker"]["replicas"] = 2
    cfg = parse_config(data)
    compose = _compose(cfg)
    assert compose["talker"]["deploy"]["replicas"] == 2
    assert compose["talker-cpu"]["deploy"]["replicas"] == 2
    assert compose["thinker"]["deploy"]["replicas"] == 1
    k8s = _k8s(cfg)
    assert k8s[("Deployment", "talker")]["spec"]["replicas"] == 2
    assert k8s[("HorizontalPodAutoscaler", "talker")]["spec"]["minReplicas"] == 2
    assert k8s[("Deployment", "thinker")]["spec"]["replicas"] == 1


def test_compose_and_k8s_run_the_same_processes(gpu_cfg: DeployConfig) -> None:
    compose = _compose(gpu_cfg)
    k8s = _k8s(gpu_cfg)
    for name in ("gateway", *STAGES):
        container = k8s[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        assert compose[name]["command"] == container["args"]
        port = gpu_cfg.gateway.port if name == "gateway" else gpu_cfg.stage(name).base_port
        assert f"--port {port}" in " ".join(container["args"])
        assert container["startupProbe"]["grpc"]["port"] == port
        assert container["readinessProbe"]["grpc"]["port"] == port
        assert container["livenessProbe"]["grpc"]["port"] == port
        assert {"name": "metrics", "containerPort": port + 1000, "protocol": "TCP"} in container["ports"]
        assert compose[name]["healthcheck"]["test"][-3] == f"127.0.0.1:{port}"
    # the chain: gateway -> thinker -> talker -> code2wav, by DNS name
    assert "dns:///thinker:7101" in compose["gateway"]["command"]
    assert "dns:///talker:7201" in compose["thinker"]["command"]
    assert "dns:///code2wav:7301" in compose["talker"]["command"]
    assert "--downstream" not in compose["code2wav"]["command"]


def test_text_only_renders_the_thinker_alone() -> None:
    """`audio_output: false`: the gateway and the thinker, which has no stage below it."""
    cfg = parse_config({"audio_output": False})
    compose, k8s = _compose(cfg), _k8s(cfg)
    assert set(compose) == {"gateway", "thinker", "gateway-cpu", "thinker-cpu"}  # (the cpu profile too)
    assert {name for kind, name in k8s if kind == "Deployment"} == {"gateway", "thinker"}
    assert "--downstream" not in compose["thinker"]["command"]


def test_gpu_stages_reserve_gpus(gpu_cfg: DeployConfig) -> None:
    compose = _compose(gpu_cfg)
    assert compose["thinker"]["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "capabilities": ["gpu"], "count": 1}
    ]
    assert compose["talker"]["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "capabilities": ["gpu"], "device_ids": ["1"]}
    ]
    assert "resources" not in compose["gateway"]["deploy"]
    for name in ("gateway", *STAGES):  # the cpu profile never asks for a GPU
        assert "resources" not in compose[f"{name}-cpu"]["deploy"]
    k8s = _k8s(gpu_cfg)
    for name in STAGES:
        c = k8s[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    gw = k8s[("Deployment", "gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in gw["resources"]["limits"]
    # inside a container the one visible GPU is plain `cuda`
    run = yaml.safe_load(k8s[("ConfigMap", "omnistage-config")]["data"]["omnistage.yaml"])
    assert run["talker"]["device"] == "cuda" and run["host"] == "0.0.0.0" and run["model"] == MODEL_DIR


def test_default_has_no_gpu_and_no_model_mount(default_cfg: DeployConfig) -> None:
    compose = _compose(default_cfg)
    for svc in compose.values():
        assert "resources" not in svc["deploy"]
        assert "--model" not in svc["command"]
        assert svc["environment"]["OMNISTAGE_MODEL"] == ""  # tiny checkpoint, despite the image default
    for (kind, _), doc in _k8s(default_cfg).items():
        if kind == "Deployment":
            volumes = doc["spec"]["template"]["spec"]["volumes"]
            assert all("persistentVolumeClaim" not in v for v in volumes)


def test_model_is_mounted_read_only(gpu_cfg: DeployConfig) -> None:
    compose = _compose(gpu_cfg)
    model_mount = {
        "type": "bind",
        "source": f"${{OMNISTAGE_MODEL_DIR:-{gpu_cfg.model}}}",
        "target": MODEL_DIR,
        "read_only": True,
    }
    assert model_mount in compose["thinker"]["volumes"]
    assert all(v["target"] != MODEL_DIR for v in compose["thinker-cpu"]["volumes"])
    assert compose["thinker"]["command"][-2:] == ["--model", MODEL_DIR]
    pod = _k8s(gpu_cfg)[("Deployment", "talker")]["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": MODEL_PVC, "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": MODEL_DIR, "readOnly": True} in pod["containers"][0]["volumeMounts"]


def test_drain_and_headless_services(gpu_cfg: DeployConfig) -> None:
    k8s = _k8s(gpu_cfg)
    for name in STAGES:
        pod = k8s[("Deployment", name)]["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > gpu_cfg.timeouts.drain_grace_s + 5
        assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
        assert k8s[("Service", name)]["spec"]["clusterIP"] == "None"
        hpa = k8s[("HorizontalPodAutoscaler", name)]["spec"]
        assert hpa["metrics"][0]["pods"]["metric"]["name"] == "omnistage_stage_queue_depth"
        # a pod more once the average pod holds a full batch
        assert hpa["metrics"][0]["pods"]["target"]["averageValue"] == str(gpu_cfg.stage(name).max_num_seqs)
        assert hpa["maxReplicas"] >= hpa["minReplicas"]
    assert k8s[("Service", "gateway")]["spec"]["type"] == "ClusterIP"
    assert ("HorizontalPodAutoscaler", "gateway") not in k8s


def test_cpu_profile_config_is_tiny_on_cpu(gpu_cfg: DeployConfig) -> None:
    cpu = container_config(gpu_cfg, cpu_only=True)
    assert cpu.model is None
    assert all(cpu.stage(n).device == "cpu" and cpu.stage(n).dtype == "float32" for n in STAGES)
    files = render(gpu_cfg, "compose")
    assert yaml.safe_load(files["compose/omnistage-cpu.yaml"]) == cpu.model_dump()


@pytest.mark.parametrize("example", sorted(p.name for p in (DEPLOY / "examples").glob("*.yaml")))
@pytest.mark.parametrize("target", ["compose", "k8s"])
def test_every_example_renders(example: str, target: str) -> None:
    """Each shipped deploy file renders for both targets (cuda.yaml's compose CPU profile kept the
    talker's CUDA graphs on a CPU and failed with a raw validation error)."""
    files = render(load_config(DEPLOY / "examples" / example), target)
    assert files and all(yaml_docs(text) for name, text in files.items() if name.endswith(".yaml"))


def test_render_to_dir_and_cli(tmp_path: Path) -> None:
    from omnistage.cli.main import app

    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["deploy", "render", "--config", str(DEFAULT_YAML), "--target", "k8s", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    written = render_to_dir(DEFAULT_YAML, "compose", out)
    assert (out / "docker-compose.yaml") in written
    assert (out / "k8s" / "kustomization.yaml").is_file()
    compose = yaml.safe_load((out / "docker-compose.yaml").read_text())
    # the build context still points at the repository root from wherever the files land
    context = Path(out, compose["services"]["thinker"]["build"]["context"]).resolve()
    assert (context / "deploy" / "Dockerfile").is_file()


def test_k8s_pods_are_locked_down_and_only_the_stage_above_may_call_a_stage(gpu_cfg: DeployConfig) -> None:
    k8s = _k8s(gpu_cfg)
    for name in ("gateway", *STAGES):
        pod = k8s[("Deployment", name)]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert c["securityContext"]["readOnlyRootFilesystem"] is True and c["securityContext"]["capabilities"] == {
            "drop": ["ALL"]}  # fmt: skip
        for key in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][key]), (name, key)
        # liveness is not readiness: a draining pod leaves the Service without being killed
        assert c["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE != c["readinessProbe"]["grpc"]["service"]
        # started is not ready either: a gateway whose thinker is not up yet is not restarted for it
        assert c["startupProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    callers = {"thinker": "gateway", "talker": "thinker", "code2wav": "talker"}
    for name, caller in callers.items():
        policy = k8s[("NetworkPolicy", name)]["spec"]
        assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == name
        grpc_rule = policy["ingress"][0]
        assert [f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in grpc_rule["from"]] == [caller]
        assert grpc_rule["ports"] == [{"protocol": "TCP", "port": gpu_cfg.stage(name).base_port}]
    gateway_rule = k8s[("NetworkPolicy", "gateway")]["spec"]["ingress"][0]
    assert "from" not in gateway_rule  # the front doors take clients from anywhere


def test_tls_mounts_the_secret_and_probes_tls_ports_with_omnistage_health(default_cfg: DeployConfig) -> None:
    data = default_cfg.model_dump()
    data["tls"] = {"gateway": True, "stages": True, "cert_file": "/here/c.pem", "key_file": "/here/k.pem",
                   "ca_file": "/here/ca.pem"}  # fmt: skip
    cfg = parse_config(data)
    run_cfg = container_config(cfg)
    assert (run_cfg.tls.cert_file, run_cfg.tls.key_file, run_cfg.tls.ca_file) == (
        "/etc/omnistage/tls/tls.crt", "/etc/omnistage/tls/tls.key", "/etc/omnistage/tls/ca.crt")  # fmt: skip
    k8s = _k8s(cfg)
    for name in ("gateway", *STAGES):
        pod = k8s[("Deployment", name)]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert {"name": "tls", "secret": {"secretName": "omnistage-tls"}} in pod["volumes"]
        assert {"name": "tls", "mountPath": "/etc/omnistage/tls", "readOnly": True} in c["volumeMounts"]
        for key in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = c[key]["exec"]["command"]  # Kubernetes' gRPC probes cannot speak TLS
            assert command[:3] == ["omnistage", "health", "--target"], (name, key)
        assert c["livenessProbe"]["exec"]["command"][-2:] == ["--service", LIVENESS_SERVICE]
        assert c["startupProbe"]["exec"]["command"][-2:] == ["--service", LIVENESS_SERVICE]
        assert {"name": "OMNISTAGE_CONFIG", "value": "/etc/omnistage/omnistage.yaml"} in c["env"]
    compose = _compose(cfg)
    assert any(v["target"] == "/etc/omnistage/tls" for v in compose["thinker"]["volumes"])


def test_tls_without_its_files_is_refused(default_cfg: DeployConfig) -> None:
    data = default_cfg.model_dump()
    data["tls"] = {"stages": True, "cert_file": "c.pem", "key_file": "k.pem"}
    with pytest.raises(Exception, match="ca_file"):
        parse_config(data)


def test_a_split_thinker_renders_both_roles_in_the_chain() -> None:
    """deploy/examples/pd.yaml: a Deployment, Service, HPA and NetworkPolicy per role; the gateway
    calls the prefill role, the prefill the decode role, the decode role the talker."""
    cfg = load_config(DEPLOY / "examples" / "pd.yaml")
    cfg = parse_config({**cfg.model_dump(), "thinker": {**cfg.thinker.model_dump(), "decode": {
        **cfg.thinker.decode.model_dump(), "replicas": 3}}})  # fmt: skip
    compose, k8s = _compose(cfg), _k8s(cfg)
    assert ("Deployment", "thinker") not in k8s and "thinker" not in compose
    chain = {"gateway": "thinker-prefill:7101", "thinker-prefill": "thinker-decode:7151",
             "thinker-decode": "talker:7201"}  # fmt: skip
    for name, target in chain.items():
        assert f"dns:///{target}" in compose[name]["command"]
        container = k8s[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        assert container["args"] == compose[name]["command"]
    assert k8s[("Deployment", "thinker-decode")]["spec"]["replicas"] == 3
    assert k8s[("HorizontalPodAutoscaler", "thinker-decode")]["spec"]["minReplicas"] == 3
    assert k8s[("HorizontalPodAutoscaler", "thinker-prefill")]["spec"]["minReplicas"] == 1
    callers = {"thinker-prefill": "gateway", "thinker-decode": "thinker-prefill", "talker": "thinker-decode"}
    for name, caller in callers.items():
        rule = k8s[("NetworkPolicy", name)]["spec"]["ingress"][0]
        assert [f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in rule["from"]] == [caller]
    assert compose["gateway"]["depends_on"] == {"thinker-prefill": {"condition": "service_healthy"}}


def test_replicated_gpu_pods_roll_out_in_place_and_the_rest_surge(gpu_cfg: DeployConfig,
                                                                  default_cfg: DeployConfig) -> None:  # fmt: skip
    """A surge pod would need a spare GPU (a right-sized pool has none: the rollout stalls), so
    a GPU stage with 2+ replicas is replaced in place; a lone GPU replica still surges (in
    place, the stage would be gone while its new pod loads), and so does every CPU pod."""
    in_place, surge = {"maxSurge": 0, "maxUnavailable": 1}, {"maxSurge": 1, "maxUnavailable": 0}
    gpu = _k8s(gpu_cfg)  # thinker: 1 GPU replica, talker: 2, code2wav: 3
    assert [gpu_cfg.stage(n).replicas for n in STAGES] == [1, 2, 3]
    want = {"thinker": surge, "talker": in_place, "code2wav": in_place, "gateway": surge}
    for name, strategy in want.items():
        assert gpu[("Deployment", name)]["spec"]["strategy"]["rollingUpdate"] == strategy, name
    for name in ("gateway", *STAGES):
        assert _k8s(default_cfg)[("Deployment", name)]["spec"]["strategy"]["rollingUpdate"] == surge, name


def test_the_model_volume_keeps_its_index_with_tls(gpu_cfg: DeployConfig) -> None:
    """deploy/README.md's overlay patches volumes/3 (the model PVC): TLS must not move it."""
    assert "/spec/template/spec/volumes/3/persistentVolumeClaim/claimName" in (DEPLOY / "README.md").read_text()
    data = gpu_cfg.model_dump()
    data["tls"] = {"stages": True, "cert_file": "/c.pem", "key_file": "/k.pem", "ca_file": "/ca.pem"}
    for cfg in (gpu_cfg, parse_config(data)):
        for name in ("gateway", *STAGES):
            volumes = _k8s(cfg)[("Deployment", name)]["spec"]["template"]["spec"]["volumes"]
            assert volumes[3]["name"] == "model", (name, [v["name"] for v in volumes])


def test_no_hpa_without_metrics_and_least_outstanding_is_refused(gpu_cfg: DeployConfig) -> None:
    data = gpu_cfg.model_dump()
    data["metrics"]["enabled"] = False
    kinds = {kind for kind, _ in _k8s(parse_config(data))}
    assert "HorizontalPodAutoscaler" not in kinds and "Deployment" in kinds
    data = gpu_cfg.model_dump()
    data["routing"] = "least_outstanding"
    for target in ("compose", "k8s"):
        with pytest.raises(ValueError, match="routing: least_outstanding needs the list of replica addresses"):
            render(parse_config(data), target)


def test_the_package_carries_the_default_deploy_file() -> None:
    """The wheel (and so the image) holds omnistage/data/omnistage.yaml as a file; a link to
    ../../deploy would dangle outside a checkout (setuptools drops it)."""
    packaged = DEPLOY.parent / "omnistage" / "data" / "omnistage.yaml"
    assert packaged.is_file() and not packaged.is_symlink()
    assert DEFAULT_YAML.resolve() == packaged.resolve()  # one file, two names


def test_render_without_config_reads_the_file_serve_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`deploy render` with no --config renders `$OMNISTAGE_CONFIG` (then deploy/omnistage.yaml),
    what `omnistage serve` would run, not the built-in defaults."""
    from omnistage.cli.main import app

    mine = tmp_path / "mine.yaml"
    mine.write_text("metrics:\n  port_offset: 500\n")
    monkeypatch.setenv("OMNISTAGE_CONFIG", str(mine))
    result = CliRunner().invoke(app, ["deploy", "render", "--target", "k8s", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    code2wav = (tmp_path / "out" / "k8s" / "code2wav.yaml").read_text()
    assert "prometheus.io/port: '7801'" in code2wav and "'8301'" not in code2wav, code2wav[:2000]
