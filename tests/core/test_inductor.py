"""The Inductor backend through the core: one compiled graph for a stack of identical blocks; freezing."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from aitune_hf import OneBackend, TargetState, TuningConfig, register
from aitune_hf.backends import InductorBackend
from tests.core.modules import MLPBlock

DEPTH = 4


@pytest.fixture(scope="module")
def tuned_stack():
    """A stack of identical blocks tuned with Inductor once for the whole module (compiles are slow)."""
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*[MLPBlock(width=48) for _ in range(DEPTH)]).eval()
    x = torch.randn(2, 5, 48)
    with torch.no_grad():
        expected = stack(x)
    counters.clear()
    reg = register({"stack": stack}, TuningConfig(strategy=OneBackend("inductor"), progress=False, repeats=3))
    with torch.no_grad():
        stack(x)
        reg.tune()
        output = stack(x)
        again = stack(x)
    stats = {"unique_graphs": counters["stats"]["unique_graphs"], "frames_ok": counters["frames"]["ok"]}
    yield {"stack": stack, "reg": reg, "x": x, "expected": expected, "output": output, "again": again, "stats": stats}
    reg.detach()


def test_identical_blocks_compile_one_graph(tuned_stack) -> None:
    assert tuned_stack["stats"]["unique_graphs"] == 1
    assert tuned_stack["reg"].state_counts == {"tuned": DEPTH}


def test_tuned_stack_matches_eager(tuned_stack) -> None:
    torch.testing.assert_close(tuned_stack["output"], tuned_stack["expected"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tuned_stack["again"], tuned_stack["expected"], atol=1e-4, rtol=1e-4)


def test_siblings_reuse_the_first_decision(tuned_stack) -> None:
    reports = tuned_stack["reg"].reports
    assert reports["stack.0"].signatures[0].shared_from is None
    assert {r.signatures[0].shared_from for name, r in reports.items() if name != "stack.0"} == {"stack.0"}
    assert all(r.backend == "inductor" for r in reports.values())
    assert all(r.calls.get("inductor") == 2 for r in reports.values())


def test_frozen_weights_are_per_instance_and_watched() -> None:
    torch.manual_seed(1)
    pair = torch.nn.ModuleList([MLPBlock(width=16), MLPBlock(width=16)]).eval()
    x = torch.randn(3, 16)
    config = TuningConfig(strategy=OneBackend(InductorBackend(freezing=True)), progress=False, repeats=2)
    with register({"pair": pair}, config) as reg, torch.no_grad():
        for block in pair:
            block(x)
        reg.tune()
        outputs = [block(x) for block in pair]
        for block, out in zip(pair, outputs, strict=True):
            torch.testing.assert_close(out, MLPBlock.forward(block, x), atol=1e-4, rtol=1e-4)
        assert reg.state_counts == {"tuned": 2}
        pair[0].up.weight.data.mul_(2.0)  # a baked weight changes, with no version bump: eager at once
        torch.testing.assert_close(pair[0](x), MLPBlock.forward(pair[0], x), rtol=0, atol=0)
        target = reg.targets["pair.0"]
        assert target.state is TargetState.ARMED  # re-tunes on its own at the next call
        assert "up.weight was modified" in target.report().changes[-1]
        torch.testing.assert_close(pair[0](x), MLPBlock.forward(pair[0], x), atol=1e-4, rtol=1e-4)
        assert target.state is TargetState.TUNED and target.report().routes == 2
        assert target.calls_served["inductor(freezing=True)"] == 2  # the new route serves the new weights
