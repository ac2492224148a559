"""Recording, tuning, choosing, falling back, re-tuning: the target state machine with real backends."""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from aitune_hf import FirstWins, MinLatency, OneBackend, TargetState, TuningConfig, hardware, register
from aitune_hf.backends import OnnxRuntimeBackend
from aitune_hf.backends.base import Backend, BuiltBackend, Call
from aitune_hf.core import signature_of
from aitune_hf.core.report import ModuleReport, TuningReport
from aitune_hf.core.signature import register_object_sized
from aitune_hf.core.strategy_base import build_cost, cheap_first
from aitune_hf.core.timing import Stopwatch, clock
from aitune_hf.errors import ConfigError
from tests.core.modules import (
    FailsWhenServingBackend,
    InfBackend,
    InterruptingBackend,
    ManyOpsBlock,
    MLPBlock,
    NaNBackend,
    PytreeBlock,
    RaisingBackend,
    WrongAtBatchThree,
    WrongStructureBackend,
    WrongValuesBackend,
    pytree_call,
)

QUICK = {"progress": False, "warmup": 1, "repeats": 3, "anytime": False}


def _config(**overrides: object) -> TuningConfig:
    return TuningConfig(**{**QUICK, **overrides})


def _tune_once(module: torch.nn.Module, config: TuningConfig, *args: object, **kwargs: object):
    """Register, record one call, arm, and make the tuning call; returns (registration, output, eager)."""
    with torch.no_grad():
        expected = module(*args, **kwargs)
        reg = register({"block": module}, config)
        module(*args, **kwargs)
        reg.tune()
        output = module(*args, **kwargs)
    return reg, output, expected


def test_recording_groups_calls_by_signature_and_runs_eager() -> None:
    block = PytreeBlock().eval()
    args, kwargs = pytree_call()
    expected = block(*args, **kwargs)
    with register({"block": block}, _config(backends=[])) as reg:
        target = reg.targets["block"]
        out = block(*args, **kwargs)
        block(*pytree_call(seed=1)[0], **pytree_call(seed=1)[1])  # same signature, other values
        block(*args, **{**kwargs, "gain": 3.0})  # a scalar's value is part of the signature
        block(args[0][:1], (args[1][0][:1], args[1][1][:1]))  # other shapes, keyword-less
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert target.state is TargetState.RECORDING
        assert target.calls_recorded == 4
        assert sorted(len(s) for s in target.samples.values()) == [1, 1, 2]
        sample = next(iter(target.samples.values()))[0]
        assert sample.kwargs["extras"]["shift"] is not kwargs["extras"]["shift"]  # captured copies
        assert signature_of(args, kwargs) != signature_of(args, {**kwargs, "gain": 3.0})


def test_an_object_sized_argument_leaves_its_size_out_only_in_calls_that_hold_an_object() -> None:
    """`register_object_sized` (Transformers' 2D attention mask, as long as the KV cache plus the call's tokens): in a
    call that holds an object its registered dimension is out of the signature, as the object's own sizes are; in a
    call of tensors only every size counts, and its other dimensions (the batch) count either way."""

    class Held:  # an object leaf, as a KV cache is
        pass

    register_object_sized("sized_by_the_object", -1)
    x = torch.zeros(2, 3)
    short, long = torch.zeros(2, 5), torch.zeros(2, 9)
    held = [signature_of((x,), {"cache": Held(), "sized_by_the_object": mask}) for mask in (short, long)]
    assert held[0] == held[1] and "float32[2x*]@cpu" in held[0].short()
    assert held[0] != signature_of((x,), {"cache": Held(), "sized_by_the_object": torch.zeros(3, 5)})  # the batch
    plain = [signature_of((x,), {"sized_by_the_object": mask}) for mask in (short, long)]
    assert plain[0] != plain[1] and "float32[2x5]@cpu" in plain[0].short()


def test_keyword_only_calls_are_captured() -> None:
    block = MLPBlock().eval()
    x = torch.randn(2, 32)
    with register([block], _config(backends=[])) as reg:
        block(x=x, scale=0.5)
        sample = next(iter(reg.targets["0"].samples.values()))[0]
        assert sample.args == () and set(sample.kwargs) == {"x", "scale"}


def test_onnxruntime_faster_than_eager_is_chosen() -> None:
    block = ManyOpsBlock().eval()
    x = torch.randn(1, 16)
    reg, out, expected = _tune_once(block, _config(backends=["onnxruntime"], repeats=7), x)
    report = reg.reports["block"]
    assert reg.targets["block"].state is TargetState.TUNED and reg.all_tuned
    assert report.backend == "onnxruntime" and report.speedup > 1.05
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert reg.targets["block"].calls_served["onnxruntime"] == 1
    with torch.no_grad():
        block(x)
    assert reg.targets["block"].calls_served["onnxruntime"] == 2
    reg.detach()


def test_onnxruntime_round_trips_pytrees_kwargs_and_none() -> None:
    block = PytreeBlock().eval()
    args, kwargs = pytree_call()
    reg, out, expected = _tune_once(block, _config(strategy=OneBackend("onnxruntime")), *args, **kwargs)
    assert reg.targets["block"].state is TargetState.TUNED
    assert isinstance(out, tuple) and out[1] is None and set(out[0]) == {"hidden", "double"}
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    reg.detach()


@pytest.mark.parametrize(
    ("backend", "reason"),
    [
        (RaisingBackend(), "raising: RuntimeError: this backend always fails to build"),
        (NaNBackend(), "non-finite"),
        (InfBackend(), "non-finite"),
        (WrongValuesBackend(), "differs from eager by up to 0.5"),
        (WrongStructureBackend(), "output structure differs"),
    ],
)
def test_a_failing_or_wrong_backend_never_serves(backend: object, reason: str) -> None:
    block = MLPBlock().eval()
    x = torch.randn(2, 32)
    reg, out, expected = _tune_once(block, _config(backends=[backend], min_speedup=0), x)
    target = reg.targets["block"]
    assert target.state is TargetState.EAGER
    assert "every candidate failed" in target.reason and reason in target.reason
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert set(target.calls_served) == {"eager"}
    reg.detach()


def test_one_backend_surfaces_its_error_and_leaves_the_target_working() -> None:
    block = MLPBlock().eval()
    x = torch.randn(2, 32)
    with torch.no_grad():
        expected = block(x)
    reg = register({"block": block}, _config(strategy=OneBackend(RaisingBackend())))
    reg.tune()
    with torch.no_grad():  # contained: the user's call gets the eager output, the report says why
        torch.testing.assert_close(block(x), expected, rtol=0, atol=0)
    assert reg.targets["block"].state is TargetState.EAGER
    assert "OneBackend('raising') cannot serve this target" in reg.targets["block"].reason
    with torch.no_grad():
        torch.testing.assert_close(block(x), expected, rtol=0, atol=0)
    reg.detach()


def test_first_wins_takes_the_first_correct_candidate() -> None:
    block = ManyOpsBlock().eval()
    config = _config(
        backends=[RaisingBackend(), "onnxruntime", WrongValuesBackend()], strategy=FirstWins(), min_speedup=0
    )
    reg, out, expected = _tune_once(block, config, torch.randn(1, 16))
    report = reg.reports["block"].signatures[0]
    assert report.chosen == "onnxruntime"
    assert [c.backend for c in report.candidates] == ["raising", "onnxruntime"]  # stopped at the winner
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    reg.detach()


def test_nothing_faster_keeps_eager_with_the_reason() -> None:
    block = MLPBlock().eval()
    reg, out, expected = _tune_once(block, _config(backends=["onnxruntime"], min_speedup=1000), torch.randn(2, 32))
    target = reg.targets["block"]
    assert target.state is TargetState.EAGER
    assert "nothing was faster: best onnxruntime" in target.reason and "needs 1000.00x" in target.reason
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    reg.detach()


def test_a_target_called_back_to_back_is_timed_in_warm_turns_and_one_among_siblings_is_not() -> None:
    first, second = MLPBlock().eval(), MLPBlock().eval()
    x = torch.randn(2, 32)
    with torch.no_grad(), register({"first": first, "second": second}, _config(backends=["onnxruntime"])) as reg:
        for _ in range(3):  # the first three times in a row (a decode step's pattern), then the two in turns
            first(x)
        for _ in range(2):
            first(second(x))
        targets = reg.targets
        assert (targets["first"].calls_seen, targets["first"].calls_back_to_back) == (5, 2)
        assert targets["first"].back_to_back is False  # 2 of 5: mostly among its sibling's calls
        for _ in range(4):
            first(x)
        assert targets["first"].back_to_back and not targets["second"].back_to_back
        reg.tune()
        first(x), second(x)
        reports = reg.report().modules
        assert [s.back_to_back for s in reports["first"].signatures] == [True]
        assert [s.back_to_back for s in reports["second"].signatures] == [False]
        # Each decision knows the calls its signature had when it tuned (the row's weights): ten, and three.
        assert [s.calls for s in reports["first"].signatures] == [10]
        assert [s.calls for s in reports["second"].signatures] == [3]
        assert "timed back to back (their calls follow each other, so each candidate's turn starts warm): first" in (
            str(reg.report())
        )


def test_unavailable_candidates_are_reported() -> None:
    from tests.core.modules import CudaOnlyBackend

    block = MLPBlock().eval()
    reg, _, _ = _tune_once(block, _config(backends=[CudaOnlyBackend()]), torch.randn(2, 32))
    assert (
        "no candidate backend is available: cuda_only: unavailable: needs a CUDA device" in reg.targets["block"].reason
    )
    reg.detach()


def test_after_calls_trigger_tunes_without_tune(caplog: pytest.LogCaptureFixture) -> None:
    block = ManyOpsBlock().eval()
    x = torch.randn(1, 16)
    caplog.set_level("INFO", logger="aitune_hf")
    with (
        register({"block": block}, _config(backends=["onnxruntime"], trigger="after_calls=2", min_speedup=0)) as reg,
        torch.no_grad(),
    ):
        target = reg.targets["block"]
        block(x)
        assert target.state is TargetState.RECORDING and not target.armed
        block(x)
        assert target.armed
        block(x)
        assert target.state is TargetState.TUNED
    # A tuning slows the call it lands in: INFO says which target, why now, and how long it took.
    messages = [record.getMessage() for record in caplog.records if record.name.startswith("aitune_hf")]
    assert "block: tuning 1 input signature(s) now, in this call: 2 calls recorded (trigger after_calls=2)" in messages
    assert any(m.startswith("block: tuning took ") and m.endswith(" s") for m in messages), messages


def test_exact_shapes_a_new_signature_after_tuning_runs_eager_and_is_covered_by_the_next_tune() -> None:
    block = ManyOpsBlock().eval()
    small, large = torch.randn(1, 16), torch.randn(3, 16)
    reg, _, _ = _tune_once(block, _config(backends=["onnxruntime"], min_speedup=0, shapes="exact"), small)
    target = reg.targets["block"]
    with torch.no_grad():
        expected = ManyOpsBlock.forward(block, large)
        torch.testing.assert_close(block(large), expected, rtol=0, atol=0)  # the small engine never sees it
        assert target.calls_served == {"onnxruntime": 1, "eager": 2}
        assert len(target.samples) == 1
        reg.tune()
        torch.testing.assert_close(block(large), expected, atol=1e-5, rtol=1e-5)
    assert len(reg.reports["block"].signatures) == 2
    assert target.calls_served["onnxruntime"] == 2
    reg.detach()


def test_a_shape_family_is_one_polymorphic_build_checked_once_per_new_shape() -> None:
    block = ManyOpsBlock().eval()
    recorded = [torch.randn(batch, 16) for batch in (2, 5, 5)]
    with torch.no_grad(), register({"block": block}, _config(backends=["onnxruntime"], min_speedup=0)) as reg:
        target = reg.targets["block"]
        for x in recorded:
            block(x)
        reg.tune()
        block(recorded[0])
        report = reg.reports["block"].signatures
        assert len(report) == 1 and report[0].chosen == "onnxruntime"
        assert report[0].signature == "float32[2..5x16]@cpu (2 shapes)"
        assert report[0].samples == 4  # the tuning call is recorded too
        assert target.report().routes == 1
        new = torch.randn(9, 16)
        expected = ManyOpsBlock.forward(block, new)
        before = dict(target.calls_served)
        torch.testing.assert_close(block(new), expected, rtol=0, atol=0)  # the check call returns eager's output
        assert target.calls_served["eager"] == before.get("eager", 0) + 1
        torch.testing.assert_close(block(new), expected, atol=1e-5, rtol=1e-5)  # then the build serves it
        assert target.calls_served["onnxruntime"] == before["onnxruntime"] + 1
        assert not target.samples  # served, never recorded
        signature = reg.reports["block"].signatures[0]
        assert signature.shapes == 3 and signature.shape_checks == 1 and signature.shape_check_seconds > 0
        assert "serves 3 shapes (1 new shape(s) checked once" in str(reg.report())
        other_width = torch.randn(4, 8)  # not the family's dims: recorded, never offered to the build
        with pytest.raises(RuntimeError):
            block(other_width)
        assert target.report().routes == 1


def test_with_anytime_a_shape_recorded_again_and_again_is_built_for_itself_and_its_next_shape_tunes_a_family() -> None:
    """Anytime tuning (the default): a family never tuned whose recorded calls all had one shape, repeated (a denoising
    loop's block), is built for that shape (an export with its shapes fixed: a third to a half of a family export's
    seconds); its next new shape runs eager, is recorded and is tuned as a family, which then serves every later shape
    after one check. A weight edit sends it to eager in the new state, as any route. A shape recorded once before the
    call that tunes is built for its family at once. Every call equals eager."""
    block = ManyOpsBlock().eval()
    config = _config(backends=["onnxruntime"], min_speedup=0, anytime=True)
    fixed, first, third = torch.randn(2, 16), torch.randn(5, 16), torch.randn(9, 16)
    with torch.no_grad(), register({"block": block}, config) as reg:
        target = reg.targets["block"]
        for _ in range(2):
            block(fixed)
        reg.tune()
        torch.testing.assert_close(block(fixed), ManyOpsBlock.forward(block, fixed), atol=1e-5, rtol=1e-5)  # tunes
        assert reg.wait(timeout=60)
        (route,) = target.routes
        assert route.built is not None and route.built.dynamic_dims is None  # built for its one shape
        assert reg.reports["block"].signatures[0].signature == "float32[2x16]@cpu"
        expected = ManyOpsBlock.forward(block, first)
        torch.testing.assert_close(block(first), expected, rtol=0, atol=0)  # eager, recorded
        assert list(target.samples) and target.calls_served.get("onnxruntime", 0) == 1
        reg.tune()
        torch.testing.assert_close(block(first), expected, atol=1e-5, rtol=1e-5)  # tunes the family, serves
        assert reg.wait(timeout=60)
        family = [r for r in target.routes if r.built is not None and r.built.dynamic_dims is not None]
        assert len(family) == 1, target.routes
        served = target.calls_served["onnxruntime"]
        expected = ManyOpsBlock.forward(block, third)
        torch.testing.assert_close(block(third), expected, rtol=0, atol=0)  # checked once against eager
        torch.testing.assert_close(block(third), expected, atol=1e-5, rtol=1e-5)
        assert target.calls_served["onnxruntime"] == served + 1 and not target.samples
        # A weight edit is seen by the route built for its one shape as by any: eager in the new state at once.
        served = target.calls_served["onnxruntime"]
        block.weight.data.add_(0.01)  # bumps no version counter: seen by value
        torch.testing.assert_close(block(fixed), ManyOpsBlock.forward(block, fixed), rtol=0, atol=0)
        assert target.calls_served["onnxruntime"] == served
    # Recorded once before the call that tunes: built for its family at once.
    block = ManyOpsBlock().eval()
    with torch.no_grad(), register({"block": block}, config) as reg:
        block(fixed)
        reg.tune()
        block(fixed)
        assert reg.wait(timeout=60)
        (route,) = reg.targets["block"].routes
        assert route.built is not None and route.built.dynamic_dims is not None


def test_eager_kept_for_a_family_holds_for_its_new_shapes_without_recording_them() -> None:
    block = ManyOpsBlock().eval()
    with torch.no_grad(), register({"block": block}, _config(backends=["onnxruntime"], min_speedup=1e6)) as reg:
        target = reg.targets["block"]
        block(torch.randn(2, 16))
        reg.tune()
        block(torch.randn(2, 16))
        assert target.state is TargetState.EAGER and "nothing was faster" in target.reason
        x = torch.randn(7, 16)
        torch.testing.assert_close(block(x), ManyOpsBlock.forward(block, x), rtol=0, atol=0)
        assert not target.samples and target.report().routes == 1  # no new tuning waits for it
        assert reg.reports["block"].signatures[0].shape_checks == 0


def test_a_new_shape_that_the_build_gets_wrong_runs_eager_for_good() -> None:
    block = MLPBlock().eval()
    with torch.no_grad(), register({"block": block}, _config(backends=[WrongAtBatchThree()], min_speedup=0)) as reg:
        target = reg.targets["block"]
        block(torch.randn(2, 32))
        reg.tune()
        block(torch.randn(2, 32))
        x = torch.randn(3, 32)
        for _ in range(3):
            torch.testing.assert_close(block(x), MLPBlock.forward(block, x), rtol=0, atol=0)
        signature = reg.reports["block"].signatures[0]
        assert signature.shape_checks == 1 and "wrong output" in signature.shapes_rejected[0]
        assert len(target.samples) == 1  # recorded for a later tune()
        assert "1 new shape(s) run eager, their check failed" in str(reg.report())


def test_changed_weights_send_a_baking_backend_back_to_eager_then_it_retunes() -> None:
    block = ManyOpsBlock().eval()
    x = torch.randn(1, 16)
    reg, _, _ = _tune_once(block, _config(backends=[OnnxRuntimeBackend(weights="baked")], min_speedup=0), x)
    target = reg.targets["block"]
    block.load_state_dict({k: v * 0.5 for k, v in block.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(block(x), ManyOpsBlock.forward(block, x), rtol=0, atol=0)  # eager at once
        assert target.state is TargetState.ARMED and "weight weight was modified" in target.report().changes[-1]
        torch.testing.assert_close(block(x), ManyOpsBlock.forward(block, x), atol=1e-5, rtol=1e-5)  # re-tuned
        assert target.state is TargetState.TUNED and target.report().routes == 2
        served = target.calls_served["onnxruntime"]
        block.weight.data.add_(0.01)  # bumps no version counter: seen by value
        torch.testing.assert_close(block(x), ManyOpsBlock.forward(block, x), rtol=0, atol=0)
        assert target.calls_served["onnxruntime"] == served
    reg.detach()


def test_live_weights_serve_every_edit_without_a_rebuild() -> None:
    block = ManyOpsBlock().eval()
    x = torch.randn(1, 16)
    reg, _, _ = _tune_once(block, _config(backends=[OnnxRuntimeBackend(weights="live")], min_speedup=0), x)
    target = reg.targets["block"]
    with torch.no_grad():
        for edit in (
            lambda: block.load_state_dict({k: v * 0.5 for k, v in block.state_dict().items()}),
            lambda: block.weight.data.add_(0.01),
            lambda: setattr(block.weight, "data", block.weight.data * 1.5),
        ):
            edit()
            torch.testing.assert_close(block(x), ManyOpsBlock.forward(block, x), atol=1e-5, rtol=1e-5)
    assert target.state is TargetState.TUNED and target.report().routes == 1
    assert target.calls_served == {"eager": 1, "onnxruntime(weights=live)": 4}  # the recording call, then served
    reg.detach()


def test_a_backend_failing_while_serving_falls_back_to_eager() -> None:
    block = MLPBlock().eval()
    x = torch.randn(2, 32)
    # two samples (the recorded call and the tuning call) each checked once; one call per shape warmed up and
    # timed; then served once
    backend = FailsWhenServingBackend(ok_calls=2 + QUICK["warmup"] + QUICK["repeats"] + 1)
    reg, _, expected = _tune_once(block, _config(backends=[backend], min_speedup=0), x)
    target = reg.targets["block"]
    assert target.state is TargetState.TUNED
    with torch.no_grad():
        torch.testing.assert_close(block(x), expected, rtol=0, atol=0)
    assert target.state is TargetState.EAGER and "raised while serving: RuntimeError: engine lost" in target.reason
    reg.detach()


def test_a_backend_failing_while_timed_is_dropped() -> None:
    block = MLPBlock().eval()
    reg, out, expected = _tune_once(
        block, _config(backends=[FailsWhenServingBackend(ok_calls=3)], min_speedup=0), torch.randn(2, 32)
    )
    target = reg.targets["block"]
    assert target.state is TargetState.EAGER
    assert "failed while timed: RuntimeError: engine lost" in target.reason
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    reg.detach()


def test_an_interrupted_tuning_leaves_a_working_target() -> None:
    block = MLPBlock().eval()
    x = torch.randn(2, 32)
    with torch.no_grad():
        expected = block(x)
    reg = register({"block": block}, _config(backends=[InterruptingBackend()]))
    reg.tune()
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        block(x)
    target = reg.targets["block"]
    assert target.state is TargetState.RECORDING and "interrupted" in target.reason
    with torch.no_grad():
        torch.testing.assert_close(block(x), expected, rtol=0, atol=0)
    assert reg._context.progress._bar is None  # the progress bar was closed
    reg.detach()


def test_calls_with_autograd_only_consider_autograd_capable_backends() -> None:
    block = ManyOpsBlock().eval()
    x = torch.randn(1, 16)
    with register({"block": block}, _config(backends=["onnxruntime"])) as reg:
        block(x)
        reg.tune()
        out = block(x)
        assert out.requires_grad  # still differentiable: eager served it
        assert "cannot backpropagate" in reg.targets["block"].reason


def test_sample_memory_is_capped_across_signatures_keeping_the_latest_calls() -> None:
    block = MLPBlock().eval()
    cap = 2 * 32 * 4 * 2  # two calls of batch 2
    config = _config(backends=[], max_sample_bytes=cap, max_samples_per_signature=10)
    with register({"block": block}, config) as reg, torch.no_grad():
        for batch in (2, 2, 2, 3):
            block(torch.randn(batch, 32))
        target = reg.targets["block"]
        assert target.calls_recorded == 4 and target.sample_bytes <= cap
        assert [sig.tensor_specs[0].shape for sig in target.samples] == [(3, 32)]  # the latest call is kept
        block(torch.randn(200, 32))  # larger than the cap on its own: not recorded
        assert target.sample_bytes <= cap and len(target.samples) == 1


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_thousand_calls_of_changing_shapes_stay_within_the_bounds() -> None:
    block = MLPBlock().eval()
    cap, signatures = 64 * 1024, 16
    config = _config(backends=[], max_sample_bytes=cap, max_signatures=signatures)
    with register({"block": block}, config) as reg, torch.no_grad():
        target = reg.targets["block"]
        rss = []
        for i in range(1000):
            block(torch.randn(1 + i % 50, 32))  # 50 shapes, up to 6.4 KB a call
            assert target.sample_bytes <= cap
            if i in (199, 999):
                rss.append(_rss_bytes())
        assert len(target.samples) <= signatures
        assert target.report().signatures_over_limit == 1000 - 20 * signatures  # shapes 17-50 are not kept
        assert "beyond max_signatures ran eager" in str(reg.report())
        assert rss[1] - rss[0] < 16 * 2**20  # flat: within 16 MiB between call 200 and call 1000


def test_identical_siblings_share_one_decision() -> None:
    blocks = torch.nn.ModuleList([ManyOpsBlock() for _ in range(3)]).eval()
    x = torch.randn(1, 16)
    with register({"blocks": blocks}, _config(backends=["onnxruntime"], min_speedup=0)) as reg, torch.no_grad():
        expected = [ManyOpsBlock.forward(b, x) for b in blocks]
        for b in blocks:
            b(x)
        reg.tune()
        outputs = [b(x) for b in blocks]
        reports = reg.reports
    assert [r.signatures[0].shared_from for r in reports.values()] == [None, "blocks.0", "blocks.0"]
    assert all(r.backend == "onnxruntime" for r in reports.values())
    for out, ref in zip(outputs, expected, strict=True):  # each sibling has its own weights baked in
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


class ScaledByAGlobal(nn.Module):
    """Scales by a module-level factor that no guard sees: an export bakes the value it read while tracing."""

    factor = [2.0]

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * ScaledByAGlobal.factor[0]


def test_a_module_like_one_tuned_before_reuses_its_export_and_one_that_disagrees_is_exported_afresh() -> None:
    """A module in the same guarded state as one tuned before in this process (a second pipeline, a re-tuning) gets
    that export with its own weights; when it disagrees with eager (the first traced another value of what no guard
    sees), it never serves: the candidate is built again afresh, and that build serves."""
    x = torch.randn(4, 16)
    config = _config(backends=["onnxruntime"], min_speedup=0)
    seen = []
    try:
        for factor in (2.0, 2.0, 3.0):
            ScaledByAGlobal.factor[0] = factor
            reg, output, expected = _tune_once(ScaledByAGlobal().eval(), config, x)  # new weights each time
            torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
            report = reg.reports["block"]
            (candidate,) = report.signatures[0].candidates
            seen.append((report.backend, candidate.reused, candidate.error))
            reg.detach()
    finally:
        ScaledByAGlobal.factor[0] = 2.0
    assert seen == [("onnxruntime", False, None), ("onnxruntime", True, None), ("onnxruntime", False, None)]


def test_report_table_json_and_html() -> None:
    block = ManyOpsBlock().eval()
    reg, _, _ = _tune_once(
        block, _config(backends=["onnxruntime", RaisingBackend()], min_speedup=0), torch.randn(1, 16)
    )
    report = reg.report()
    text = str(report)
    assert "block" in text and "ManyOpsBlock" in text and "onnxruntime" in text and "speed-up" in text
    data = json.loads(report.to_json())
    module = data["modules"]["block"]
    assert module["backend"] == "onnxruntime" and module["state"] == "tuned"
    candidates = {c["backend"]: c for c in module["signatures"][0]["candidates"]}
    assert candidates["raising"]["error"].startswith("RuntimeError")
    assert candidates["onnxruntime"]["build_seconds"] > 0 and candidates["onnxruntime"]["latency_s"] > 0
    assert module["signatures"][0]["signature"] == "float32[1x16]@cpu"
    html = report._repr_html_()
    assert "<table>" in html and "ManyOpsBlock" in html
    reg.detach()


def test_onnxruntime_artifacts_go_to_the_given_folder(tmp_path: object) -> None:
    block = ManyOpsBlock(depth=4).eval()
    backend = OnnxRuntimeBackend(artifact_dir=tmp_path, intra_op_num_threads=1)
    reg, out, expected = _tune_once(block, _config(strategy=OneBackend(backend)), torch.randn(1, 16))
    assert len(list(tmp_path.glob("*.onnx"))) == 1  # type: ignore[attr-defined]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    reg.detach()


def test_moved_weights_with_equal_values_keep_serving_but_reassigned_data_does_not() -> None:
    block = ManyOpsBlock().eval()
    x = torch.randn(1, 16)
    reg, _, _ = _tune_once(block, _config(backends=[OnnxRuntimeBackend(weights="baked")], min_speedup=0), x)
    target = reg.targets["block"]
    with torch.no_grad():
        block.weight.data = block.weight.data.clone()  # what an offload hook's copy does: same values
        block(x)
        assert target.state is TargetState.TUNED and target.calls_served["onnxruntime"] == 2
        block.weight.data = block.weight.data * 1.5  # what fusing a LoRA into .data does
        torch.testing.assert_close(block(x), ManyOpsBlock.forward(block, x), rtol=0, atol=0)
    assert target.state is TargetState.ARMED and "weight weight was modified" in target.report().changes[-1]
    reg.detach()


def test_restricted_targets_report_the_restriction() -> None:
    block = ManyOpsBlock().eval()
    x = torch.randn(1, 16)
    with register({"block": block}, _config(backends=["onnxruntime"])) as reg, torch.no_grad():
        reg.targets["block"].restrict(lambda backend: not backend.bakes_weights, "an offload hook moves the weights")
        block(x)
        reg.tune()
        block(x)
        assert "onnxruntime: unavailable: an offload hook moves the weights" in reg.targets["block"].reason


def test_bypass_runs_the_original_forward_and_records_nothing() -> None:
    block = ManyOpsBlock().eval()
    x = torch.randn(1, 16)
    reg, _, _ = _tune_once(block, _config(backends=["onnxruntime"], min_speedup=0), x)
    target = reg.targets["block"]
    served = dict(target.calls_served)
    with reg.bypass(), torch.no_grad():
        assert reg.bypassed
        torch.testing.assert_close(block(x), ManyOpsBlock.forward(block, x), rtol=0, atol=0)
        block(torch.randn(4, 16))
    assert target.calls_served == served and not target.samples and not reg.bypassed
    reg.detach()


def test_detach_releases_built_backends_and_sessions() -> None:
    import gc
    import weakref

    block = ManyOpsBlock().eval()
    reg, _, _ = _tune_once(block, _config(backends=["onnxruntime"], min_speedup=0), torch.randn(1, 16))
    route = next(iter(reg.targets["block"]._routes.values()))[0]
    runner = weakref.ref(route.built.fn)
    session = weakref.ref(route.built.fn.session)
    guard = weakref.ref(route.guard)
    del route
    reg.detach()
    gc.collect()
    assert runner() is None and session() is None and guard() is None


# -- cost-aware tuning: cheap builds first, skipped slow builds, a budget, the seconds split ----------------------


class PretendCompiler(Backend):
    """Stands for a compiler whose builds are slow (Inductor, TensorRT): serves eager's forward."""

    name = "pretend_compiler"
    build_cost = "slow"

    def build(self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        return BuiltBackend(fn=forward)


class BusyBuild(Backend):
    """A build that does `seconds` of real work (no sleep), then serves eager's forward."""

    name = "busy_build"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def build(self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        a = torch.randn(64, 64)
        with Stopwatch() as watch:
            while clock() - watch.start < self.seconds:
                a = torch.tanh(a @ a)
        return BuiltBackend(fn=forward)


def test_cheap_builds_are_tried_first_and_the_order_given_is_kept_within_a_cost() -> None:
    from aitune_hf.backends import get_backend

    backends = [get_backend(name) for name in ("inductor", "onnxruntime")] + [PretendCompiler(), RaisingBackend()]
    assert [b.name for b in cheap_first(backends)] == ["onnxruntime", "raising", "inductor", "pretend_compiler"]
    assert build_cost(get_backend("inductor")) == "slow" and build_cost(RaisingBackend()) == "cheap"
    assert [b.name for b in FirstWins(order="given").ordered(backends)] == [b.name for b in backends]
    # ONNX Runtime's int8 quantizes the whole graph (8-21 s a whole MiniLM): after OpenVINO's int8 in its precision tier
    int8 = [get_backend(name).with_precision("int8") for name in ("onnxruntime", "openvino")]
    assert [build_cost(b) for b in int8] == ["slow", "cheap"] and build_cost(get_backend("onnxruntime")) == "cheap"
    assert [b.describe() for b in cheap_first(int8)] == [int8[1].describe(), int8[0].describe()]
    with pytest.raises(ConfigError, match="order"):
        MinLatency(order="fastest")
    assert repr(MinLatency()) == "MinLatency()" and repr(FirstWins()) == "FirstWins()"  # cache keys stay put


def test_a_clear_cheap_winner_skips_the_slow_build() -> None:
    block = ManyOpsBlock().eval()  # ONNX Runtime runs it several times faster than eager
    config = _config(backends=[PretendCompiler(), "onnxruntime"], repeats=25)
    reg, out, expected = _tune_once(block, config, torch.randn(1, 16))
    signature = reg.reports["block"].signatures[0]
    candidates = {c.backend: c for c in signature.candidates}
    assert [c.backend for c in signature.candidates] == ["onnxruntime", "pretend_compiler"]  # cheap first
    assert signature.chosen == "onnxruntime"
    assert candidates["pretend_compiler"].error.startswith("skipped: onnxruntime won clearly (at least ")
    assert candidates["pretend_compiler"].error.endswith("and pretend_compiler builds slowly")
    assert candidates["pretend_compiler"].build_seconds is None
    assert candidates["onnxruntime"].rounds < 25  # the sequential rule stopped: the ratio was decided
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    reg.detach()


def test_without_a_clear_cheap_winner_the_slow_build_is_tried() -> None:
    block = MLPBlock().eval()
    config = _config(backends=[PretendCompiler(), WrongValuesBackend()], min_speedup=0, repeats=25)
    reg, out, expected = _tune_once(block, config, torch.randn(2, 32))
    candidates = {c.backend: c for c in reg.reports["block"].signatures[0].candidates}
    assert candidates["wrong_values"].error.startswith("wrong output")
    assert candidates["pretend_compiler"].ok and candidates["pretend_compiler"].build_seconds is not None
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # it serves eager's own forward
    reg.detach()


def test_skip_slow_builds_false_builds_every_candidate() -> None:
    block = ManyOpsBlock().eval()
    config = _config(backends=[PretendCompiler(), "onnxruntime"], strategy=MinLatency(skip_slow_builds=False))
    reg, out, expected = _tune_once(block, config, torch.randn(1, 16))
    candidates = reg.reports["block"].signatures[0].candidates
    assert all(c.ok and c.latency_s is not None for c in candidates)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    reg.detach()


def test_a_spent_budget_skips_the_remaining_candidates_with_the_reason() -> None:
    block = MLPBlock().eval()
    config = _config(backends=[BusyBuild(0.5), "onnxruntime", PretendCompiler()], budget_s=0.25, min_speedup=0)
    reg, out, expected = _tune_once(block, config, torch.randn(2, 32))
    signature = reg.reports["block"].signatures[0]
    candidates = {c.backend: c for c in signature.candidates}
    assert candidates["busy_build"].ok and candidates["busy_build"].build_seconds >= 0.5
    assert candidates["onnxruntime"].error == "skipped: tuning budget of 0.25 s spent"
    assert candidates["pretend_compiler"].error == "skipped: tuning budget of 0.25 s spent"
    assert candidates["busy_build"].rounds == 1  # timing stops at the first round past the deadline
    assert signature.chosen == "busy_build"
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    reg.detach()


class SlowLoser(Backend):
    """A slow build that serves eager's forward run `runs` times (2: about half eager's speed), always correct; counts
    its builds."""

    name = "slow_loser"
    build_cost = "slow"
    runs = 2

    def build(self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        self.builds = getattr(self, "builds", 0) + 1
        runs = self.runs

        def repeated(*args: Any, **kwargs: Any) -> Any:
            for _ in range(runs - 1):
                forward(*args, **kwargs)
            return forward(*args, **kwargs)

        return BuiltBackend(fn=repeated)


def _tune_blocks(blocks: dict[str, torch.nn.Module], config: TuningConfig, x: torch.Tensor):
    """Register `blocks` (called one after another on `x`), record a call, arm, tune; (registration, out, eager)."""

    def run() -> torch.Tensor:
        return torch.stack([block(x) for block in blocks.values()])

    with torch.no_grad():
        expected = run()
        reg = register(blocks, config)
        run()
        reg.tune()
        output = run()
    return reg, output, expected


def test_a_slow_build_that_lost_on_the_first_blocks_of_a_kind_is_not_built_for_the_rest() -> None:
    torch.manual_seed(0)
    loser = SlowLoser()
    blocks = {f"mlp{i}": MLPBlock().eval() for i in range(4)}  # one kind; unequal weights, tuned one by one
    config = _config(backends=[loser], share_identical=False, repeats=5)
    reg, out, expected = _tune_blocks(blocks, config, torch.randn(4, 32))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # eager serves every block
    assert loser.builds == 2
    for name in ("mlp0", "mlp1"):
        candidate = reg.reports[name].signatures[0].candidates[0]
        assert candidate.build_seconds is not None and candidate.speedup < 1.0
    for name in ("mlp2", "mlp3"):
        candidate = reg.reports[name].signatures[0].candidates[0]
        assert candidate.skipped_for == "evidence" and candidate.build_seconds is None
        assert candidate.error.startswith("skipped: lost on the first 2 MLPBlock blocks (mlp0: 0.")
        assert "against eager" in candidate.error
        assert reg.reports[name].signatures[0].chosen == "eager"
    reg.detach()


class CheapBf16Loser(SlowLoser):
    """A cheap bf16 build that loses by far (eager's forward run 40 times, about 40 ms a call): the evidence that bf16
    does not pay on the block. Its timing bound must fall under `min_speedup` in every round, even where eager's run is
    preempted on a loaded host (CI's xdist workers beside a Ray test): a half-speed loser on 30 us calls kept one round
    above it, was retired beaten without settling, and the slow build was made (once in a full suite run here; 2 of 12
    runs beside two busy processes)."""

    name = "cheap_bf16_loser"
    build_cost = "cheap"
    precision = "bf16"
    runs = 40


class SlowBf16(SlowLoser):
    """A slow bf16 build that loses (an Inductor bf16 compile that took 24 s to lose stands for it): eager's forward
    run eight times. Not eager's own speed (a build as fast as eager was chosen by timing noise on a loaded CI host),
    nor half of it (chosen once in 10 runs beside two busy processes, where eager's rounds were preempted)."""

    name = "slow_bf16"
    precision = "bf16"
    runs = 8


class CheapInt8Winner(CheapBf16Loser):
    """A cheap int8 build that wins clearly on a `TwiceBlock` (it runs the MLP once)."""

    name = "cheap_int8_winner"
    precision = "int8"

    def build(self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        return BuiltBackend(fn=module.mlp)


@pytest.mark.parametrize("winner", [False, True], ids=["nothing-wins", "int8-wins-clearly"])
def test_a_slow_build_of_a_precision_a_cheap_build_of_it_lost_is_not_built(winner: bool) -> None:
    """bf16 without AMX (issue 31): OpenVINO bf16 settled at 0.72x of eager on a MiniLM layer, while ONNX Runtime int8
    won clearly, and Inductor's bf16 compile of it took 24 s to lose (0.67x). A cheap build of a reduced precision
    settled below `min_speedup` skips the slow builds of that precision on the block, whether another precision won
    or not; `skip_slow_builds=False` builds them."""
    for reason in (hardware.cpu_bf16_reason(), hardware.cpu_int8_reason() if winner else None):
        if reason is not None:
            pytest.skip(f"a reduced precision is not offered here: {reason}")
    for skip, builds in ((True, 0), (False, 1)):
        slow = SlowBf16()
        backends = [CheapInt8Winner()] if winner else []
        config = _config(
            backends=[*backends, CheapBf16Loser(), slow],
            precision=["int8", "bf16"] if winner else ["bf16"],
            strategy=MinLatency(skip_slow_builds=skip),
            repeats=9,
        )
        reg, out, expected = _tune_once(TwiceBlock().eval(), config, torch.randn(4096, 32))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        signature = reg.reports["block"].signatures[0]
        assert signature.chosen == ("cheap_int8_winner" if winner else "eager"), signature
        assert getattr(slow, "builds", 0) == builds
        lost = next(c for c in signature.candidates if c.backend.startswith("slow_bf16"))
        if skip:
            assert lost.skipped_for == "evidence" and lost.build_seconds is None, lost
            assert lost.error.startswith("skipped: cheap_bf16_loser")
            assert "bf16 does not pay on this block" in lost.error
        else:
            assert lost.build_seconds is not None
        reg.detach()


class TwiceBlock(nn.Module):
    """Runs its MLP twice and keeps the second result: eager does twice the work it needs."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLPBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mlp(x)
        return self.mlp(x)


class SlowWinner(Backend):
    """A slow build that serves `TwiceBlock`'s MLP once: the same output, about twice eager's speed."""

    name = "slow_winner"
    build_cost = "slow"

    def build(self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        self.builds = getattr(self, "builds", 0) + 1
        return BuiltBackend(fn=module.mlp)


def test_a_slow_build_that_won_once_is_built_for_every_block_of_the_kind() -> None:
    winner = SlowWinner()
    blocks = {f"twice{i}": TwiceBlock().eval() for i in range(4)}
    reg, out, expected = _tune_blocks(blocks, _config(backends=[winner], share_identical=False), torch.randn(64, 32))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert winner.builds == 4  # it won on one of the first two (at least): built for every block
    chosen = [reg.reports[name].signatures[0].chosen for name in blocks]
    assert "slow_winner" in chosen[:2] and set(chosen) <= {"slow_winner", "eager"}
    reg.detach()


def test_prune_slow_after_zero_builds_the_slow_candidate_for_every_block() -> None:
    loser = SlowLoser()
    blocks = {f"mlp{i}": MLPBlock().eval() for i in range(3)}
    config = _config(backends=[loser], share_identical=False, strategy=MinLatency(prune_slow_after=0))
    reg, out, expected = _tune_blocks(blocks, config, torch.randn(2, 32))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert loser.builds == 3
    assert repr(MinLatency(prune_slow_after=0)) == "MinLatency(prune_slow_after=0)"
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match=r"prune_slow_after=\.\.\.\) must be an int >= 0"):
            MinLatency(prune_slow_after=bad)  # type: ignore[arg-type]
    reg.detach()


@pytest.mark.parametrize("strategy", [MinLatency(), FirstWins()])
def test_a_budget_spent_before_any_candidate_keeps_eager_with_the_reason(strategy: object) -> None:
    block = MLPBlock().eval()
    config = _config(backends=["onnxruntime"], budget_s=1e-9, strategy=strategy)
    reg, out, expected = _tune_once(block, config, torch.randn(2, 32))
    target = reg.targets["block"]
    assert target.state is TargetState.EAGER
    assert "tuning budget of 1e-09 s spent before any candidate was tried" in target.reason
    assert reg.reports["block"].signatures[0].candidates[0].error == "skipped: tuning budget of 1e-09 s spent"
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with torch.no_grad():
        x = torch.randn(2, 32)
        torch.testing.assert_close(block(x), MLPBlock.forward(block, x), rtol=0, atol=0)
    reg.detach()


def test_the_seconds_split_adds_up_to_the_targets_tuning_seconds() -> None:
    block = ManyOpsBlock().eval()
    config = _config(backends=["onnxruntime", RaisingBackend(), WrongValuesBackend(), BusyBuild(0.2)], min_speedup=0)
    reg, out, expected = _tune_once(block, config, torch.randn(1, 16))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    module = reg.reports["block"]
    split = module.seconds_split()
    assert set(split) == {"onnxruntime", "raising", "wrong_values", "busy_build", "eager"}
    assert split["busy_build"]["build_s"] >= 0.2 and split["onnxruntime"]["timing_s"] > 0
    assert split["raising"]["check_s"] == 0 and split["wrong_values"]["timing_s"] == 0  # never checked / timed
    accounted = sum(sum(phases.values()) for phases in split.values())
    assert accounted <= module.tuning_seconds
    assert module.tuning_seconds - accounted <= 0.05 * module.tuning_seconds + 0.05  # bookkeeping only
    report = reg.report()
    assert "tuning seconds: onnxruntime build " in str(report) and "eager references " in str(report)
    data = json.loads(report.to_json())
    assert data["modules"]["block"]["seconds_split"]["onnxruntime"]["build_s"] == pytest.approx(
        split["onnxruntime"]["build_s"]
    )
    candidate = data["modules"]["block"]["signatures"][0]["candidates"][0]
    assert candidate["check_seconds"] > 0 and candidate["timing_seconds"] > 0 and candidate["rounds"] == 3
    reg.detach()


def test_the_payback_line_from_the_end_to_end_measurement() -> None:
    module = ModuleReport(name="block", module_class="Block", state="tuned", tuning_seconds=10.0)
    report = TuningReport({"block": module}, end_to_end={"eager_s": 1.0, "tuned_s": 0.75, "speedup": 4 / 3})
    report.tuning_seconds = 10.0
    assert report.payback() == {"tuning_s": 10.0, "saved_per_call_s": 0.25, "calls": 40}
    assert "payback: tuning 10.0 s, saves 250.0 ms per whole call: paid off after 40 call(s)" in str(report)
    data = json.loads(report.to_json())
    assert data["end_to_end"]["payback"]["calls"] == 40
    assert "payback" not in TuningReport.from_dict(data).end_to_end  # derived, recomputed

    slower = TuningReport({"block": module}, end_to_end={"eager_s": 1.0, "tuned_s": 1.1}, tuning_seconds=5.0)
    assert slower.payback()["calls"] is None and "never pays off" in str(slower)
    assert TuningReport({"block": module}, tuning_seconds=5.0).payback() is None
    assert "payback" not in str(TuningReport({"block": module}, tuning_seconds=5.0))


class SlowCalls(nn.Module):
    """Each call takes 0.2 s (a whole model at batch 32 takes 0.5 s here): three shapes would make a timed round of
    eager alone 0.6 s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.2)
        return x * 2


class CountsShapes(Backend):
    """A polymorphic build that serves eager's forward and counts its calls by batch size."""

    name = "counts_shapes"
    polymorphic = True

    def __init__(self) -> None:
        self.calls: collections.Counter[int] = collections.Counter()

    def build(
        self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call], dynamic: bool = False
    ) -> BuiltBackend:
        def fn(x: torch.Tensor) -> torch.Tensor:
            self.calls[x.shape[0]] += 1
            return forward(x)

        return BuiltBackend(fn=fn, dynamic_dims=(frozenset({0}),) if dynamic else None)


def test_a_family_of_slow_calls_is_timed_on_its_hottest_shape_only() -> None:
    """Three shapes of a family, each call 0.2 s: past the round's eager budget (`TuningJob.TIMED_ROUND_S`) after the
    first, so candidates are timed on the hottest shape alone; every shape is still checked."""
    backend = CountsShapes()
    module = SlowCalls().eval()
    reg = register({"slow": module}, _config(backends=[backend], min_speedup=0, warmup=1, repeats=2))
    with torch.no_grad():
        for rows in (4, 4, 2, 3):  # batch 4 is the hottest
            module(torch.ones(rows, 8))
        reg.tune()
        module(torch.ones(4, 8))
    assert reg.targets["slow"].state is TargetState.TUNED, reg.report()
    assert backend.calls[2] == 1 and backend.calls[3] == 1  # checked once each, never timed
    assert backend.calls[4] >= 2 + 1 + 2  # its two checks, then the warm-up and timed rounds (and the call served)
    reg.detach()
