"""Every exception aitune_hf raises on purpose is an `AITuneError` (errors.py), so `except AITuneError` catches all
of them, and the CLI prints them as one line; a raise of a builtin class is allowed only where it never reaches a
caller (named below, with the reason)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from aitune_hf import errors

PACKAGE = Path(__file__).resolve().parents[1] / "aitune_hf"

#: (file, exception class) -> why a builtin exception raised there never reaches a caller of aitune_hf.
CONTAINED = {
    ("backends/onnx/model.py", "TypeError"): "an export that cannot be made: the strategy reports it as the "
    "candidate's error and keeps another backend or eager",
    ("backends/onnx/export.py", "RuntimeError"): "a private copy that cannot be exported (background tuning): reported "
    "as the candidate's error",
    ("backends/openvino.py", "RuntimeError"): "a compiled model in another precision than asked for: reported as the "
    "candidate's error, never served",
    ("backends/onnxruntime.py", "RuntimeError"): "a build or a served call that failed: reported as the candidate's "
    "error, or the call falls back to eager",
    ("backends/onnxruntime.py", "MemoryError"): "a call over the shared arena's cap (`arena_cap()`): reported as "
    "the candidate's error, or the served call falls back to eager",
    ("backends/inductor.py", "RuntimeError"): "a compile that failed: reported as the candidate's error",
    ("core/signature.py", "RuntimeError"): "a recorded call that cannot be replayed: tuning keeps eager with it",
    ("core/target.py", "RuntimeError"): "a dropped backend while serving: the call falls back to eager",
    ("core/target.py", "AssertionError"): "a state transition the design has not: a bug, never a user's mistake",
    ("hf/schedule.py", "AssertionError"): "a whole-call transition the design has not: a bug, never a user's mistake",
    ("testing/family_models.py", "AssertionError"): "a family name that was checked before: a bug if reached",
    ("core/cache.py", "ValueError"): "a damaged manifest: the entry is ignored with a warning",
}


def _raised() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                found.append((path.relative_to(PACKAGE).as_posix(), node.lineno, node.exc.func.id))
    return found


def test_every_exception_raised_on_purpose_is_an_aitune_error() -> None:
    ours = {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, Exception)}
    assert all(issubclass(getattr(errors, name), errors.AITuneError) for name in ours)
    raised = _raised()
    assert len(raised) > 50  # the scan sees the package's raises
    wrong = [
        f"{file}:{line} raises {name}"
        for file, line, name in raised
        if name not in ours and isinstance(getattr(builtins, name, None), type) and (file, name) not in CONTAINED
    ]
    assert not wrong, "raise an aitune_hf.errors class (or name the place in CONTAINED, with why):\n" + "\n".join(wrong)
    unused = [key for key in CONTAINED if not any((f, n) == key for f, _, n in raised)]
    assert not unused, f"CONTAINED names places that no longer raise: {unused}"


def test_the_cli_has_no_exception_class_of_its_own() -> None:
    """One hierarchy: the CLI raises errors.UserInputError for a bad command line, as the Python API does."""
    from aitune_hf import cli

    own = [name for name, value in vars(cli).items() if isinstance(value, type) and issubclass(value, Exception)
           and value.__module__ == cli.__name__]  # fmt: skip
    assert own == []
