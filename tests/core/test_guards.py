"""Guards in the core, on plain torch modules: every state a built backend depends on, checked per call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aitune_hf import TargetState, register
from aitune_hf.core.guards import GuardKind, ModuleGuard, root_plumbing
from aitune_hf.core.keys import state_fingerprint

ORT = {"backends": ["onnxruntime"], "min_speedup": 0, "progress": False, "warmup": 1, "repeats": 2}


class Scale:
    """A plain object a block reads (like an attention processor): guarded by identity and its own state."""

    def __init__(self, factor: float) -> None:
        self.factor = factor


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.gain = 1.0  # a plain value the forward reads (like FreeU's b1)
        self.scaling = {"default": 1.0}  # a container mutated in place (like peft's scaling)
        self.enabled = True  # a flag (like peft's _disable_adapters)
        self.helper = Scale(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x) * self.gain * self.scaling["default"] * self.helper.factor
        return torch.tanh(y) if self.enabled else y


def _tuned(**config) -> tuple[Block, torch.Tensor, object]:
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(2, 8)
    reg = register({"block": block}, {**ORT, **config})
    with torch.no_grad():
        block(x)
        reg.tune()
        block(x)
    assert reg.targets["block"].state is TargetState.TUNED
    return block, x, reg


EDITS = {
    "plain value": (lambda b: setattr(b, "gain", 0.5), "gain changed: 1.0 -> 0.5"),
    "container in place": (lambda b: b.scaling.__setitem__("default", 0.3), "scaling ['default'] changed"),
    "flag": (lambda b: setattr(b, "enabled", False), "enabled changed: True -> False"),
    "object replaced": (lambda b: setattr(b, "helper", Scale(2.0)), "helper was replaced"),
    "object state": (lambda b: setattr(b.helper, "factor", 3.0), "helper.factor changed: 1.0 -> 3.0"),
    "submodule replaced": (lambda b: setattr(b, "inner", nn.Linear(8, 8)), "_modules ['inner'] was replaced"),
    "submodule added": (lambda b: setattr(b, "extra", nn.Identity()), "_modules changed: added ['extra']"),
    "attribute added": (lambda b: setattr(b, "s1", 0.9), "s1 was added (0.9)"),
    "weight .data edit": (lambda b: b.inner.weight.data.add_(0.1), "weight inner.weight was modified"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_every_state_change_serves_eager_at_once_then_retunes(edit: str) -> None:
    block, x, reg = _tuned()
    target = reg.targets["block"]
    change, words = EDITS[edit]
    change(block)
    with torch.no_grad():
        expected = Block.forward(block, x)
        torch.testing.assert_close(block(x), expected, rtol=0, atol=0)  # eager at once: never stale
        assert target.state is TargetState.ARMED and words in target.report().changes[-1], target.report().changes
        torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)  # re-tuned for the new state
    assert target.state is TargetState.TUNED and target.report().routes == 2
    assert target.calls_served["onnxruntime"] == 2 and target.calls_served["eager"] == 2
    reg.detach()


def test_state_that_flips_per_call_gets_one_route_per_state_not_a_rebuild_storm() -> None:
    block, x, reg = _tuned()
    target = reg.targets["block"]
    with torch.no_grad():
        for step in range(8):
            block.scaling["default"] = 0.3 if step % 2 else 1.0
            torch.testing.assert_close(block(x), Block.forward(block, x), atol=1e-5, rtol=1e-5)
    assert target.report().routes == 2 and target.state is TargetState.TUNED
    assert target.calls_served["onnxruntime"] >= 6  # both states are served once each is built
    reg.detach()


def test_routes_are_bounded_and_the_report_says_why() -> None:
    block, x, reg = _tuned(max_routes=2)
    target = reg.targets["block"]
    with torch.no_grad():
        for gain in (0.5, 0.5, 0.25, 0.25, 0.125):
            block.gain = gain
            torch.testing.assert_close(block(x), Block.forward(block, x), atol=1e-5, rtol=1e-5)
    assert target.report().routes == 2
    assert "2 routes built (max_routes)" in target.report().reason
    assert target.calls_served["eager"] >= 3  # the states past the bound run eager
    reg.detach()


def test_retune_off_waits_for_tune() -> None:
    block, x, reg = _tuned(retune=False)
    target = reg.targets["block"]
    block.gain = 0.5
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(block(x), Block.forward(block, x), rtol=0, atol=0)
        assert target.report().routes == 1 and target.state is TargetState.TUNED
        reg.tune()
        torch.testing.assert_close(block(x), Block.forward(block, x), atol=1e-5, rtol=1e-5)
    assert target.report().routes == 2
    reg.detach()


#: The kind of guard each edit fails, and whether the state fingerprint (the cache key's `state`) sees it.
KINDS = {
    "plain value": (GuardKind.STATE, True),
    "container in place": (GuardKind.STATE, True),
    "flag": (GuardKind.STATE, True),
    "object replaced": (GuardKind.STATE, True),  # by identity; the fingerprint sees its other factor
    "object state": (GuardKind.STATE, True),
    "submodule replaced": (GuardKind.STRUCTURE, True),  # by identity; the fingerprint sees it in training mode
    "submodule added": (GuardKind.STRUCTURE, True),
    "attribute added": (GuardKind.STRUCTURE, True),
    "weight .data edit": (GuardKind.WEIGHTS, False),  # values are the weights digest's business
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_check_explain_and_fingerprint_read_one_guard_list(edit: str) -> None:
    """The per-call check, the explanation of a failure and the fingerprint come from one list: the check's reason is
    the first failing guard's, that guard is of the kind the edit touches, and the fingerprint changes with it."""
    torch.manual_seed(0)
    block = Block().eval()
    guard = ModuleGuard(block, weights=True)
    before = state_fingerprint(block)
    assert guard.check() is None and guard.failed() is None
    change, words = EDITS[edit]
    change(block)
    reason = guard.check()
    failed = guard.failed()
    assert reason is not None and failed is not None and failed[1] == reason and words in reason, (reason, failed)
    kind, fingerprinted = KINDS[edit]
    assert failed[0].kind is kind
    assert (state_fingerprint(block) != before) is fingerprinted


def test_framework_hooks_are_registered_plumbing_not_core_names() -> None:
    """The Hugging Face layer registers its hook attributes with the core (hf/names.py): on the target they are
    plumbing that an offload hook changes every call, so a new hook object does not fail the guard."""
    assert {"_hf_hook", "_old_forward", "_diffusers_hook"} <= root_plumbing()
    block = Block().eval()
    block._hf_hook = object()
    guard = ModuleGuard(block)
    block._hf_hook = object()  # re-applied by the offload hook before the next call
    assert guard.check() is None


def test_a_guard_holds_while_nothing_changes_and_ignores_moves_with_equal_values() -> None:
    block = Block().eval()
    guard = ModuleGuard(block, weights=True)
    assert guard.check() is None
    block.inner.weight.data = block.inner.weight.data.clone()  # an offload copy: same values
    block.inner.register_buffer("steps", torch.zeros(2, dtype=torch.long))
    assert "steps" in (guard.check() or "")  # a buffer added is structure
    guard = ModuleGuard(block, weights=True)
    block.inner.steps = torch.zeros(2, dtype=torch.long)  # re-assigned with equal values (what .to() does)
    assert guard.check() is None
    block.inner.steps[0] = 1  # an int buffer is compared exactly
    assert "steps was modified" in (guard.check() or "")


def test_a_module_state_guard_without_weights_ignores_values() -> None:
    block = Block().eval()
    guard = ModuleGuard(block)
    block.inner.weight.data.add_(1.0)  # live-weight backends read it: not a guard failure
    assert guard.check() is None


def _edit_in_place_one_element(w: torch.Tensor) -> None:
    with torch.no_grad():
        w[7, 50] += 1.0  # through autograd's view: bumps the version counter


EDITS_SEEN_BY_BOTH = {
    "whole tensor through .data": lambda w: w.data.add_(0.01),  # no version bump: the spread samples see it
    "storage re-assigned": lambda w: setattr(w, "data", w.data * 1.5),
    "one element, version bumped": _edit_in_place_one_element,
    "copied into through .data": lambda w: w.data.copy_(w.detach() + 0.5),
}


@pytest.mark.parametrize("weight_check", ["sampled", "full"])
@pytest.mark.parametrize("edit", list(EDITS_SEEN_BY_BOTH))
def test_baked_weight_checks_see_edits(weight_check: str, edit: str) -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(96, 200), nn.Linear(200, 64))
    guard = ModuleGuard(block, weights=True, weight_check=weight_check)
    assert guard.check() is None
    EDITS_SEEN_BY_BOTH[edit](block[1].weight)
    assert "weight 1.weight was modified" in (guard.check() or ""), guard.check()


def test_sampled_check_accepts_equal_values_after_a_version_bump() -> None:
    block = nn.Sequential(nn.Linear(96, 200))
    guard = ModuleGuard(block, weights=True)
    block.load_state_dict(block.state_dict())  # copies into every tensor: versions bump, values equal
    assert guard.check() is None


def test_only_the_full_check_sees_a_single_element_written_through_data() -> None:
    block = nn.Sequential(nn.Linear(96, 200))
    sampled, full = ModuleGuard(block, weights=True), ModuleGuard(block, weights=True, weight_check="full")
    block[0].weight.data[7, 51] += 1.0  # no version bump, off the spread samples: the documented blind spot
    assert sampled.check() is None
    assert "0.weight was modified" in (full.check() or "")


def test_sampled_check_follows_a_moved_storage_and_keeps_the_build_values() -> None:
    """The per-call sample views (and the NumPy views of their fast path) are re-made when a tensor's storage moves:
    an edit of the new storage is seen, and the new storage is compared with the values at build time, never with
    values re-taken after the move (a move to other values of the same L2 norm is a change)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(96, 200))
    guard = ModuleGuard(block, weights=True)
    weight = block[0].weight
    weight.data = weight.data.clone()  # equal values in new storage: holds, and the samples move with it
    assert guard.check() is None
    weight.data.add_(0.01)  # through .data on the new storage: no version bump, seen by the moved samples
    assert "weight 0.weight was modified" in (guard.check() or "")
    weight.data.sub_(0.01)
    block2 = nn.Sequential(nn.Linear(96, 200))
    guard2 = ModuleGuard(block2, weights=True)
    block2[0].weight.data = block2[0].weight.data.flip(0).contiguous()  # same norm, other values in each place
    assert "weight 0.weight was modified" in (guard2.check() or "")


@pytest.mark.parametrize("dtypes", ["float16", "bfloat16", "mixed", "int64 buffer"])
def test_sampled_check_sees_data_edits_in_every_dtype(dtypes: str) -> None:
    """Dtypes NumPy has (float16; float16 beside float32; float32 beside an int64 buffer, as BERT's `position_ids`)
    take the NumPy fast path, one comparison per dtype; bfloat16 the torch path: each sees an edit through `.data` of
    every dtype, and holds while nothing changes."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(96, 200), nn.Linear(200, 64))
    if dtypes == "mixed":
        block[1].half()
    elif dtypes == "int64 buffer":
        block[1].register_buffer("positions", torch.arange(3 * 2**24, 3 * 2**24 + 512))  # not exact in float32
    else:
        block.to(getattr(torch, dtypes))
    guard = ModuleGuard(block, weights=True)
    assert (guard._weights._arrays is not None) == (dtypes != "bfloat16")  # which path this case covers
    assert guard.check() is None
    saved = block[1].weight.detach().clone()
    block[1].weight.data.add_(0.5)
    assert "weight 1.weight was modified" in (guard.check() or "")
    block[1].weight.data.copy_(saved)
    if dtypes == "int64 buffer":
        assert guard.check() is None
        block[1].positions.data.add_(1)  # one more than each: float32 rounds both to the same values here
        assert "weight 1.positions was modified" in (guard.check() or "")


def test_a_served_block_follows_moved_weights_and_runs_eager_after_an_edit() -> None:
    """Through the router, compared with eager in the same state: weights moved with equal values keep serving the
    ONNX Runtime build; an edit through `.data` after the move runs eager."""
    block, x, reg = _tuned()
    target = reg.targets["block"]
    with torch.no_grad():
        block.inner.weight.data = block.inner.weight.data.clone()
        served = target.calls_served.get("onnxruntime", 0)
        torch.testing.assert_close(block(x), Block.forward(block, x))
        assert target.calls_served.get("onnxruntime", 0) == served + 1
        block.inner.weight.data.mul_(1.5)
        eager = target.calls_served.get("eager", 0)
        torch.testing.assert_close(block(x), Block.forward(block, x), rtol=0, atol=0)
        assert target.calls_served.get("eager", 0) == eager + 1
    reg.detach()


def test_aitune_bookkeeping_held_by_a_module_is_not_module_state() -> None:
    """A model that holds its own registration (the HF mixin keeps it in the model's __dict__, and a whole model
    can be a target) must not fail its guard every call because the registration's counters move."""
    block = Block().eval()
    reg = register({"block": block}, ORT)
    block.__dict__["_aitune_registration"] = reg
    guard = ModuleGuard(block)
    with torch.no_grad():
        block(torch.randn(2, 8))  # records: counters change
    assert guard.check() is None
    reg.detach()
