"""The whole-call schedule (`aitune_hf/hf/schedule.py`) as a state machine: real whole calls of a tiny model move it
record -> arm -> serve (auto mode through its descent into blocks), and a move outside its table raises."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

import aitune_hf
from aitune_hf.hf.schedule import Phase, Schedule
from tests.core.modules import TwoBlocks

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


def _phases(targets: str, calls: int, **options: Any) -> tuple[list[tuple[Phase, dict[str, int]]], Schedule]:
    """The schedule's phase and the targets' states after each of `calls` whole calls (and what they left on the
    worker: once every target was decided, what arms tunes there, never in a caller's call: the log says which thread
    began each tuning; the worker may run one while the caller's call is still in flight)."""
    torch.manual_seed(0)
    model = TwoBlocks().eval()
    registration = aitune_hf.enable_aitune(model, targets, **NOTHING_TO_TRY, **options)
    schedule = model.__dict__["_aitune_state"].schedule
    seen = []
    tuned_on, log = _TunedOn(), logging.getLogger("aitune_hf.core.target")
    level, caller = log.level, threading.get_ident()
    log.addHandler(tuned_on)
    log.setLevel(logging.INFO)
    try:
        with torch.no_grad():
            for _ in range(calls):
                serving, began = schedule.phase is Phase.SERVING, len(tuned_on.threads)
                model(torch.randn(2, 8))
                assert registration.wait(timeout=60)
                if serving:  # every target was decided before this call: it tunes nothing inside itself
                    assert caller not in tuned_on.threads[began:]
                seen.append((schedule.phase, registration.state_counts))
    finally:
        log.removeHandler(tuned_on)
        log.setLevel(level)
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
