#!/usr/bin/env bash
# The wheels run.sh installs on the device machine (Python 3.12, its own CUDA torch, no package
# index), downloaded here into .whl/ at the versions this checkout's .venv holds. Run it here, in
# the repository's root, after `make install`; the device call then carries .whl.
# Left out, the machine's own serving: huggingface_hub (1.33 there meets transformers 5.23; the
# 2.x line needs httpx2 and httpcore2 as well) and the rest it has (numpy, safetensors, pyyaml,
# tqdm, httpx, prometheus-client, click, rich). PyAV (35 MB) is left out too: only the media
# benches import it, and the tree that travels is limited to 64 MiB. (.gitignore ignores .whl/.)
set -euo pipefail
names=(transformers tokenizers grpcio grpcio-health-checking grpcio-reflection protobuf pydantic pydantic_core
       annotated-types typing-inspection typing_extensions starlette uvicorn typer annotated-doc)
pins=$(.venv/bin/python - "${names[@]}" <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
PY
)
rm -rf .whl && mkdir .whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
du -sh .whl
