"""Configs the deploy tests render: the committed default and a GPU/checkpoint variant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from omnistage.config import DeployConfig, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DEFAULT_YAML = DEPLOY / "omnistage.yaml"

GPU_CONFIG: dict[str, Any] = {
    "model": "/data/checkpoints/Qwen3-Omni-30B-A3B-Instruct",
    "gateway": {"replicas": 2},
    "thinker": {"device": "cuda", "dtype": "bfloat16", "base_port": 7101},
    "talker": {"device": "cuda:1", "dtype": "bfloat16", "base_port": 7201, "replicas": 2},
    "code2wav": {"device": "cuda", "base_port": 7301, "replicas": 3},
    "timeouts": {"drain_grace_s": 12.5},
}


@pytest.fixture(scope="session")
def default_cfg() -> DeployConfig:
    return load_config(DEFAULT_YAML)


@pytest.fixture(scope="session")
def gpu_cfg() -> DeployConfig:
    return parse_config(GPU_CONFIG, "gpu test config")


def yaml_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]
