"""The Grafana dashboard reads only metrics the processes export (a renamed metric breaks this)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gateway.metrics import GatewayMetrics
from omnistage.server.metrics import StageMetrics
from omnistage.topology import PIPELINE

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "omnistage.json"


def _exported() -> set[str]:
    """Every sample name the gateway and each stage expose."""
    registries = [GatewayMetrics().registry]
    load = {"waiting": 0, "waiting_for_input": 0, "running": 0, "cache_usage": 0.0, "held_tokens": 0,
            "kv_pool_tokens": 0, "prefix_cache_tokens": 0, "prefill_tokens_total": 0, "cached_tokens_total": 0}
    for s in PIPELINE:
        registries.append(StageMetrics(s.name, s.output_unit, lambda: load, lambda: 0, lambda: 0).registry)
    names: set[str] = set()
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            if family.type == "histogram":
                names.update(f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count"))
            if family.type == "counter":  # (a labelled counter has no sample before its first use)
                names.add(f"{family.name}_total")
    return names


def test_every_dashboard_query_uses_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 13
    exported = _exported()
    used = {name for expr in exprs for name in re.findall(r"omnistage_[a-z0-9_]+", expr)}
    assert used, "the dashboard queries nothing"
    assert used <= exported, sorted(used - exported)
    # every panel has a unique id and a place on the grid
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert all({"x", "y", "w", "h"} <= set(p["gridPos"]) for p in dashboard["panels"])
