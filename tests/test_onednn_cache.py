"""oneDNN's primitive cache in stage processes (omnistage/models/onednn.py): the wider cache is
what oneDNN uses, so a convolution shape met again after more than 1,024 others is not compiled again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from omnistage.models import onednn

# 600 convolution shapes (each a kernel and an output reorder: 1,200 entries), then the first
# five again; oneDNN's verbose log says whether each was found in the cache.
_SCRIPT = textwrap.dedent("""
    from omnistage.models.onednn import widen_primitive_cache
    widen_primitive_cache()
    import torch, torch.nn.functional as F
    torch.set_num_threads(1)
    w = torch.randn(4, 4, 7)
    x = torch.randn(2, 4, 700)
    for t in range(8, 608):
        F.conv1d(x[..., :t], w)
    print("AGAIN", flush=True)
    for t in range(8, 13):
        F.conv1d(x[..., :t], w)
""")


def _replays(env: dict[str, str]) -> tuple[int, int]:
    """(cache hits, cache misses) of the convolutions run again."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout  # fmt: skip
    again = out.split("AGAIN", 1)[1].splitlines()
    created = [line for line in again if ",convolution," in line and "create:cache_" in line]
    return sum("cache_hit" in line for line in created), sum("cache_miss" in line for line in created)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_widened_cache_keeps_shapes_past_onednns_default() -> None:
    env = {k: v for k, v in os.environ.items() if k != onednn.ENV}
    env.update(ONEDNN_VERBOSE="all", PYTHONPATH=os.pathsep.join(sys.path))
    assert _replays(env) == (5, 0)
    # the control: oneDNN's own default evicts them, so the check above can fail
    assert _replays({**env, onednn.ENV: "1024"}) == (0, 5)


def test_a_size_from_the_environment_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(onednn.ENV, "64")
    onednn.widen_primitive_cache()
    assert os.environ[onednn.ENV] == "64"
    monkeypatch.delenv(onednn.ENV)
    onednn.widen_primitive_cache()
    assert os.environ[onednn.ENV] == str(onednn.CACHE_ENTRIES)
