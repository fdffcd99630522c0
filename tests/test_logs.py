"""Process logging: with `--log-format json` every log record is one JSON object per line,
transformers' too."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_transformers_warnings_go_through_the_json_log() -> None:
    """transformers writes through a handler of its own ("[transformers] ..."), which broke a
    JSON log's one-object-per-line; run in a child, as it changes the process's logging."""
    code = ("from omnistage.cli.logs import setup_logging\n"
            "setup_logging('thinker:7101', 'info', 'json')\n"
            "from transformers.utils import logging\n"
            "logging.get_logger('transformers.models.x').warning('a warning of transformers')\n")  # fmt: skip
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}  # the level is the process's own, not this
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env=env)  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines, out.stderr
    records = [json.loads(line) for line in lines]  # every line parses
    assert any(r["message"] == "a warning of transformers" and r["process"] == "thinker:7101" for r in records)
