"""The arrows point one way: hf -> core -> backends; core and backends never import HF libraries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "aitune_hf"
HF_LIBRARIES = {"diffusers", "transformers", "accelerate", "huggingface_hub"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_and_backends_import_no_hugging_face_library() -> None:
    for folder in ("core", "backends"):
        for path in (PACKAGE / folder).glob("*.py"):
            roots = {name.split(".")[0] for name in _imports(path)}
            assert not roots & HF_LIBRARIES, f"{path.name} imports {roots & HF_LIBRARIES}"


def test_backends_import_no_other_backend_nor_core() -> None:
    for path in (PACKAGE / "backends").glob("*.py"):
        if path.name in ("__init__.py", "base.py"):
            continue
        own = {name for name in _imports(path) if name.startswith("aitune_hf")}
        assert own <= {"aitune_hf.backends.base"}, f"{path.name} imports {own}"


def test_core_never_imports_hf_layer() -> None:
    for path in (PACKAGE / "core").glob("*.py"):
        assert not any(name.startswith("aitune_hf.hf") for name in _imports(path)), path.name


def test_package_imports_without_optional_libraries() -> None:
    code = (
        "import sys\n"
        "for name in ('onnxruntime', 'onnxscript', 'diffusers', 'transformers', 'accelerate'):\n"
        "    sys.modules[name] = None\n"
        "import torch, aitune_hf\n"
        "from aitune_hf.backends import get_backend\n"
        "reason = get_backend('onnxruntime').unavailable_reason(frozenset({torch.device('cpu')}))\n"
        "assert 'onnxruntime is not installed' in reason and 'aitune-hf[onnx]' in reason, reason\n"
        "block = torch.nn.Linear(2, 2)\n"
        "reg = aitune_hf.register([block], {'backends': ['onnxruntime'], 'progress': False})\n"
        "block(torch.ones(1, 2)); reg.tune(); block(torch.ones(1, 2))\n"
        "assert 'not installed' in reg.targets['0'].reason, reg.targets['0'].reason\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
