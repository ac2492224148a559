"""Shared test settings: quiet logs, fixed seeds, a gpu marker that skips with a reason on CPU, and a check that
no test leaves process-wide state changed."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

# The persistent cache is on by default (in the user's cache folder): the suite turns it off so that no test
# starts warm from another's decisions (or from a developer's own cache). Cache tests pass cache_dir explicitly.
os.environ["AITUNE_HF_CACHE"] = "off"
# The suite leaves nothing behind (issue 46): Inductor's on-disk cache and Ray's session folder go to one temporary
# folder, made by the first process (the xdist workers inherit it) and removed by it at the end (`pytest_unconfigure`).
if "AITUNE_HF_TEST_TMP" not in os.environ:
    import tempfile

    os.environ["AITUNE_HF_TEST_TMP"] = tempfile.mkdtemp(prefix="aitune_hf_tests_")
    os.environ["AITUNE_HF_TEST_TMP_OWNER"] = str(os.getpid())
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["AITUNE_HF_TEST_TMP"], "inductor"))

#: Loggers whose levels every test must leave as it found them ("" is the root logger).
WATCHED_LOGGERS = ("", "torch.onnx", "onnxscript", "onnx_ir", "torch.export", "torch._export")


def _pin_threads() -> int:
    """Each xdist worker gets its share of the cores as torch threads (one each with two workers on two cores), so
    that workers do not fight over cores and timings inside a test are steady; fresh processes that a test starts
    inherit the count through OMP_NUM_THREADS."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def pytest_configure(config: pytest.Config) -> None:
    _pin_threads()
    # torch 2.13's ONNX exporter warns this from inside torch on every export (a deepcopy of a pytree LeafSpec);
    # the backend no longer silences warnings (not thread-safe), so the tests do, for this one only.
    config.addinivalue_line("filterwarnings", r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")
    # Libraries that add warnings filters when first imported (sympy, imported by the first export or compile; scipy,
    # by ONNX Runtime's quantization tool, which the int8 candidates import; requests and urllib3, by the first
    # `save_pretrained` of a test that builds its own tiny model): imported here, once, so that the per-test check
    # below sees what a test did, not what an import did.
    import sympy  # noqa: F401

    with contextlib.suppress(ImportError):
        import onnxruntime.quantization  # noqa: F401
    with contextlib.suppress(ImportError):
        import requests  # noqa: F401


#: Modules whose tests run together on one xdist worker: each builds a tuned pipeline or model in a module-scoped
#: fixture (tens of seconds) that its tests only read. Every other test is shared out on its own.
WHOLE_MODULES = frozenset(
    {
        "tests/test_cli.py",
        "tests/test_serving.py",
        "tests/test_session.py",
        "tests/test_testing_factories.py",
        "tests/core/test_inductor.py",
        "tests/hf/test_boundaries.py",
        "tests/hf/test_copies.py",
        "tests/hf/test_discovery.py",
        "tests/hf/test_pipelines.py",
        "tests/hf/test_transformers.py",
    }
)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's own way to keep tests together (`--dist loadgroup` with `xdist_group` marks) renames node ids
    through an attribute pytest 9.2 no longer reads, so it shares them out one by one. This scheduler does what it
    should: a module of `WHOLE_MODULES` is one unit of work, any other test its own; the larger units go first."""
    from xdist.scheduler import LoadScopeScheduling

    class WholeModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in WHOLE_MODULES else nodeid

    return WholeModules(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("AITUNE_HF_TEST_TMP_OWNER") == str(os.getpid()):
        import shutil

        shutil.rmtree(os.environ["AITUNE_HF_TEST_TMP"], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_exports(request: pytest.FixtureRequest) -> None:
    """A test marked `fresh_exports` exports every ONNX Runtime build: the exports an earlier test of this worker left
    for reuse (`aitune_hf.backends.forget_exports`) are dropped first. For tests whose subject is the export
    (under threads, in the build process); any other test may be served a reused export, as a user would be."""
    if request.node.get_closest_marker("fresh_exports") is not None:
        from aitune_hf.backends import forget_exports

        forget_exports()


def process_state() -> dict[str, Any]:
    """What tuning must never leave changed (issue 8): the standard streams, the warnings filters, the
    levels of the exporter loggers and the root logger, and torch's compiling/exporting flags."""
    return {
        "sys.stdout": sys.stdout,
        "sys.stderr": sys.stderr,
        "warnings.filters": list(warnings.filters),
        **{f"level of logger {name or 'root'!r}": logging.getLogger(name).level for name in WATCHED_LOGGERS},
        "torch.compiler.is_compiling()": torch.compiler.is_compiling(),
        "torch.compiler.is_exporting()": torch.compiler.is_exporting(),
    }


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per entry of `process_state()` that differs (streams by identity, the rest by value)."""
    changes = []
    for key, old in before.items():
        new = after[key]
        same = new is old if key.startswith("sys.") else new == old
        if not same:
            if key == "warnings.filters":
                added = [f for f in new if f not in old]
                removed = [f for f in old if f not in new]
                changes.append(f"{key}: added {added}, removed {removed}" if added or removed else f"{key}: reordered")
            else:
                changes.append(f"{key}: {old!r} -> {new!r}")
    return changes


def restore_process_state(state: dict[str, Any]) -> None:
    """Puts back what `process_state()` recorded, so that one leaking test does not leak into the next."""
    for key, value in state.items():
        if key.startswith("sys."):
            setattr(sys, key[4:], value)
        elif key == "warnings.filters":
            warnings.filters[:] = value
            warnings._filters_mutated()  # type: ignore[attr-defined]
        elif key.startswith("level of logger "):
            name = key[len("level of logger ") :].strip("'")
            logging.getLogger("" if name == "root" else name).setLevel(value)
        elif key == "torch.compiler.is_compiling()":
            torch.compiler._is_compiling_flag = value
        elif key == "torch.compiler.is_exporting()":
            torch.compiler._is_exporting_flag = value


@pytest.fixture(autouse=True)
def _process_state_unchanged() -> Iterator[None]:
    """Fails a test that leaves process-wide state changed.

    The snapshot is taken in this fixture's setup and compared at its teardown: both run inside the warnings
    context pytest opens once around the whole test (setup, call, teardown), and with the same capture and log
    level pytest applies to every phase, so pytest's own changes show in both and are never reported (pytest
    also puts the streams and the root level back after each phase, hiding a test body's change to them:
    `pytest_runtest_call` below checks those around the call). Being
    autouse, this fixture is set up before, and torn down after, the test's other fixtures (caplog, capsys,
    monkeypatch, recwarn), so what they restore is restored when it compares.
    """
    before = process_state()
    yield
    changes = state_changes(before, process_state())
    if changes:
        restore_process_state(before)
        pytest.fail("the test left process-wide state changed:\n  " + "\n  ".join(changes), pytrace=False)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """The same check, for what pytest itself puts back after each phase and would hide from the fixture:
    sys.stdout/stderr (its capture) and the root logger's level (its log capture; not for a test that uses
    caplog, whose `set_level` holds until caplog's teardown). `trylast`: this wrapper runs inside pytest's, so
    it sees the test body's streams. A test that replaces a stream on purpose restores it before it returns
    (capsys, or `monkeypatch.context()`)."""
    keys = ["sys.stdout", "sys.stderr"] + ([] if "caplog" in item.fixturenames else ["level of logger 'root'"])
    before = {key: process_state()[key] for key in keys}
    result = yield
    changes = state_changes(before, {key: process_state()[key] for key in keys})
    if changes:
        restore_process_state(before)
        pytest.fail("the test left process-wide state changed:\n  " + "\n  ".join(changes), pytrace=False)
    return result
