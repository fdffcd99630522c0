"""Layers import one way only (docs/architecture.md): every import in the package, at module
level or inside a function, goes to the same layer or one below it. The package never imports
the benchmarks or the tests, and the gateway client never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# bottom to top; a module belongs to the layer of its longest matching prefix
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("definitions", ("omnistage.v1", "omnistage.topology", "omnistage.config", "omnistage")),
    ("models", ("omnistage.models",)),
    ("wire", ("omnistage.wire",)),
    ("engine", ("omnistage.engine",)),
    ("stages", ("services",)),
    ("server", ("omnistage.server",)),
    ("gateway", ("gateway",)),
    ("cli", ("omnistage.cli",)),
]
PACKAGES = ("omnistage", "services", "gateway")


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, rank)
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), rank)
    return None if best is None else best[1]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(path: Path, module: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level] if path.name != "__init__.py" else module.split(".")
                found.add(".".join([*base, node.module or ""]).rstrip("."))
            elif node.module:
                found.add(node.module)
    return found


def test_every_import_goes_down_or_sideways() -> None:
    problems = []
    for module, path in sorted(modules().items()):
        own = layer_of(module)
        assert own is not None, module
        for imported in sorted(imports(path, module)):
            top = imported.split(".")[0]
            if top in ("benchmarks", "tests"):
                problems.append(f"{module} imports {imported}: the package never imports {top}")
                continue
            if top not in PACKAGES:
                continue
            rank = layer_of(imported)
            if rank is not None and rank > own:
                problems.append(f"{module} ({LAYERS[own][0]}) imports {imported} ({LAYERS[rank][0]})")
    assert not problems, "\n".join(problems)


def test_the_layer_map_covers_every_module() -> None:
    names = modules()
    assert "omnistage.engine.engine" in names and "services.edges" in names and "gateway.client" in names
    assert {LAYERS[layer_of(m)][0] for m in names} == {name for name, _ in LAYERS}  # type: ignore[index]


def test_the_client_does_not_load_torch_or_transformers() -> None:
    code = "import gateway.client, sys; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_client_command_does_not_load_torch_or_transformers() -> None:
    code = (
        "import sys\n"
        "from omnistage.cli.main import app\n"
        "sys.argv = ['omnistage', 'client', 'x', '--target', '127.0.0.1:1', '--timeout', '0.3', '--no-audio']\n"
        "try:\n    app()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "UNAVAILABLE" in out.stderr  # it did try the (closed) port
