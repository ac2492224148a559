"""Tuning in the background (issue 20): no call waits for a tuning. Calls made while the worker tunes are served at
once (eager, or by what is tuned already) and equal eager's output; each block switches to its decision when it is
made; backends that compile the live module are left out, and the report says why."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from aitune_hf import TargetState, register
from aitune_hf.backends.base import build_process_pid
from tests.core.modules import MLPBlock
from tests.quick import QUICK


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(MLPBlock(64), torch.nn.GELU(), MLPBlock(64)).eval()


def test_calls_are_served_while_the_worker_tunes_and_switch_over_when_it_is_done() -> None:
    model = _model()
    x = torch.randn(8, 64)
    registration = register(
        {"0": model[0], "2": model[2]},
        {**QUICK, "backends": ["onnxruntime", "inductor"], "min_speedup": 0, "background": True},
    )
    with torch.no_grad(), registration.bypass():
        expected = model(x)
    with torch.no_grad():
        model(x)  # records
        registration.tune()
        outputs, during = [], 0
        deadline = time.monotonic() + 120
        running = set()
        while not registration.all_tuned and time.monotonic() < deadline:  # calls never wait for the worker
            running.add(registration.background.status()["running"])
            outputs.append(model(x))
            during += registration.background.pending > 0
        served = model(x)
    assert registration.all_tuned, registration.report()
    assert during >= 1 and registration.background.status()["tuned"] == 2  # calls went on while it tuned
    assert running <= {"tuning", None} and "tuning" in running, running  # what the worker ran, as a call saw it
    for out in [*outputs, served]:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    for target in registration.targets.values():
        assert target.state is TargetState.TUNED and target.calls_served.get("onnxruntime", 0) >= 1
    first = registration.targets["0"].report().signatures[0]  # tuned in full ("2" shares its decision)
    skipped = {c.backend: c.error for c in first.candidates if c.error}
    assert "compiles the live module" in skipped.get("inductor", ""), first.candidates
    registration.detach()
    assert registration.background.pending == 0


def test_a_call_of_the_target_being_tuned_runs_eager_at_once() -> None:
    """While the worker holds a target (state TUNING), its calls run the original forward: no lock, no wait."""
    model = _model()
    x = torch.randn(8, 64)
    registration = register({"0": model[0]}, {**QUICK, "backends": ["onnxruntime"], "background": True})
    target = registration.targets["0"]
    with torch.no_grad():
        model[0](x)
        registration.tune()
        model[0](x)  # queued for the worker
        seen_tuning = 0
        deadline = time.monotonic() + 120
        while registration.background.pending and time.monotonic() < deadline:
            if target.state is TargetState.TUNING:
                seen_tuning += 1
                with registration.bypass():
                    expected = model[0](x)
                torch.testing.assert_close(model[0](x), expected, atol=1e-4, rtol=1e-4)  # served at once
    assert seen_tuning >= 1 and registration.background.wait(timeout=60)
    assert target.decided, registration.report()
    registration.detach()


def _tune_in_background(model: torch.nn.Sequential, blocks: dict[str, torch.nn.Module], x: torch.Tensor) -> Any:
    """Registers `blocks` (ONNX Runtime, background), tunes them while calls go on; each call's output is checked."""
    registration = register(blocks, {**QUICK, "backends": ["onnxruntime"], "min_speedup": 0, "background": True})
    with torch.no_grad(), registration.bypass():
        expected = model(x)
    with torch.no_grad():
        model(x)  # records
        registration.tune()
        deadline = time.monotonic() + 120
        while not registration.all_tuned and time.monotonic() < deadline:
            torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)
    assert registration.all_tuned, registration.report()
    return registration


def _built_in(target: Any) -> int | None:
    """The process the target's ONNX Runtime session was built in (None: this one)."""
    (route,) = [route for routes in target._routes.values() for route in routes]
    return route.built.fn.built_in


@pytest.mark.fresh_exports
def test_background_builds_run_in_the_build_process() -> None:
    """Issue 20: the export, quantization and graph optimisation of a background build run in the build process (the
    GIL of this one stays with the serving threads); the session here serves outputs equal to eager's."""
    model = _model()
    registration = _tune_in_background(model, {"0": model[0], "2": model[2]}, torch.randn(8, 64))
    worker = build_process_pid()
    assert worker is not None and worker != os.getpid()
    # "2" is an identical sibling of "0": its model is "0"'s export with its own weights, optimised there as well.
    assert [_built_in(target) for target in registration.targets.values()] == [worker, worker]
    reused = [t.report().signatures[0].candidates[-1].reused for t in registration.targets.values()]
    assert reused == [False, True]  # "2" from the export the build process kept before optimizing ("0"'s)
    registration.detach()


def test_a_block_that_cannot_be_pickled_tunes_in_this_process() -> None:
    """A block the build process cannot take (a lambda attribute: copied by reference, never pickled) is built here,
    as in the foreground: it still tunes."""
    model = _model()
    model[0].note = lambda: "not picklable"
    registration = _tune_in_background(model, {"0": model[0]}, torch.randn(8, 64))
    assert _built_in(registration.targets["0"]) is None
    registration.detach()


def test_a_check_on_the_worker_pauses_while_a_caller_is_served() -> None:
    """A check replays whole calls as heavy as the callers' (issue 32): while a caller's call is in flight it pauses
    at each yield point (PAUSE_S at most, then it goes on), so unseen shapes served beside it cost a plain call."""
    from aitune_hf.core.background import PAUSE_S, BackgroundTuner

    tuner = BackgroundTuner("pause test")
    stamps: list[float] = []
    started = threading.Event()

    def run() -> None:  # Python work: profile events at every call
        started.set()
        end = time.monotonic() + 1.0
        while (now := time.monotonic()) < end:
            stamps.append(now)

    with tuner.serving():
        assert tuner.callers == 1
        assert tuner.submit_check("python work", run, lambda: None)
        assert started.wait(30)
        time.sleep(0.4)
        served_until = time.monotonic()
    assert tuner.callers == 0
    assert tuner.wait(30)
    during = [t for t in stamps if t < served_until]
    after = [t for t in stamps if t > served_until + PAUSE_S]
    assert after and len(during) / (served_until - during[0]) < 0.1 * len(after) / (after[-1] - after[0]), (
        len(during),
        len(after),
    )
    tuner.stop()


def test_a_callers_call_is_served_but_the_workers_replay_is_not() -> None:
    registration = register({"0": _model()[0]}, {**QUICK, "backends": ["onnxruntime"]})
    worker = registration.worker
    with registration.noting(defer=True):
        assert worker.callers == 1
    with registration.noting(replay=True):  # a check's replay on the worker
        assert worker.callers == 0
    assert worker.callers == 0
    registration.detach()


def test_a_search_waiting_for_quiet_gives_way_to_a_check_queued_behind_it() -> None:
    """The gate of a plan a search found runs as a check on the worker, and the other searches wait for quiet, which
    that gate holds back: each search's wait gave the worker to nothing for `QUIET_S` (SD small under traffic: the final
    plan 254-283 s where it was 100 s). Now a search waiting for quiet goes behind the check that waits, which runs
    first; then the search goes on."""
    import contextlib
    from types import SimpleNamespace

    from aitune_hf.core.background import BackgroundTuner
    from aitune_hf.core.refine import QUIET_S, Refinement

    tuner = BackgroundTuner("give way test")
    ran: list[str] = []
    gated = threading.Event()  # the quiet the search waits for: the gate has run
    job = SimpleNamespace(deferred=[])
    refinement = Refinement(None, job, SimpleNamespace(report=None), contextlib.nullcontext, print, {})  # type: ignore[arg-type]
    refinement.bind(SimpleNamespace(name="searched", serves=lambda route: False), SimpleNamespace(provisional=False))

    def search() -> None:
        ran.append("search")
        if refinement.step(gated.is_set, contextlib.nullcontext, lambda: tuner.checks_waiting):
            tuner.submit_search("search", search, key=object())

    def gate() -> None:
        ran.append("gate")
        gated.set()

    started = time.monotonic()
    tuner.submit_search("search", search, key=object())
    while not ran:
        time.sleep(0.01)
    assert tuner.submit_check("the gate of a whole call", gate, lambda: None)
    assert tuner.wait(QUIET_S)
    assert ran == ["search", "gate", "search"] and time.monotonic() - started < QUIET_S / 3, ran
    assert refinement.state == "done" and refinement.outcome.startswith("dropped")  # the searched plan is gone here
    tuner.stop()


def test_a_search_step_goes_behind_every_check_queued() -> None:
    """A new shape is served eager until its check passes, and a search step takes seconds: a step queued behind one
    check only left MiniLM's single queries eager through the whole search while 8 checks waited. The next step now
    waits for every check queued before it; a check queued after it waits for it (the search always progresses). A check
    pauses for a caller's call in flight, but not with a search step queued behind it."""
    from aitune_hf.core.background import BackgroundTuner

    tuner = BackgroundTuner("order test")
    ran: list[str] = []
    release = threading.Event()

    def step(name: str, more: bool) -> Callable[[], None]:
        def run() -> None:
            ran.append(name)
            if name == "step 1":
                release.wait(10)
            if more:
                tuner.submit_search("search", step("step 2", False), key="step 2")

        return run

    tuner.submit_search("search", step("step 1", True), key="step 1")
    while not ran:
        time.sleep(0.01)
    for name in ("check a", "check b", "check c"):
        assert tuner.submit_check(name, functools.partial(ran.append, name), lambda: None)
    with tuner.serving():  # a caller's call in flight: a check pauses, unless a search step waits behind it
        assert tuner._busy()
        tuner.submit_search("search", lambda: ran.append("step 0"), key="step 0")
        assert not tuner._busy()
    release.set()
    while len(ran) < 5:  # step 1 has queued step 2 behind the checks and step 0: one more check now goes behind step 2
        time.sleep(0.001)
    assert tuner.submit_check("check d", functools.partial(ran.append, "check d"), lambda: None)
    assert tuner.wait(10)
    assert ran == ["step 1", "check a", "check b", "check c", "step 0", "step 2", "check d"], ran
    tuner.stop()
