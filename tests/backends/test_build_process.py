"""The build process (issue 20): a private build (background tuning) exports, quantizes and optimises in a worker
process, and this process only loads the optimised model; a foreground build stays here; a block that cannot be
pickled, or that the worker fails on, is built here as before. Real torch and ONNX Runtime; the worker is one per
process, so its start is paid once per test session."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from aitune_hf.backends import OnnxRuntimeBackend
from aitune_hf.backends.base import build_context, build_process_pid
from tests.backends.test_onnxruntime import MLP, TOL

# The test process's id, also where the worker imports this file (it inherits the environment).
HERE = int(os.environ.setdefault("AITUNE_HF_TEST_BUILD_PARENT", str(os.getpid())))


class FailsElsewhere(MLP):
    """Copies and pickles here, but cannot be unpickled in another process: the worker's build fails."""

    def __setstate__(self, state: dict[str, object]) -> None:
        if os.getpid() != HERE:
            raise RuntimeError("this block cannot be rebuilt outside the test process")
        super().__setstate__(state)


def _private_build(module: nn.Module, x: torch.Tensor, shared: dict[object, object] | None = None, **options: str):
    with build_context(private_only=True, shared={} if shared is None else shared):
        return OnnxRuntimeBackend(**options).build(module, module.forward, [((x,), {})], dynamic=True)


def test_a_private_build_runs_in_the_build_process_and_equals_eager() -> None:
    torch.manual_seed(0)
    module, x = MLP().eval(), torch.randn(4, 8)
    shared: dict[object, object] = {}
    built = _private_build(module, x, shared)
    worker = build_process_pid()
    assert worker is not None and worker != os.getpid()
    assert built.fn.built_in == worker and built.fn.source == "export"
    with torch.no_grad():
        for batch in (x, torch.randn(7, 8)):  # a shape family: another batch size too
            torch.testing.assert_close(built.fn(batch), module(batch), **TOL)
    # The int8 variant of the same call starts from the fp32 export (in `shared`): quantized and optimised there too.
    int8 = _private_build(module, x, shared, precision="int8")
    assert int8.fn.built_in == worker
    with torch.no_grad():
        torch.testing.assert_close(int8.fn(x), module(x), atol=0.05, rtol=0.05)
    assert build_process_pid() == worker  # one worker, kept


def test_a_foreground_build_stays_in_this_process() -> None:
    torch.manual_seed(0)
    module, x = MLP().eval(), torch.randn(4, 8)
    built = OnnxRuntimeBackend().build(module, module.forward, [((x,), {})])
    assert built.fn.built_in is None
    with torch.no_grad():
        torch.testing.assert_close(built.fn(x), module(x), **TOL)


def test_a_block_that_cannot_be_pickled_is_built_here(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    module, x = MLP().eval(), torch.randn(4, 8)
    module.note = lambda: "a lambda: copied by reference, never pickled"  # type: ignore[assignment]
    with caplog.at_level(logging.DEBUG, logger="aitune_hf.backends.onnx.worker"):
        built = _private_build(module, x)
    assert built.fn.built_in is None and built.fn.source == "export"
    assert "cannot go to the build process" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(built.fn(x), module(x), **TOL)


def test_a_block_the_worker_fails_on_is_built_here_and_the_worker_serves_on(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    module, x = FailsElsewhere().eval(), torch.randn(4, 8)
    with caplog.at_level(logging.DEBUG, logger="aitune_hf.backends.onnx.worker"):
        built = _private_build(module, x)
    assert built.fn.built_in is None
    assert "did not build this block" in caplog.text and "cannot be rebuilt outside" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(built.fn(x), module(x), **TOL)
    worker = build_process_pid()
    assert _private_build(MLP().eval(), x).fn.built_in == worker is not None  # the worker survived the failure


def _imported(names: list[str]) -> list[str]:
    """In the build process: which of `names` it has imported."""
    import sys

    return [name for name in names if name in sys.modules]


def test_a_registration_that_will_search_on_the_worker_starts_the_build_process_with_its_imports() -> None:
    """The search after a first plan (anytime tuning, the default) builds in the build process from its first step: the
    process starts at registration, with the runtimes and the model's classes imported, while the first call runs."""
    import time

    from aitune_hf import register
    from aitune_hf.backends import base

    base._stop_build_process()  # a fresh start, whatever earlier tests left
    assert build_process_pid() is None
    registration = register({"0": FailsElsewhere().eval()}, {"backends": ["onnxruntime"], "progress": False})
    deadline = time.monotonic() + 120
    while (base._warming or build_process_pid() is None) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = build_process_pid()
    assert worker is not None and worker != os.getpid()
    names = ["onnxruntime", "onnxscript", "aitune_hf.backends.onnx.worker", FailsElsewhere.__module__]
    assert base.run_in_build_process(_imported, names) == names
    assert build_process_pid() == worker
    registration.detach()
    # A registration that tunes only in the calls (no search: anytime off) starts nothing.
    base._stop_build_process()
    registration = register({"0": MLP().eval()}, {"backends": ["onnxruntime"], "progress": False, "anytime": False})
    time.sleep(0.5)
    assert build_process_pid() is None and not base._warming
    registration.detach()


def _dies(signal_number: int) -> None:
    """In the build process: end it as a crashing engine does (OpenVINO's bf16 stateful decoder: SIGFPE)."""
    os.kill(os.getpid(), signal_number)


def test_an_engine_that_kills_the_build_process_costs_a_candidate_not_this_process() -> None:
    """What `openvino.run_elsewhere_first` relies on (issue 47): a call that kills the worker raises here, naming the
    signal, and the next call gets a fresh worker. Then a real OpenVINO model run there first, as the bf16 decoder
    is: it runs; one the engine refuses there is an unavailable candidate, with the engine's reason."""
    import signal

    import numpy as np

    from aitune_hf.backends import base
    from aitune_hf.errors import TuningError

    with pytest.raises(TuningError, match="killed by SIGFPE"):
        base.run_in_build_process(_dies, signal.SIGFPE)
    assert base.run_in_build_process(_imported, ["os"]) == ["os"]  # started again
    openvino = pytest.importorskip("openvino")
    from openvino import opset13

    from aitune_hf.backends.openvino import run_elsewhere_first
    from aitune_hf.errors import CandidateUnavailable

    x = opset13.parameter([-1, 4], openvino.Type.f32, name="x")
    model = openvino.Model([opset13.relu(x)], [x])
    feeds = [{"x": np.ones((2, 4), np.float32)}]
    run_elsewhere_first(model, {"INFERENCE_NUM_THREADS": 1}, feeds, "a ReLU")
    refused = r"(?s)a ReLU, run first in the build process, failed there .*NO_SUCH_PROPERTY"
    with pytest.raises(CandidateUnavailable, match=refused):
        run_elsewhere_first(model, {"NO_SUCH_PROPERTY": 1}, feeds, "a ReLU")


def test_a_block_goes_to_the_build_process_with_its_weights_out_of_band() -> None:
    """A block's weights go to the build process as buffers sharing its memory (`pickle_out_of_band`), not inside the
    pickle: each load of it is a copy of its own, equal to the block."""
    import pickle

    from aitune_hf.backends.base import pickle_out_of_band

    module = MLP().eval()
    data, buffers = pickle_out_of_band(module)
    assert len(data) < 4096 and sum(buffer.raw().nbytes for buffer in buffers) >= 4 * module.up.weight.numel()
    first, second = (pickle.loads(data, buffers=[b.raw().tobytes() for b in buffers]) for _ in range(2))
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(first(x), module(x), rtol=0, atol=0)
        first.up.weight.add_(1.0)  # its own memory: neither the block nor another load sees it
        torch.testing.assert_close(second(x), module(x), rtol=0, atol=0)
