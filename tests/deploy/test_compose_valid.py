"""docker-compose.yaml validates against the Compose Specification JSON schema.

tests/deploy/compose-spec.json is an unmodified copy of `compose/config/compose_spec.json` from the
PyPI wheel docker_compose-1.29.2-py2.py3-none-any.whl (Apache-2.0; the compose-spec schema as
vendored by docker-compose 1.29.2). Every field the render uses is also in today's compose-spec
schema. Its custom formats (duration, ports, expose) are checked here by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from omnistage.cli.deploy_render import render
from omnistage.config import DeployConfig

from .conftest import DEPLOY

SCHEMA = json.loads((Path(__file__).parent / "compose-spec.json").read_text())
GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|ms|s|m|h))+$")
PORT_MAPPING = re.compile(r"^(\d{1,3}(\.\d{1,3}){3}:)?(\d+(-\d+)?:)?\d+$")  # [host ip:][host ports:]port
DEFAULTED = re.compile(r"\$\{[A-Z_]+:-([^}]*)\}")


def interpolate(value: str) -> str:
    """What compose makes of `${VAR:-default}` with VAR unset."""
    return DEFAULTED.sub(lambda m: m.group(1), value)


def _validate(doc: dict[str, Any]) -> None:
    jsonschema.Draft201909Validator.check_schema(SCHEMA)
    jsonschema.Draft201909Validator(SCHEMA).validate(doc)
    for name, svc in doc["services"].items():
        for key in ("stop_grace_period",):
            assert GO_DURATION.match(svc[key]), (name, key)
        for key in ("interval", "timeout", "start_period"):
            assert GO_DURATION.match(svc["healthcheck"][key]), (name, key)
        for port in svc.get("ports", []):
            assert PORT_MAPPING.match(interpolate(port)), (name, port)
        for port in svc["expose"]:
            assert port.isdigit(), (name, port)
        for dep in svc.get("depends_on", {}):
            assert dep in doc["services"], (name, dep)
            assert doc["services"][dep]["profiles"] == svc["profiles"], (name, dep)


def test_committed_compose_validates() -> None:
    doc = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    _validate(doc)
    profiles = {p for svc in doc["services"].values() for p in svc["profiles"]}
    assert profiles == {"cpu", "gpu"}
    # config files mounted by the compose file exist next to it
    for svc in doc["services"].values():
        for vol in svc["volumes"]:
            if vol["source"].startswith("./"):
                assert (DEPLOY / vol["source"]).is_file(), vol["source"]


def test_gpu_compose_validates(gpu_cfg: DeployConfig) -> None:
    doc = yaml.safe_load(render(gpu_cfg, "compose")["docker-compose.yaml"])
    _validate(doc)
    # published on the host's loopback unless OMNISTAGE_PUBLISH_HOST says otherwise
    ports = doc["services"]["gateway"]["ports"]
    assert [interpolate(p) for p in ports] == ["127.0.0.1:50051-50052:50051", "127.0.0.1:8000-8001:8000"]
    assert all(p.startswith("${OMNISTAGE_PUBLISH_HOST:-127.0.0.1}:") for p in ports)


def test_schema_rejects_what_compose_rejects() -> None:
    doc = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    doc["services"]["thinker"]["deploy"]["resources"] = {"reservations": {"gpus": 1}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft201909Validator(SCHEMA).validate(doc)
