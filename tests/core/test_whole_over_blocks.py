"""A target kept whole over its blocks (`Registration.descend(keep=True)`, what `targets="auto"` does): the whole serves
the shape families where it beats its blocks as they serve, the blocks serve the rest, and every call equals eager.

The modules and backends here are real torch with fake builds whose speed is known by construction (nothing mocked):
`Wasteful` does redundant work around its blocks at batch 1 that only a build of the whole can skip, and each of its
`TwiceBlock`s runs its MLP twice where a block's own build runs it once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from aitune_hf import TuningConfig, register
from aitune_hf.backends.base import Backend, BuiltBackend, Call
from aitune_hf.core.target import TargetState
from aitune_hf.errors import CandidateUnavailable
from tests.core.modules import MLPBlock
from tests.quick import QUICK

WIDTH = 256  # an MLP of this width at batch 64 costs several times a router's own work per call


class TwiceBlock(nn.Module):
    """Runs its MLP twice and keeps the second result: eager does twice the work it needs."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLPBlock(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mlp(x)
        return self.mlp(x)


class Wasteful(nn.Module):
    """Two `TwiceBlock`s; at batch 1 it also computes something it drops (a stand-in for what a whole-model build
    covers and blocks cannot: embeddings, masks, the glue between layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TwiceBlock(), TwiceBlock()])
        self.register_buffer("mix", torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            waste = x
            for _ in range(300):
                waste = torch.tanh(waste @ self.mix)
        for block in self.blocks:
            x = block(x)
        return x


def _once(model: Wasteful, x: torch.Tensor) -> torch.Tensor:
    for block in model.blocks:
        x = block.mlp(x)
    return x


class OnceBlocks(Backend):
    """Builds a `TwiceBlock` as its MLP run once (twice eager's speed, the same output); nothing else."""

    name = "once_blocks"

    def build(self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        if not isinstance(module, TwiceBlock):
            raise CandidateUnavailable("builds blocks only")
        return BuiltBackend(fn=module.mlp)


class Whole(Backend):
    """Builds a `Wasteful` whole: its blocks' MLPs once each, nothing dropped (the same output). With `batch`, only
    for calls of that batch size; with `extra`, it runs one MLP more than it needs (three MLPs where eager runs four
    and its blocks, built, two); with `bakes`, it says it baked the weights (the core then checks their values)."""

    name = "whole"

    def __init__(self, batch: int | None = None, extra: bool = False, bakes: bool = False) -> None:
        self.batch, self.extra, self.bakes = batch, extra, bakes
        self.builds = 0

    def build(self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        if not isinstance(module, Wasteful):
            raise CandidateUnavailable("builds the whole model only")
        if self.batch is not None and any(args[0].shape[0] != self.batch for args, _ in samples):
            raise CandidateUnavailable(f"builds batch {self.batch} only")
        self.builds += 1
        if self.extra:
            return BuiltBackend(fn=lambda x: (module.blocks[0].mlp(x), _once(module, x))[1])
        return BuiltBackend(fn=lambda x: _once(module, x), bakes_weights=self.bakes)


def _config(**overrides: Any) -> TuningConfig:
    return TuningConfig(**{**QUICK, "shapes": "exact", "repeats": 7, **overrides})


def _unpatched(*modules: nn.Module) -> bool:
    return all("forward" not in m.__dict__ for module in modules for m in module.modules())


def _served(reg: Any) -> dict[str, dict[str, int]]:
    return {name: dict(target.calls_served) for name, target in reg.targets.items()}


def _blocks(model: Wasteful) -> dict[str, nn.Module]:
    return {f"model.blocks.{i}": block for i, block in enumerate(model.blocks)}


def test_the_whole_serves_the_family_it_wins_and_its_blocks_serve_the_others() -> None:
    torch.manual_seed(0)
    model = Wasteful().eval()
    x8, x1 = torch.randn(8, WIDTH), torch.randn(1, WIDTH)
    with torch.no_grad():
        expected8, expected1 = model(x8), model(x1)
        reg = register({"model": model}, _config(backends=[Whole(batch=1), OnceBlocks()]))
        outputs = [model(x8)]  # recorded
        reg.tune()
        outputs.append(model(x8))  # tuned: nothing builds the whole at batch 8, so eager
        assert reg.targets["model"].state is TargetState.EAGER
        new = reg.descend("model", _blocks(model), keep=True)
        assert list(reg.targets) == ["model", "model.blocks.0", "model.blocks.1"]
        assert [t.name for t in reg.targets["model"].inner] == [t.name for t in new]
        outputs.append(model(x8))  # the outer's eager route passes the call to its blocks, which record it
        reg.tune()
        outputs.append(model(x8))  # the blocks tune
        assert all(t.state is TargetState.TUNED for t in new)
        outputs.append(model(x8))
        assert reg.targets["model.blocks.0"].calls_served["once_blocks"] == 2
        # Batch 1, a family the outer never met: its blocks decide it first; only then does the outer record it.
        outputs.append(model(x1))  # the blocks record; the outer does not (its blocks had no route for the call)
        assert not reg.targets["model"].samples
        reg.tune()
        outputs.append(model(x1))  # the blocks tune it (the outer has nothing to tune yet)
        assert not reg.targets["model"].samples
        outputs.append(model(x1))  # served by the blocks: the outer records it
        assert reg.targets["model"].samples
        reg.tune()
        outputs.append(model(x1))  # the outer tunes batch 1 against its blocks as they serve, and wins
        before = _served(reg)
        outputs.append(model(x1))  # served whole: its blocks are not called
        outputs.append(model(x8))  # served by the blocks
        after = _served(reg)
    assert after["model"]["whole"] == before["model"].get("whole", 0) + 1
    assert after["model.blocks.0"]["once_blocks"] == before["model.blocks.0"]["once_blocks"] + 1  # batch 8 only
    report = reg.targets["model"].report()
    chosen = {s.signature.split("[")[1].split("x")[0]: s.chosen for s in report.signatures}
    assert chosen == {"8": "eager", "1": "whole"}, report
    batch1 = next(s for s in report.signatures if s.chosen == "whole")
    assert batch1.speedup > 1.05  # against its blocks' path, which skips nothing the whole skips but the waste
    assert report.blocks == ["model.blocks.0", "model.blocks.1"]
    text = str(reg.report())
    assert "kept whole over its blocks: model (Wasteful)" in text and "kept whole over its 2 blocks" in text
    for out, expected in zip(outputs, [expected8] * 5 + [expected1] * 5 + [expected8], strict=True):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    reg.detach()
    assert _unpatched(model)


def test_a_family_the_whole_wins_against_eager_but_not_against_its_blocks_runs_the_blocks() -> None:
    """At batch 64 the whole (three MLPs) beats eager (four) but not its blocks as they serve (two): timed against the
    blocks, it stays eager there, and the blocks serve."""
    torch.manual_seed(0)
    model = Wasteful().eval()
    x8, x64 = torch.randn(8, WIDTH), torch.randn(64, WIDTH)
    whole = Whole(batch=64, extra=True)
    with torch.no_grad():
        expected = model(x64)
        reg = register({"model": model}, _config(backends=[whole, OnceBlocks()]))
        model(x8)
        reg.tune()
        model(x8)
        reg.descend("model", _blocks(model), keep=True)
        for _ in range(2):  # the blocks record batch 64, then tune it
            model(x64)
            reg.tune()
        model(x64)  # served by the blocks: the outer records
        reg.tune()
        out = model(x64)  # the outer tunes batch 64 against its blocks
        served = model(x64)
    assert whole.builds == 1
    signature = next(s for s in reg.targets["model"].report().signatures if "64x256" in s.signature)
    assert signature.chosen == "eager" and "nothing was faster" in (signature.reason or ""), signature
    candidate = next(c for c in signature.candidates if c.backend == "whole")
    assert candidate.speedup is not None and candidate.speedup < 1.0  # against eager it would be about 1.3x
    assert reg.targets["model.blocks.0"].calls_served["once_blocks"] >= 2
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(served, expected, rtol=0, atol=0)
    reg.detach()
    assert _unpatched(model)


def test_keeping_a_target_over_its_blocks_reguards_its_routes_and_refuses_stray_modules() -> None:
    """The outer's routes were guarded before its blocks had routers: kept over them, a route that held still serves
    (not a guard failure and a re-tuning); descend(keep=True) takes modules inside the target, once."""
    torch.manual_seed(0)
    model = Wasteful().eval()
    x1 = torch.randn(1, WIDTH)
    with torch.no_grad():
        expected = model(x1)
        reg = register({"model": model}, _config(backends=[Whole(batch=1), OnceBlocks()]))
        model(x1)
        reg.tune()
        model(x1)
        assert reg.targets["model"].state is TargetState.TUNED
        with pytest.raises(ValueError, match="'stray' is not inside 'model'"):
            reg.descend("model", {"stray": TwiceBlock()}, keep=True)
        reg.descend("model", _blocks(model), keep=True)
        with pytest.raises(ValueError, match="kept whole over its blocks already"):
            reg.descend("model", _blocks(model), keep=True)
        out = model(x1)
    target = reg.targets["model"]
    assert target.calls_served["whole"] == 2 and not target.changes, target.report()
    assert not any(reg.targets[name].calls_served for name in _blocks(model))  # the whole served: blocks never called
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    reg.detach()
    assert _unpatched(model)


def test_an_eager_family_of_batches_kept_over_blocks_covers_other_batches_but_not_a_batch_of_one() -> None:
    """Shape families: the whole's eager decision on batches of 8 covers a batch of 4 (it runs the blocks, and the
    whole records nothing), but a batch of one is a family apart for it, which it records and tunes once its blocks
    have decided it."""
    torch.manual_seed(0)
    model = Wasteful().eval()
    x8, x4, x1 = torch.randn(8, WIDTH), torch.randn(4, WIDTH), torch.randn(1, WIDTH)
    with torch.no_grad():
        expected = {4: model(x4), 1: model(x1)}
        reg = register({"model": model}, _config(shapes="family", backends=[Whole(batch=1), OnceBlocks()]))
        model(x8)
        reg.tune()
        model(x8)  # eager for the family of batches of 8 (nothing builds the whole there)
        reg.descend("model", _blocks(model), keep=True)
        outer = reg.targets["model"]
        outputs = {4: [], 1: []}
        for _ in range(3):  # the blocks record batch 4, tune it, serve it; the outer's eager decision covers it
            outputs[4].append(model(x4))
            reg.tune()
        assert not outer.samples and all(t.state is TargetState.TUNED for t in outer.inner)
        for _ in range(4):  # the blocks record batch 1, tune it; then the outer records it and tunes it
            outputs[1].append(model(x1))
            reg.tune()
        served = outer.calls_served.get("whole", 0)
        outputs[1].append(model(x1))
    assert outer.calls_served["whole"] == served + 1, outer.report()
    assert {s.chosen for s in outer.report().signatures} == {"eager", "whole"}
    for batch, outs in outputs.items():
        for out in outs:
            torch.testing.assert_close(out, expected[batch], rtol=0, atol=0)
    reg.detach()
    assert _unpatched(model)


def test_a_registration_is_settling_until_the_blocks_a_descent_added_have_tuned() -> None:
    """`all_tuned` does not wait for targets never called, so right after a descent it holds while the new blocks have
    not even recorded: `settling` says more calls will tune (the session keeps calling while it is True)."""
    torch.manual_seed(0)
    model = Wasteful().eval()
    x8 = torch.randn(8, WIDTH)
    with torch.no_grad():
        reg = register({"model": model}, _config(backends=[Whole(batch=1), OnceBlocks()]))
        model(x8)
        reg.tune()
        model(x8)
        assert reg.all_tuned and not reg.settling
        reg.descend("model", _blocks(model), keep=True)
        assert reg.all_tuned and reg.settling  # the blocks were never called
        model(x8)  # they record
        reg.tune()
        assert reg.settling  # armed, called before
        model(x8)  # they tune
    assert reg.all_tuned and not reg.settling, reg.report()
    reg.detach()


def test_a_weight_edit_inside_a_block_stops_the_whole_from_serving_what_it_baked() -> None:
    """The whole serves batch 1 from a build of the weights it was made with (`Whole` runs the module's own MLPs, so
    this stands for any build: what matters is that its route stops serving); a `.data` edit inside one block (no
    version counter moves) fails the whole's weight check, and the call equals eager in the edited state."""
    torch.manual_seed(0)
    model = Wasteful().eval()
    x1 = torch.randn(1, WIDTH)
    with torch.no_grad():
        reg = register({"model": model}, _config(backends=[Whole(batch=1, bakes=True), OnceBlocks()]))
        model(x1)
        reg.tune()
        model(x1)
        reg.descend("model", _blocks(model), keep=True)
        model(x1)
        outer = reg.targets["model"]
        served = outer.calls_served["whole"]
        model.blocks[0].mlp.up.weight.data.mul_(1.01)
        out = model(x1)
        with reg.bypass():
            expected = model(x1)
    assert outer.calls_served["whole"] == served and outer.changes, outer.report()  # not served whole after the edit
    assert "weight" in outer.changes[-1]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    reg.detach()


def test_measured_only_the_whole_is_reported_against_its_blocks_and_never_serves() -> None:
    """`targets="blocks"` with `compare_whole=True` keeps each component over its blocks only to measure it
    (`Target.measure_only`): at batch 1 the whole (three MLPs, no waste) beats the blocks as they serve (two MLPs and
    the waste) and the report says so; at batch 64 it does not (three against two). The blocks serve both; every call
    equals eager."""
    torch.manual_seed(0)
    model = Wasteful().eval()
    x1, x64 = torch.randn(1, WIDTH), torch.randn(64, WIDTH)
    whole = Whole(extra=True)
    whole.builds_privately = True  # it traces nothing: it may build on the worker, where a measurement tunes
    with torch.no_grad():
        expected = {1: model(x1), 64: model(x64)}
        reg = register({"model": model}, _config(backends=[whole, OnceBlocks()]))
        reg.descend("model", _blocks(model), measure_only=True)
        assert reg.targets["model"].measure_only and reg.settling is False  # called by nothing yet
        outputs = []
        for x in (x1, x64):
            outputs.append((x, model(x)))  # the blocks record
            reg.tune()
            outputs.append((x, model(x)))  # the blocks tune (the outer has nothing to tune yet)
            outputs.append((x, model(x)))  # served by the blocks: the outer records
            reg.tune()
            outputs.append((x, model(x)))  # the outer is timed against its blocks as they serve, on the worker
            reg.wait()
            assert reg.targets["model"].decided
            outputs.append((x, model(x)))  # the blocks serve
    assert whole.builds == 2
    served = _served(reg)
    assert "whole" not in served["model"] and served["model.blocks.0"]["once_blocks"] >= 6, served
    report = reg.targets["model"].report()
    by_batch = {s.signature.split("[")[1].split("x")[0]: s for s in report.signatures}
    assert by_batch["1"].measured_whole == "whole" and by_batch["1"].chosen == "eager", by_batch["1"]
    assert "measured, not served: the whole through whole ran at" in by_batch["1"].reason
    assert by_batch["64"].measured_whole is None and "nothing was faster" in by_batch["64"].reason
    text = str(reg.report())
    assert "whole would be faster: model (Wasteful) as a whole beat its 2 blocks as they serve on 1 of 2" in text, text
    assert "kept whole over its blocks" not in text
    for x, out in outputs:
        torch.testing.assert_close(out, expected[x.shape[0]], rtol=0, atol=0)
    reg.detach()
    assert _unpatched(model)
