"""Generate the Python gRPC/protobuf code in ``omnistage/v1`` from ``protos/omnistage/v1``.

``python -m omnistage.protogen`` (or ``make protos``) regenerates the committed code. The output
is reproducible byte for byte: protoc (bundled with grpcio-tools) runs on relative paths with
``-I protos`` in a fixed order, and the files are written only after a complete run, so a failed
run never leaves a half-generated package. ``tests/test_protos_fresh.py`` regenerates into a
temporary directory and fails when the committed code is stale.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE = Path("omnistage") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

INIT_TEXT = '''"""Generated protobuf/gRPC code for the ``omnistage.v1`` proto package.

Do not edit: the sources are ``protos/omnistage/v1/*.proto``; regenerate with
``python -m omnistage.protogen``.
"""
'''

# Generated stubs are not ours to lint; ruff's config only excludes the .py files.
PYI_HEADER = "# ruff: noqa\n"


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto files of the package, relative to ``proto_root``, in a fixed order."""
    return sorted(p.relative_to(proto_root) for p in (proto_root / PACKAGE).glob("*.proto"))


def _is_generated(name: str) -> bool:
    return name.endswith(GENERATED_SUFFIXES) or name == "__init__.py"


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Generate into ``out_root/omnistage/v1`` and return the written files (sorted).

    Stale generated files in the target directory (from a removed .proto) are deleted.
    """
    import grpc_tools

    files = proto_files(proto_root)
    if not files:
        raise RuntimeError(f"no .proto files under {proto_root / PACKAGE}")
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory(prefix="omnistage-protogen-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(f.as_posix() for f in files),
        ]
        proc = subprocess.run(cmd, cwd=proto_root, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"protoc failed ({proc.returncode}):\n{proc.stderr}")
        produced = Path(tmp) / PACKAGE
        (produced / "__init__.py").write_text(INIT_TEXT, encoding="utf-8")
        for pyi in produced.glob("*.pyi"):
            pyi.write_text(PYI_HEADER + pyi.read_text(encoding="utf-8"), encoding="utf-8")

        target = out_root / PACKAGE
        target.mkdir(parents=True, exist_ok=True)
        new_names = {p.name for p in produced.iterdir() if p.is_file()}
        for old in target.iterdir():
            if old.is_file() and _is_generated(old.name) and old.name not in new_names:
                old.unlink()
        written = []
        for name in sorted(new_names):
            shutil.copyfile(produced / name, target / name)
            written.append(target / name)
        return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write omnistage/v1 under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
