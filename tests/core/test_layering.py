"""The arrows point one way: hf -> core -> backends; core and backends never import HF libraries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "aitune_hf"
HF_LIBRARIES = {"diffusers", "transformers", "accelerate", "huggingface_hub"}


def _imports(path: Path, runtime_only: bool = False) -> set[str]:
    """Modules `path` imports; `runtime_only` skips `if TYPE_CHECKING:` blocks (annotations, not arrows)."""
    tree = ast.parse(path.read_text())
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                node.body = []
    names = set()
    for node in ast.walk(tree):
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
        assert own <= {"aitune_hf.backends.base", "aitune_hf.errors"}, f"{path.name} imports {own}"


def test_errors_module_is_a_leaf() -> None:
    """Every layer raises from aitune_hf.errors, so it imports nothing of aitune_hf."""
    assert not any(name.startswith("aitune_hf") for name in _imports(PACKAGE / "errors.py"))


def test_no_import_cycle_inside_core() -> None:
    """registration -> context -> strategy; target -> context: no module of core imports one that imports it."""
    graph = {
        path.stem: {
            name.split(".")[-1] for name in _imports(path, runtime_only=True) if name.startswith("aitune_hf.core.")
        }
        for path in (PACKAGE / "core").glob("*.py")
    }

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert not cycles, f"import cycles through {cycles}"


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
        "block = torch.nn.Linear(2, 2).eval()\n"
        "reg = aitune_hf.register([block], {'backends': ['onnxruntime'], 'progress': False})\n"
        "block(torch.ones(1, 2)); reg.tune(); block(torch.ones(1, 2))\n"
        "assert 'not installed' in reg.targets['0'].reason, reg.targets['0'].reason\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
