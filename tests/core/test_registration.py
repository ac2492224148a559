"""register(): accepted inputs, bad inputs, all-or-nothing installation, detach, several registrations."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

from aitune_hf import OneBackend, TargetState, TuningConfig, get_target, register
from aitune_hf.core import slots
from aitune_hf.errors import InputTypeError
from tests.core.modules import CudaOnlyBackend, MLPBlock, RaisingBackend

MANUAL = {"backends": [], "progress": False}


class Parent(nn.Module):
    """A module with two child blocks (not a container, so it registers as one target)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = MLPBlock(), MLPBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _unpatched(*modules: nn.Module) -> bool:
    return all("forward" not in m.__dict__ for m in modules)


def test_mapping_names_and_container_expansion() -> None:
    a, b = MLPBlock(), MLPBlock()
    stack = nn.ModuleList([MLPBlock(), MLPBlock()])
    seq = nn.Sequential(MLPBlock())
    with register({"a": a, "stack": stack, "seq": seq, "b": b}, MANUAL) as reg:
        assert list(reg.modules) == ["a", "stack.0", "stack.1", "seq.0", "b"]
        assert reg.modules["stack.1"] is stack[1]
        assert reg.state_counts == {"idle": 5}  # recording, and never called yet
        assert not reg.all_tuned


def test_iterable_keeps_order_and_drops_duplicates() -> None:
    a, b = MLPBlock(), MLPBlock()
    with register([a, b, a], MANUAL) as reg:
        assert list(reg.modules.values()) == [a, b]
        assert list(reg.modules) == ["0", "1"]


def test_a_module_list_given_alone_registers_its_elements() -> None:
    stack = nn.ModuleList([MLPBlock(), MLPBlock()])
    with register(stack, MANUAL) as reg:
        assert list(reg.modules) == ["0", "1"]
    inner = nn.Sequential(MLPBlock(), MLPBlock())
    outer = nn.Sequential(inner, MLPBlock())
    with register(outer, MANUAL) as reg:  # one level only: the inner Sequential is one element
        assert reg.modules == {"0": inner, "1": outer[1]}


def test_non_module_is_a_type_error_naming_it() -> None:
    a = MLPBlock()
    with pytest.raises(TypeError, match=r"'oops'.*expected an nn.Module, got str"):
        register({"a": a, "oops": "not a module"}, MANUAL)
    assert _unpatched(a)


def test_empty_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="nothing to register"):
        register({}, MANUAL)
    with pytest.raises(ValueError, match="nothing to register"):
        register([], MANUAL)


def test_nested_targets_are_refused_and_nothing_is_patched() -> None:
    outer = Parent()
    with pytest.raises(ValueError, match=r"'inner' is inside 'outer'"):
        register({"outer": outer, "inner": outer.first}, MANUAL)
    with pytest.raises(ValueError, match=r"'inner' is inside 'outer'"):
        register({"inner": outer.second, "outer": outer}, MANUAL)
    assert _unpatched(outer, outer.first, outer.second)


def test_a_module_held_by_a_live_registration_is_refused_until_detached() -> None:
    a, b = MLPBlock(), MLPBlock()
    first = register({"a": a}, MANUAL)
    with pytest.raises(ValueError, match=r"'again'.*already registered as 'a'.*detach\(\)"):
        register({"b": b, "again": a}, MANUAL)
    assert _unpatched(b)
    parent = Parent()
    parent.first = a
    with pytest.raises(ValueError, match="contains 'a'"):
        register({"parent": parent}, MANUAL)
    first.detach()
    with register({"again": a}, MANUAL) as second:
        assert second.modules["again"] is a


def test_a_module_inside_a_held_target_is_refused() -> None:
    outer = Parent()
    with register({"outer": outer}, MANUAL), pytest.raises(ValueError, match="is inside 'outer'"):
        register({"inner": outer.first}, MANUAL)


def test_unknown_backend_and_strategy_names() -> None:
    a = MLPBlock()
    with pytest.raises(ValueError, match=r"unknown backend 'tensorrtt'; valid names: .*inductor.*onnxruntime"):
        register([a], {"backends": ["tensorrtt"]})
    with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
        register([a], {"strategy": "fastest"})
    with pytest.raises(ValueError, match=r"unknown TuningConfig field\(s\)"):
        register([a], {"backend": ["inductor"]})
    assert _unpatched(a)


def test_strategy_needing_an_unavailable_backend_is_a_runtime_error() -> None:
    a = MLPBlock()
    with pytest.raises(RuntimeError, match=r"OneBackend\('cuda_only'\).*unavailable here: needs a CUDA device"):
        register([a], TuningConfig(strategy=OneBackend(CudaOnlyBackend())))
    assert _unpatched(a)


def test_bad_trigger() -> None:
    with pytest.raises(ValueError, match="after_calls=N"):
        TuningConfig(trigger="sometimes")
    with pytest.raises(ValueError, match="N >= 1"):
        TuningConfig(trigger="after_calls=0")


def test_tune_after_detach_is_a_runtime_error() -> None:
    reg = register([MLPBlock()], MANUAL)
    reg.detach()
    with pytest.raises(RuntimeError, match=r"tune\(\) after detach\(\)"):
        reg.tune()


def test_installation_is_all_or_nothing() -> None:
    a, b, c = MLPBlock(), MLPBlock(), MLPBlock()

    def broken_locator(module: nn.Module) -> slots.ForwardSlot | None:
        if module is c:
            raise RuntimeError("cannot reach this module's forward")
        return None

    slots.SLOT_LOCATORS.append(broken_locator)
    try:
        with pytest.raises(RuntimeError, match="cannot reach"):
            register({"a": a, "b": b, "c": c}, MANUAL)
    finally:
        slots.SLOT_LOCATORS.remove(broken_locator)
    assert _unpatched(a, b, c)
    with register({"a": a, "b": b, "c": c}, MANUAL):  # nothing is left held either
        pass


def test_wrapping_swaps_the_forward_not_the_module() -> None:
    parent = nn.Sequential(MLPBlock(), MLPBlock()).eval()
    block = parent[0]
    state = {k: v.clone() for k, v in parent.state_dict().items()}
    hook_calls = []
    block.register_forward_hook(lambda *_: hook_calls.append(1))
    x = torch.randn(2, 32)
    expected = parent(x)
    with register({"block": block}, MANUAL) as reg:
        assert parent[0] is block and reg.modules["block"] is block
        assert "forward" in block.__dict__
        torch.testing.assert_close(parent(x), expected, rtol=0, atol=0)
        assert hook_calls == [1, 1]
        assert parent.state_dict().keys() == state.keys()


def test_detach_restores_forward_exactly_and_cached_references_run_the_original() -> None:
    plain = MLPBlock().eval()
    custom = MLPBlock().eval()
    own_forward = custom.forward  # a bound method kept as an instance attribute
    custom.forward = own_forward
    x = torch.randn(2, 32)
    reg = register({"plain": plain, "custom": custom}, MANUAL)
    cached = plain.forward
    assert cached is not MLPBlock.forward
    reg.detach()
    reg.detach()  # twice is harmless
    assert "forward" not in plain.__dict__
    assert custom.__dict__["forward"] is own_forward
    assert reg.targets["plain"].state is TargetState.DETACHED
    torch.testing.assert_close(cached(x), MLPBlock.forward(plain, x), rtol=0, atol=0)


def test_several_registrations_are_independent() -> None:
    a, b = MLPBlock().eval(), MLPBlock().eval()
    x = torch.randn(2, 32)
    first = register({"a": a}, MANUAL)
    second = register({"b": b}, MANUAL)
    a(x)
    assert first.targets["a"].calls_recorded == 1
    assert second.targets["b"].calls_recorded == 0
    first.detach()
    b(x)
    assert second.targets["b"].calls_recorded == 1
    assert "forward" in b.__dict__
    second.detach()


def test_context_manager_detaches() -> None:
    a = MLPBlock()
    with register([a], MANUAL) as reg:
        assert "forward" in a.__dict__
    assert reg.detached and _unpatched(a)


def test_descend_replaces_a_target_by_targets_inside_it() -> None:
    outer, other = Parent().eval(), MLPBlock().eval()
    x = torch.randn(2, 32)
    expected = outer(x)
    with register({"outer": outer, "other": other}, MANUAL) as reg:
        outer(x)
        with pytest.raises(ValueError, match="'stray' is not inside 'outer'"):
            reg.descend("outer", {"stray": MLPBlock()})
        with pytest.raises(ValueError, match="a target named 'other' exists already"):
            reg.descend("outer", {"other": outer.first})
        with pytest.raises(ValueError, match="no target named 'nope'"):
            reg.descend("nope", {})
        assert "forward" in outer.__dict__  # failed descents changed nothing
        new = reg.descend("outer", {"outer.first": outer.first, "outer.second": outer.second})
        assert [t.name for t in new] == ["outer.first", "outer.second"]
        assert list(reg.targets) == ["outer.first", "outer.second", "other"]
        assert "forward" not in outer.__dict__ and "forward" in outer.first.__dict__
        assert reg.descended["outer"].module_class == "Parent"
        torch.testing.assert_close(outer(x), expected, rtol=0, atol=0)
        assert reg.targets["outer.first"].calls_recorded == 1
        assert "descended into outer (Parent)" in str(reg.report())
    assert _unpatched(outer.first, outer.second, other)


def test_get_target_finds_a_block_from_the_module_itself() -> None:
    model = torch.nn.Sequential(MLPBlock(), MLPBlock()).eval()
    assert get_target(model[0]) is None
    registration = register({"first": model[0], "second": model[1]}, {"progress": False})
    target = get_target(model[1])
    assert target is registration.targets["second"] and target.state is TargetState.RECORDING
    assert get_target(model) is None  # the container is not a target
    with pytest.raises(InputTypeError, match=r"get_target takes a torch\.nn\.Module, got str"):
        get_target("model.0")
    registration.detach()
    assert get_target(model[1]) is None


class _Terminal(io.StringIO):
    """stderr as a terminal: what tqdm draws its bar on (it draws none where stderr is not one)."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_the_progress_bar_closes_once_every_target_called_is_decided(terminal: bool) -> None:
    """A target armed and never called (a VAE's encoder stages in a text-to-image pipeline) does not hold the bar open
    short of its total: the bar closes (its line cleared, leave=False) when the targets called are decided, so the
    next line printed starts on a line of its own. Where stderr is no terminal (a log) no bar is drawn at all."""
    err_stream = _Terminal() if terminal else io.StringIO()
    called, never = MLPBlock(8).eval(), MLPBlock(8).eval()
    config = {"progress": True, "warmup": 1, "repeats": 3, "backends": [RaisingBackend()]}
    registration = register({"called": called, "never": never}, config)
    x = torch.randn(2, 8)
    with torch.no_grad(), contextlib.redirect_stderr(err_stream):
        called(x)
        registration.tune()
        called(x)  # tunes "called" (its one candidate fails: eager kept); "never" stays armed
    assert registration.targets["never"].armed and registration.targets["called"].decided
    err = err_stream.getvalue()
    registration.detach()
    if not terminal:
        assert err == "", repr(err)
        return
    assert "aitune_hf tuning" in err and "/1 " in err and "/2 " not in err, repr(err)  # over the target called
    assert err.endswith("\r"), repr(err[-120:])  # closed: tqdm cleared its line (an open bar ends in its text)
