"""Every backend, through the public path, against the input layouts that break marshalling (issue 9, item 4):
0-d, empty, non-contiguous, broadcast (stride 0) and channels-last tensors, one test each.

Each test registers a tiny module, records one call with such a tensor, tunes with that one backend
(`OneBackend`: chosen whenever correct, whatever its speed), calls again with fresh values of the same kind, and
checks the output against the module's eager forward and that the backend served the call.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from aitune_hf import OneBackend, TargetState, TuningConfig, register
from aitune_hf.backends import EagerBackend
from aitune_hf.backends.base import Backend, get_backend

TOL = {"atol": 1e-5, "rtol": 1e-5}


class AsCandidate(EagerBackend):
    """The eager backend's own build (the forward, unchanged), under a name that makes it a candidate: the
    core never builds "eager" itself (it is the baseline), and `OneBackend("eager")` is refused."""

    name = "eager_as_candidate"


BACKENDS: dict[str, Callable[[], Backend]] = {
    "eager": AsCandidate,
    "inductor": lambda: get_backend("inductor"),
    "onnxruntime": lambda: get_backend("onnxruntime"),
    "openvino": lambda: get_backend("openvino"),
}


class Block(nn.Module):
    """A 1x1 convolution scaled by a timestep-like `t` (broadcast multiply), and `t * gain`, whose shape is
    `t`'s: a 0-d `t` must come back 0-d (the SD UNet once failed in ORT because a 0-d timestep became (1,))."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.register_buffer("gain", torch.tensor(1.5))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv(x) * t + x, t * self.gain


def _t() -> torch.Tensor:
    return torch.rand(1) + 0.5  # a one-element timestep; the 0-d case passes a 0-d one


#: kind -> a fresh call (x, t) of that kind; x is NCHW with C=3.
KINDS: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    "0-d": lambda: (torch.randn(2, 3, 4, 4), torch.rand(()) + 0.5),
    "empty": lambda: (torch.randn(0, 3, 4, 4), _t()),
    "non-contiguous": lambda: (torch.randn(2, 3, 4, 8)[..., ::2], _t()),
    "broadcast": lambda: (torch.randn(1, 3, 4, 1).expand(2, 3, 4, 4), _t()),
    "channels-last": lambda: (torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last), _t()),
}


def _check_kind(kind: str, x: torch.Tensor, t: torch.Tensor) -> None:
    """The tensors really are of their kind (a helper that fixed them up would test nothing)."""
    if kind == "0-d":
        assert t.dim() == 0
    elif kind == "empty":
        assert x.numel() == 0
    elif kind == "non-contiguous":
        assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    elif kind == "broadcast":
        assert 0 in x.stride()
    elif kind == "channels-last":
        assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_marshalling(backend_name: str, kind: str) -> None:
    if backend_name in ("onnxruntime", "openvino"):
        pytest.importorskip(backend_name)
        pytest.importorskip("onnxscript")
    backend = BACKENDS[backend_name]()
    block = Block().eval()
    # Exact shapes: the layout promise is about a build for one signature (a shape family's Inductor build uses
    # automatic dynamic shapes, whose first graph may already be symbolic after other compiles of this code).
    config = TuningConfig(strategy=OneBackend(backend), progress=False, warmup=1, repeats=1, shapes="exact")
    recorded = KINDS[kind]()
    _check_kind(kind, *recorded)
    graphs_before = _compiled_graphs()
    with register({"block": block}, config) as reg, torch.no_grad():
        target = reg.targets["block"]
        block(*recorded)
        reg.tune()
        block(*recorded)  # tunes, then serves this call
        x, t = KINDS[kind]()  # fresh values, same kind
        _check_kind(kind, x, t)
        got = block(x, t)
        expected = Block.forward(block, x, t)
        report = reg.report().modules["block"]
        assert target.state is TargetState.TUNED, report.reason
        assert target.calls_served.get(backend.describe()) == 2, target.calls_served
        if backend_name == "inductor":  # recorded calls keep their layout: built for it, no recompile when served
            graphs = _compiled_graphs() - graphs_before
            assert graphs == 1, f"{graphs} graphs compiled for one layout"
    torch.testing.assert_close(got, expected, **TOL)  # values, shapes (0-d stays 0-d) and dtypes
    assert got[1].shape == t.shape


def _compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process (it counts each new graph once)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
