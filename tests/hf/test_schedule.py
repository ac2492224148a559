"""The whole-call schedule (`aitune_hf/hf/schedule.py`) as a state machine: real whole calls of a tiny model move it
record -> arm -> serve (auto mode through its descent into blocks), and a move outside its table raises."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import aitune_hf
from aitune_hf.backends import base
from aitune_hf.backends.base import Backend, BuiltBackend, Call
from aitune_hf.errors import CandidateUnavailable
from aitune_hf.hf.schedule import Phase, Schedule
from tests.core.modules import Block, TwoBlocks

#: No candidate backend: every target decides eager at once, so the test is about the schedule, not about tuning.
NOTHING_TO_TRY: dict[str, Any] = {"backends": [], "progress": False}


class _TunedOn(logging.Handler):
    """The threads that began a tuning (`Target`'s INFO line "tuning ... now"), as the log records them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.threads: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "input signature(s) now" in record.getMessage():
            self.threads.append(record.thread or 0)


@contextlib.contextmanager
def _tunings_begun() -> Iterator[_TunedOn]:
    """Inside: the threads that begin a tuning, as `Target`'s log says (its level set to INFO, then put back)."""
    tuned_on, log = _TunedOn(), logging.getLogger("aitune_hf.core.target")
    level = log.level
    log.addHandler(tuned_on)
    log.setLevel(logging.INFO)
    try:
        yield tuned_on
    finally:
        log.removeHandler(tuned_on)
        log.setLevel(level)


def _phases(targets: str, calls: int, **options: Any) -> tuple[list[tuple[Phase, dict[str, int]]], Schedule]:
    """The schedule's phase and the targets' states after each of `calls` whole calls (and what they left on the
    worker: once every target was decided, what arms tunes there, never in a caller's call: the log says which thread
    began each tuning; the worker may run one while the caller's call is still in flight)."""
    torch.manual_seed(0)
    model = TwoBlocks().eval()
    registration = aitune_hf.enable_aitune(model, targets, **NOTHING_TO_TRY, **options)
    schedule = model.__dict__["_aitune_state"].schedule
    seen = []
    with torch.no_grad(), _tunings_begun() as tuned_on:
        for _ in range(calls):
            serving, began = schedule.phase is Phase.SERVING, len(tuned_on.threads)
            model(torch.randn(2, 8))
            assert registration.wait(timeout=60)
            if serving:  # every target was decided before this call: it tunes nothing inside itself
                assert threading.get_ident() not in tuned_on.threads[began:]
            seen.append((schedule.phase, registration.state_counts))
    model.disable_aitune()
    return seen, schedule


def test_whole_calls_record_then_arm_then_serve() -> None:
    seen, _ = _phases("blocks", 3)
    assert seen == [
        (Phase.ARMED, {"armed": 2}),  # the first call recorded; its end armed
        (Phase.SERVING, {"eager": 2}),  # the second tuned (nothing to try: eager) and every target is decided
        (Phase.SERVING, {"eager": 2}),
    ]


def test_auto_mode_descends_into_the_blocks_of_an_eager_component_and_arms_them_after_one_call() -> None:
    seen, _ = _phases("auto", 4)
    assert seen == [
        (Phase.ARMED, {"armed": 1}),  # the model as one component
        (Phase.DESCENDED, {"eager": 1, "idle": 2}),  # it stayed eager: its two blocks get targets beneath it
        (Phase.SERVING, {"eager": 1, "armed": 2}),  # they recorded in this call; its end armed them
        (Phase.SERVING, {"eager": 3}),  # this call ran eager; the worker tuned them
    ]


def test_with_manual_arming_the_schedule_arms_nothing() -> None:
    seen, schedule = _phases("blocks", 3, tune_after_calls=None)
    assert seen == [(Phase.RECORDING, {"recording": 2})] * 3 and schedule.calls == 3


def test_a_move_outside_the_table_raises() -> None:
    _, schedule = _phases("blocks", 2)
    assert schedule.phase is Phase.SERVING
    with pytest.raises(AssertionError, match="no whole-call transition serving -> armed"):
        schedule._move(Phase.ARMED)


#: Each block's eager forward waits this long (what the candidates below skip).
BLOCK_WAIT_S = 0.02
_SKIP_WAIT = threading.local()


class WaitingBlock(Block):
    """A `Block` whose eager forward also waits `BLOCK_WAIT_S` (unless a candidate below runs it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(_SKIP_WAIT, "on", False):
            time.sleep(BLOCK_WAIT_S)
        return super().forward(x)


class WaitingBlocks(TwoBlocks):
    """`TwoBlocks` of `WaitingBlock`s; discovery finds them as its blocks."""

    _repeated_blocks = ["WaitingBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([WaitingBlock(), WaitingBlock()])


class _SkipsTheWait(Backend):
    """Runs the eager forward without the blocks' waits: what eager computes, sooner. `modules`: the class it builds
    for (else unavailable); `worker_wait_s`: what it waits a call on the registration's worker (the search's timing)."""

    builds_privately = True

    def __init__(self, name: str, modules: type[nn.Module], worker_wait_s: float = 0.0) -> None:
        self.name, self.modules, self.worker_wait_s = name, modules, worker_wait_s

    def build(self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        if not isinstance(module, self.modules):
            raise CandidateUnavailable(f"builds a {self.modules.__name__} only")

        def fn(x: torch.Tensor) -> torch.Tensor:
            if "aitune_hf worker" in threading.current_thread().name:
                time.sleep(self.worker_wait_s)
            _SKIP_WAIT.on = True
            try:
                return forward(x)
            finally:
                _SKIP_WAIT.on = False

        return BuiltBackend(fn=fn)


class _WholeFirst(_SkipsTheWait):
    """The whole model's candidate (a registered name: auto mode tries whole components with `component_backends`)."""

    name = "test_whole_first"

    def __init__(self) -> None:
        super().__init__(self.name, WaitingBlocks, worker_wait_s=8 * BLOCK_WAIT_S)


def test_auto_mode_descends_into_a_component_the_search_put_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """targets="auto" with anytime tuning: the whole model's first plan serves (far ahead of eager on its check), so
    nothing descends when every component is decided; the search after it times the plan on the worker, slower than
    eager, and puts eager back. The end of the next whole call gives the model its blocks (DESCENDED), the call after
    records them and arms them, and the worker tunes them: they serve. Every call equals eager."""
    monkeypatch.setitem(base._REGISTRY, _WholeFirst.name, _WholeFirst)
    torch.manual_seed(0)
    model = WaitingBlocks().eval()
    registration = aitune_hf.enable_aitune(
        model, "auto", backends=[_WholeFirst(), _SkipsTheWait("blocks", WaitingBlock)],
        component_backends=[_WholeFirst.name], progress=False, anytime=True, cache="off", min_speedup=1.05,
    )  # fmt: skip
    x = torch.randn(2, 8)
    with torch.no_grad(), registration.bypass():
        expected = model(x)
    schedule = model.__dict__["_aitune_state"].schedule
    with torch.no_grad(), _tunings_begun() as tuned_on:
        for _ in range(2):  # records, then tunes: the first plan serves
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        assert registration.state_counts == {"tuned": 1}, registration.report()  # no block beneath it
        assert registration.wait(timeout=60) and registration.searching == 0
        assert tuned_on.threads == [threading.get_ident()]  # the whole model, in the call that tuned
        (component,) = registration.targets.values()
        assert [route.built for route in component.routes] == [None], registration.report()  # eager put back
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # its end: the blocks beneath it
        assert schedule.phase is Phase.DESCENDED and len(registration.targets) == 3
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # records them; its end arms them
        assert registration.wait(timeout=60)
        assert schedule.phase is Phase.SERVING and registration.state_counts == {"tuned": 3}
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert len(tuned_on.threads) == 3 and threading.get_ident() not in tuned_on.threads[1:]  # the blocks: the worker
    served = {name: dict(t.calls_served) for name, t in registration.targets.items() if name != component.name}
    assert all(counts.get("blocks", 0) >= 1 for counts in served.values()), registration.report()
    model.disable_aitune()
