"""Libraries point one way: kernels know no models and no wire protocol; model-file metadata,
the recipe and the process runtime hold no torch; services never import the CLI package; the
gateway process never loads torch or model code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imports_of(directory: str) -> dict[str, set[str]]:
    """file -> every module it imports (absolute names; relative imports are not used here)."""
    out: dict[str, set[str]] = {}
    for path in (ROOT / directory).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        out[str(path.relative_to(ROOT))] = names
    return out


@pytest.mark.parametrize(
    ("directory", "forbidden"),
    [
        ("libs/kernels", ("libs.models", "libs.protocol", "services", "deepinfer")),
        ("libs/modelfiles", ("torch", "libs.models", "safetensors")),
        ("libs/recipe", ("torch", "libs.models")),
        ("libs/runtime", ("torch", "services", "deepinfer")),
        ("services", ("deepinfer",)),
    ],
)
def test_imports_point_one_way(directory: str, forbidden: tuple[str, ...]) -> None:
    bad = {
        file: sorted(name for name in names if name.split(".")[0] in forbidden or name.startswith(forbidden))
        for file, names in imports_of(directory).items()
    }
    assert {file: names for file, names in bad.items() if names} == {}


def test_the_gateway_process_loads_no_torch_and_no_model_code() -> None:
    code = (
        "import sys, services.gateway.main, services.gateway.app; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('libs.models')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
