"""Building a backend leaves the process as it found it (issue 8 "Safe to serve"), with other threads running:
sys.stdout/stderr, warnings filters, logger levels and torch's compiling flag; the exporter's log records are
quieted for the building thread only. tests/conftest.py checks the same state around every test."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from aitune_hf.backends import InductorBackend, OnnxRuntimeBackend
from aitune_hf.backends.base import Backend
from aitune_hf.backends.onnx import export as onnx_export
from tests.backends.test_onnxruntime import MLP
from tests.conftest import process_state, state_changes


class DataDependent(MLP):
    """Runs eagerly, but its branch on a tensor's value cannot be exported."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(x)
        if y.sum() > 0:
            return self.down(y)
        return self.down(-y)


class GraphBreak(MLP):
    """Runs eagerly, but cannot compile with fullgraph=True."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(x)
        torch._dynamo.graph_break()
        return self.down(y)


def in_thread(target: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as error:  # reported by the test, not lost in the thread
            errors.append(error)

    return threading.Thread(target=run), errors


def test_builds_leave_the_process_unchanged_while_another_thread_prints_and_runs(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    module = MLP().eval()
    # The other thread runs its own module: one being exported has its parameters swapped for fake ones while
    # torch.export traces it (the tuning core makes other callers of a target wait while it tunes).
    sibling = MLP().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected, sibling_expected = module(x), sibling(x)
    backends: list[Backend] = [OnnxRuntimeBackend(), OnnxRuntimeBackend(weights="live"), InductorBackend()]
    before = process_state()
    stop = threading.Event()
    printed = [0]
    built = []

    def other() -> None:  # prints, logs on an exporter logger and calls the module eagerly until the builds end
        while not stop.is_set() or printed[0] == 0:
            with torch.no_grad():
                torch.testing.assert_close(sibling(x), sibling_expected)
            print(f"other thread {printed[0]}")
            logging.getLogger("onnxscript").warning("other thread record %d", printed[0])
            printed[0] += 1

    def build() -> None:
        with torch.no_grad():
            for backend in backends:
                built.append(backend.build(module, module.forward, [((x,), {})]))

    worker, worker_errors = in_thread(other)
    builder, builder_errors = in_thread(build)
    worker.start()
    builder.start()
    builder.join()
    stop.set()
    worker.join()
    assert not builder_errors, builder_errors
    assert not worker_errors, worker_errors

    assert sys.stdout is before["sys.stdout"]
    assert state_changes(before, process_state()) == []
    assert not torch.compiler.is_compiling()
    # Nothing the other thread printed or logged while the builds ran was lost.
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("other thread ")]
    assert lines == [f"other thread {i}" for i in range(printed[0])]
    records = [r.getMessage() for r in caplog.records if r.getMessage().startswith("other thread record ")]
    assert records == [f"other thread record {i}" for i in range(printed[0])]
    with torch.no_grad():
        for result in built:
            torch.testing.assert_close(result.fn(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("backend", "module"),
    [(OnnxRuntimeBackend(), DataDependent()), (InductorBackend(fullgraph=True), GraphBreak())],
    ids=["onnxruntime-export-fails", "inductor-compile-fails"],
)
def test_a_failing_build_leaves_the_process_unchanged(
    backend: Backend, module: nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    module.eval()
    x = torch.randn(2, 8)
    before = process_state()
    with pytest.raises(Exception), torch.no_grad():  # noqa: B017 (whatever the exporter or compiler raises)
        backend.build(module, module.forward, [((x,), {})])
    assert sys.stdout is before["sys.stdout"]
    assert state_changes(before, process_state()) == []
    assert not torch.compiler.is_compiling()
    assert getattr(onnx_export._state, "depth", 0) == 0
    # The exporter loggers are not left quiet for this thread.
    logging.getLogger("onnxscript").warning("after the failed build")
    assert "after the failed build" in caplog.messages


def test_an_export_prints_no_torch_deprecation_of_its_own() -> None:
    """torch.onnx.export copies LeafSpecs, which warn once per block (13 times in the demo, through the progress bar):
    a filter set at import hides exactly that message; a build adds no filter; other FutureWarnings still show. In a
    fresh interpreter, as a user's script runs (pytest's own warning capture would hide what a user sees)."""
    code = (
        "import warnings, torch\n"
        "from aitune_hf.backends import onnxruntime as ort_backend\n"
        "from tests.backends.test_onnxruntime import MLP\n"
        "module = MLP().eval()\n"
        "before = list(warnings.filters)\n"
        "with torch.no_grad():\n"
        "    ort_backend.OnnxRuntimeBackend().build(module, module.forward, [((torch.randn(2, 8),), {})])\n"
        "assert warnings.filters == before\n"
        "warnings.warn('something else is deprecated', FutureWarning, stacklevel=1)\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LeafSpec" not in result.stderr, result.stderr[-2000:]
    assert "something else is deprecated" in result.stderr


def test_exporter_records_are_dropped_for_the_exporting_thread_only(caplog: pytest.LogCaptureFixture) -> None:
    onnx_export._install_log_filter()
    logger = logging.getLogger("onnxscript")
    assert onnx_export._QUIET in logger.filters
    onnx_export._install_log_filter()  # idempotent
    assert logger.filters.count(onnx_export._QUIET) == 1
    inside, outside = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        logger.warning("from another thread")
        outside.set()

    thread = threading.Thread(target=other)
    thread.start()
    with onnx_export.exporting():
        logger.warning("from the exporting thread")
        logger.error("an error from the exporting thread")
        inside.set()
        outside.wait()
    thread.join()
    logger.warning("after the export")
    assert caplog.messages == ["an error from the exporting thread", "from another thread", "after the export"]
