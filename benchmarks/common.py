"""What every benchmark reports about where it ran, and one timing helper."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def machine_info() -> dict[str, Any]:
    import grpc
    import numpy as np

    return {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "grpc": grpc.__version__,
        "load_average": list(os.getloadavg()),
        **source_info(),
    }


def source_info() -> dict[str, Any]:
    """Which omnistage made the figures: its version, and the commit of its source tree (and
    whether that tree had uncommitted changes); None where there is no git checkout."""
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed: str | None = version("omnistage")
    except PackageNotFoundError:
        installed = None
    root = str(Path(__file__).resolve().parents[1])

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"omnistage_version": installed, "git_commit": commit,
            "git_dirty": None if changes is None else bool(changes)}  # fmt: skip


def timed_median(fn: Callable[[], T], reps: int, warmup: int = 1) -> tuple[float, list[float], T]:
    """Median wall time of `reps` calls after `warmup` untimed ones: (median, times, last result)."""
    result = fn()
    for _ in range(warmup - 1):
        result = fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, result


def ms(x: float | None, digits: int = 1) -> str:
    """Seconds as milliseconds for a table ("-": none)."""
    return "-" if x is None else f"{1000 * x:.{digits}f}"


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

