"""The arrows point one way: hf -> core -> backends; core and backends never import HF libraries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "aitune_hf"
HF_LIBRARIES = {"diffusers", "transformers", "accelerate", "huggingface_hub"}


def _tree(path: Path) -> ast.Module:
    """The parsed file. Imports under `if TYPE_CHECKING:` stay in: a type named from a room above is an arrow up too
    (a lower room names such a type by a small protocol of its own)."""
    return ast.parse(path.read_text())


def _imports(path: Path) -> set[str]:
    """Modules `path` imports, type-only imports and imports inside functions included."""
    names = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_and_backends_import_no_hugging_face_library() -> None:
    for folder in ("core", "backends"):
        for path in (PACKAGE / folder).rglob("*.py"):
            roots = {name.split(".")[0] for name in _imports(path)}
            assert not roots & HF_LIBRARIES, f"{path.name} imports {roots & HF_LIBRARIES}"


#: Names the core must not spell out: Hugging Face libraries and the attributes their hooks keep on a module. The
#: Hugging Face layer registers what the core must know of them (`hf/names.py`).
_NAMED_ELSEWHERE = (*HF_LIBRARIES, "peft", "_hf_hook", "_old_forward", "_diffusers_hook", "_name_or_path")


def _code_strings(tree: ast.Module) -> list[str]:
    """The string constants of `tree` that are code, not docstrings."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_the_core_names_no_hugging_face_object_in_its_code() -> None:
    """Names that belong to the Hugging Face layer come from it (registration points), not as strings in the core."""
    for path in (PACKAGE / "core").glob("*.py"):
        named = {n for text in _code_strings(_tree(path)) for n in _NAMED_ELSEWHERE if n in text.lower()}
        assert not named, f"core/{path.name} spells out {sorted(named)}"


_BELOW_BACKENDS = {"aitune_hf.backends.base", "aitune_hf.errors", "aitune_hf.hardware"}


def test_backends_import_no_other_backend_nor_core() -> None:
    """A backend imports the base, the leaf modules and the shared ONNX export (`backends/onnx/`), never another
    backend nor the core; type-only imports count too."""
    for path in (PACKAGE / "backends").glob("*.py"):
        if path.name in ("__init__.py", "base.py"):
            continue
        own = {name for name in _imports(path) if name.startswith("aitune_hf")}
        room = {name for name in own if name.startswith("aitune_hf.backends.onnx.")}
        assert own - room <= _BELOW_BACKENDS, f"{path.name} imports {own - room}"


def test_the_shared_onnx_export_imports_no_backend() -> None:
    """`backends/onnx/` is the export the ONNX runtimes share: it imports none of them (a runtime's step in the build
    process reaches it as a function passed in), nor the core."""
    for path in (PACKAGE / "backends" / "onnx").glob("*.py"):
        own = {name for name in _imports(path) if name.startswith("aitune_hf")}
        room = {name for name in own if name.startswith("aitune_hf.backends.onnx")}
        assert own - room <= _BELOW_BACKENDS, f"onnx/{path.name} imports {own - room}"


@pytest.mark.parametrize("leaf", ["errors.py", "hardware.py"])
def test_leaf_modules_import_nothing_of_the_package(leaf: str) -> None:
    """Every layer raises from aitune_hf.errors and asks aitune_hf.hardware what this machine computes natively, so
    neither imports anything of aitune_hf."""
    assert not any(name.startswith("aitune_hf") for name in _imports(PACKAGE / leaf))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports, lazy imports inside functions and type-only
    imports (`if TYPE_CHECKING:`) included: each is an arrow; `from aitune_hf.x import y` counts as importing
    aitune_hf.x.y where that is a module, else aitune_hf.x."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith("aitune_hf"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aitune_hf"):
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    found.add(child if child in modules else node.module)
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules of `graph` that reach themselves (the package's own __init__ files, which gather the public face,
    are not counted as importers)."""
    graph = {name: {t for t in targets if not PACKAGE.joinpath(*t.split(".")[1:], "__init__.py").exists()}
             for name, targets in graph.items()}  # fmt: skip

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    return sorted(name for name in graph if reaches(name, name, set()))


def test_no_import_cycle_anywhere_in_the_package() -> None:
    """No module imports one that imports it back, through any path, lazy and type-only imports included."""
    cycles = _cycles(_package_graph())
    assert not cycles, f"import cycles through {cycles}"


def test_a_type_only_import_closes_a_cycle_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a circle whose way back is an import under `if TYPE_CHECKING:` is found."""
    package = tmp_path / "aitune_hf"
    package.mkdir()
    (package / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from aitune_hf.high import High\n"
    )
    (package / "high.py").write_text("from aitune_hf.low import low\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert _cycles(_package_graph()) == ["aitune_hf.high", "aitune_hf.low"]


#: Who may not import whom (ARCHITECTURE.md, "Arrows point one way"): importer prefix -> forbidden prefixes.
FORBIDDEN = {
    "aitune_hf.core": ("aitune_hf.hf", "aitune_hf.session", "aitune_hf.plotting", "aitune_hf.cli",
                       "aitune_hf.serving", "aitune_hf.testing"),
    "aitune_hf.backends": ("aitune_hf.core", "aitune_hf.hf", "aitune_hf.session", "aitune_hf.plotting",
                           "aitune_hf.cli", "aitune_hf.serving", "aitune_hf.testing"),
    "aitune_hf.hf": ("aitune_hf.session", "aitune_hf.plotting", "aitune_hf.cli", "aitune_hf.serving"),
    "aitune_hf.plotting": ("aitune_hf.hf", "aitune_hf.session", "aitune_hf.cli", "aitune_hf.serving"),
    "aitune_hf.session": ("aitune_hf.cli",),
    # testing (tiny local models) raises aitune_hf.errors, inside its functions, and imports nothing else of ours.
    "aitune_hf.testing": ("aitune_hf.core", "aitune_hf.hf", "aitune_hf.backends", "aitune_hf.session",
                          "aitune_hf.plotting", "aitune_hf.cli", "aitune_hf.serving"),
}  # fmt: skip


def test_every_arrow_points_one_way() -> None:
    broken = [
        f"{name} imports {target}"
        for name, targets in _package_graph().items()
        for importer, forbidden in FORBIDDEN.items()
        if name == importer or name.startswith(importer + ".")
        for target in targets
        if target.startswith(forbidden)
    ]
    assert not broken, broken


#: The public API: what benchmarks and notebooks may import of aitune_hf (the package's own names, and these
#: documented modules). Everything else (core, hf, cli, backends' own files) is internal and may change.
PUBLIC = frozenset({"aitune_hf", "aitune_hf.backends", "aitune_hf.errors", "aitune_hf.hardware", "aitune_hf.plotting",
                    "aitune_hf.serving", "aitune_hf.session", "aitune_hf.testing"})  # fmt: skip
#: Internal imports a benchmark makes on purpose, with why.
INTERNAL_ON_PURPOSE = {
    # It times the per-call guard checks themselves (issue 7): it needs the guard class and reads its parts.
    "benchmarks/guards.py": {"aitune_hf.core.guards"},
}
ROOT = PACKAGE.parent


def _code_trees(path: Path) -> list[ast.Module]:
    """The parsed code of a benchmark, or of each code cell of a notebook (IPython magics and shell lines left out)."""
    import json

    if path.suffix != ".ipynb":
        return [_tree(path)]
    trees = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        trees.append(ast.parse("\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))))
    return trees


def _notebook_imports(path: Path) -> set[str]:
    """Modules the code cells of a notebook import."""
    names = set()
    for tree in _code_trees(path):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


def test_benchmarks_and_notebooks_use_the_public_api_only() -> None:
    files = sorted(ROOT.glob("benchmarks/*.py")) + sorted(ROOT.glob("notebooks/*.ipynb"))
    assert files, "no benchmarks nor notebooks found"
    broken = []
    for path in files:
        imported = _notebook_imports(path) if path.suffix == ".ipynb" else _imports(path)
        ours = {name for name in imported if name.split(".")[0] == "aitune_hf"}
        allowed = PUBLIC | INTERNAL_ON_PURPOSE.get(path.relative_to(ROOT).as_posix(), set())
        broken += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(ours - allowed)]
    assert not broken, broken


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names_of_the_package() -> frozenset[str]:
    """The private names (`_x`, not dunder) the package defines: attributes set on `self`/`cls`, names in a class
    body, and module-level names. Reading one of these from outside the package reads our internals."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        tree = _tree(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.ClassDef | ast.Module):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                        names.add(item.name)
                    elif isinstance(item, ast.Assign | ast.AnnAssign):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(name for name in names if _is_private(name))


def _private_reads(tree: ast.Module, ours: frozenset[str]) -> list[str]:
    """`obj._x` in `tree` where `_x` is one of `ours` and `obj` is not `self`/`cls` nor a module imported from
    another library (`torch._dynamo`): what a benchmark or notebook reads of our internals."""
    foreign = set()  # names bound to other libraries' modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign.update((a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("aitune_hf"))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("aitune_hf"):
            foreign.update(a.asname or a.name for a in node.names)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in ours):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and (root.id in ("self", "cls") or root.id in foreign):
            continue
        found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_benchmarks_and_notebooks_read_no_private_attribute_of_ours() -> None:
    """Benchmarks and notebooks read what the package offers in public (`Target.routes`, `ModuleGuard.weights`, ...),
    never an `obj._x` that the package defines: internals change without notice."""
    ours = _private_names_of_the_package()
    files = sorted(ROOT.glob("benchmarks/*.py")) + sorted(ROOT.glob("notebooks/*.ipynb"))
    broken = [
        f"{path.relative_to(ROOT)} {read}"
        for path in files
        for tree in _code_trees(path)
        for read in _private_reads(tree, ours)
    ]
    assert not broken, broken


def test_the_private_read_check_sees_one() -> None:
    tree = ast.parse("import torch\nroutes = target._routes\nself._routes = 1\ntorch._dynamo.reset()\n")
    assert _private_reads(tree, frozenset({"_routes", "_dynamo"})) == ["line 2: ._routes"]


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
