"""The one timer: interleaved rounds, warm-up, medians, and a sequential rule that stops timing once a speed-up is
decided; synchronised when CUDA tensors are involved. Nothing else in aitune_hf reads a clock for tuning: deadlines
use `clock()`, durations `Stopwatch`."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Call = tuple[tuple[Any, ...], dict[str, Any]]

#: Timed rounds before the sequential rule may stop (fewer cannot settle anything at the default confidence).
MIN_ROUNDS = 5
#: One-sided confidence of each bound the sequential rule uses.
CONFIDENCE = 0.95
#: With `warm_turns`, a candidate's turn begins with untimed runs of the calls while its last timed run took less than
#: this: up to `WARM_RUNS` of them, until they have taken this long. Where a call is this short, the runs of the others
#: between its turns leave it cold (its weights out of the CPU's caches; an engine's own threads asleep), as serving
#: calls back to back does not; a longer call reads its weights from memory either way.
WARM_TURN_S = 0.01
WARM_RUNS = 7


_now = time.perf_counter  # the clock itself: monotonic, high resolution (tests put a scripted clock here)


def clock() -> float:
    """Seconds on the timer's clock (monotonic): the reference for deadlines; `Stopwatch.start` is on it too."""
    return _now()


def _synchronize(devices: Sequence[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


@dataclass
class Timing:
    """What `time_until_settled` measured.

    `speedups[name]` is the median over timed rounds of (baseline's time / name's time) in the same round (drift in
    the machine's speed cancels within a round), `bounds[name]` its (lower, upper) confidence bounds by the sign
    test (`median_bounds`); both are empty without a baseline. `seconds[name]` is how long `name` ran, warm-up
    included (not the copies of inputs made between runs). `stopped` says why timing ended: "settled" (the rule
    decided every candidate), "max_rounds", or "deadline". `rounds` is how many rounds were timed, `timed[name]` in
    how many of them `name` ran (fewer once it was retired: it could no longer be the choice). `times[name]`: its
    seconds per round, in order (`paired_ratios` of two of them; `prior` of a later timing).
    """

    latencies: dict[str, float]
    failures: dict[str, Exception]
    rounds: int
    stopped: str
    speedups: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    timed: dict[str, int] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)


def median_bounds(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Distribution-free one-sided confidence bounds of the median of `values` (the sign test's order statistics).

    With n values sorted v_(1) <= ... <= v_(n) and k the largest integer with P[Binomial(n, 1/2) <= k - 1] <=
    1 - confidence, the bounds are (v_(k), v_(n+1-k)): for independent draws, the true median is below the lower
    bound (or above the upper one) with probability at most 1 - confidence. Where no k >= 1 exists (n < 5 at 0.95),
    nothing is known: (0, inf).
    """
    n = len(values)
    alpha = 1.0 - confidence
    k, below = 0, 0.0  # below = P[X <= k - 1]
    while k < n:
        with_k = below + math.comb(n, k) / 2**n  # P[X <= k]
        if with_k > alpha:
            break
        below, k = with_k, k + 1
    if k == 0:
        return 0.0, math.inf
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def time_until_settled(
    candidates: Mapping[str, Callable[..., Any]],
    calls: Sequence[Call] | Callable[[], Sequence[Call]],
    devices: Sequence[torch.device] = (),
    warmup: int = 2,
    max_rounds: int = 15,
    baseline: str | None = None,
    thresholds: Sequence[float] = (),
    min_rounds: int = MIN_ROUNDS,
    confidence: float = CONFIDENCE,
    deadline: float | None = None,
    warm_turns: bool = False,
    prior: Mapping[str, Sequence[float]] | None = None,
) -> Timing:
    """Time `candidates` side by side over `calls`, round after round, until the speed-up of each one against
    `baseline` is decided against every threshold, and at most `max_rounds` timed rounds.

    Rounds: every live candidate runs all `calls` once per round, taking turns (who goes first rotates each round),
    so drift in the machine's speed hits all of them alike. The first `warmup` rounds are not timed. A candidate that
    raises is dropped from later rounds and returned in `failures`; the `baseline` raising propagates. `calls` may be
    a function that returns fresh calls: it runs before each run, outside the clock (inputs that a call mutates, such
    as a KV cache, start each run from the recorded state).

    `prior`: seconds per round of rounds timed before on the same calls (eager's and a candidate's, paired by
    position): they count as the first timed rounds, toward `min_rounds` and `max_rounds` (a first look's rounds, which
    the search after it goes on from).

    `warm_turns`: for calls that are served back to back (a decode step of `generate()`, a component called at
    every denoising step), each turn starts with untimed runs of the calls (`WARM_TURN_S`, `WARM_RUNS`) while the
    candidate's last timed run was short. Taking turns alone times each candidate cold, right after the others: a
    4-layer 256-wide Llama's decode step replayed, OpenVINO's stateful engine 1.38 ms and eager 1.89 ms in turns
    (1.30x), 0.72 ms and 1.18 ms after seven warm runs (1.62x), 0.73 ms and 1.25 ms replayed back to back alone (one
    thread, AMD EPYC); one warm run was not enough (1.13x). With these settings: 0.68-0.70 ms and 1.06 ms (1.48-1.60x)
    where plain turns read 1.26-1.41x, in two runs each.

    The sequential rule. For a candidate c and timed round i let q_i = t_i(baseline) / t_i(c), the paired speed-up in
    that round; its estimate is the median of q_1..q_n and its bounds (lo, hi) are the sign test's (`median_bounds`
    at `confidence`). c is *settled* against a threshold s when lo > s (faster than s with confidence) or hi < s
    (slower); a ratio within noise of s leaves lo <= s <= hi, and timing goes on. c is *decided* when it is settled
    against every threshold, or when another candidate d that is settled above every threshold is faster than c
    with confidence (the sign test's lower bound of the median of t_i(c) / t_i(d) exceeds 1): c can then no longer
    be the choice. From round `min_rounds` on, a candidate that can no longer be the choice (settled below every
    threshold, or beaten so) is retired: it sits out the later rounds, and its figures are those of the rounds it
    ran (a 0.84x candidate beside a 1.04x one near a 1.05 threshold no longer runs 15 rounds to settle nothing).
    Timing stops after round n when n >= `min_rounds` and every live candidate is decided; else at
    `max_rounds`; else, once at least one round is timed, at the first round that ends past `deadline` (a `clock()`
    value). At confidence 0.95 the earliest stop is 5 rounds that all fall on one side of each threshold; one round
    on the other side needs 8, two need 11 (at most `max_rounds`). With no `thresholds` or no `baseline` it always
    times `max_rounds` rounds (fixed repeats). The rule's looks at every round add up to more than 1 - confidence of
    false stops when a ratio sits right at a threshold; there the two choices differ by less than the noise.
    """
    make_calls = calls if callable(calls) else lambda: calls
    names = list(candidates)
    failures: dict[str, Exception] = {}
    # Rounds timed before (`prior`: each name's seconds per round, paired by position) count as this timing's first.
    times: dict[str, list[float]] = {name: list((prior or {}).get(name, ())) for name in names}
    seconds: dict[str, float] = dict.fromkeys(names, 0.0)
    per_call = 1
    last: dict[str, float] = {}
    rounds, stopped = len(times[baseline]) if baseline is not None and prior else 0, "max_rounds"
    retired: set[str] = set()
    for r in range(warmup + max(max_rounds - rounds, 0)):
        live = [name for name in names if name not in failures and name not in retired]
        shift = r % len(live)
        for name in live[shift:] + live[:shift]:
            try:
                if warm_turns and last.get(name, 0.0) < WARM_TURN_S:
                    _warm_up(candidates[name], make_calls, devices, seconds, name)
                batch = make_calls()
                per_call = max(len(batch), 1)
                elapsed = last[name] = _run_round(candidates[name], batch, devices, seconds, name)
            except Exception as error:
                if name == baseline:
                    raise
                failures[name] = error
                continue
            if r >= warmup:
                times[name].append(elapsed)
        if r < warmup:
            continue
        rounds += 1
        if rounds >= min_rounds:
            undecided, lost = _judge(times, failures | dict.fromkeys(retired), baseline, thresholds, confidence)
            if not undecided:
                stopped = "settled"
                break
            retired |= lost
        if rounds >= max_rounds:
            break
        if deadline is not None and clock() >= deadline:
            stopped = "deadline"
            break
    kept = {name: t for name, t in times.items() if name not in failures}
    timing = Timing(
        latencies={name: statistics.median(t) / per_call for name, t in kept.items()},
        failures=failures,
        rounds=rounds,
        stopped=stopped,
        seconds=seconds,
        timed={name: len(t) for name, t in kept.items()},
        times=kept,
    )
    if baseline is not None:
        for name in kept:
            if name != baseline:
                ratios = paired_ratios(times[baseline], times[name])
                timing.speedups[name] = statistics.median(ratios)
                timing.bounds[name] = median_bounds(ratios, confidence)
    return timing


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Paired ratios of the rounds both ran (a retired candidate ran the first ones)."""
    return [a / b if b > 0 else math.inf for a, b in zip(numerator, denominator, strict=False)]


def _judge(
    times: dict[str, list[float]],
    out: Mapping[str, Any],
    baseline: str | None,
    thresholds: Sequence[float],
    confidence: float,
) -> tuple[bool, set[str]]:
    """The sequential rule (see `time_until_settled`) over the candidates not in `out` (failed or retired): whether
    any is still undecided, and those that can no longer be the choice (settled below every threshold, or beaten by a
    candidate settled above every threshold), to retire."""
    if baseline is None or not thresholds:
        return True, set()
    live = [name for name in times if name != baseline and name not in out]
    bounds = {name: median_bounds(paired_ratios(times[baseline], times[name]), confidence) for name in live}
    winners = [name for name in live if bounds[name][0] > max(thresholds)]
    undecided, lost = False, set()
    for name in live:
        lo, hi = bounds[name]
        if hi < min(thresholds):
            lost.add(name)
            continue
        if all(lo > s or hi < s for s in thresholds):
            continue
        if any(
            median_bounds(paired_ratios(times[name], times[other]), confidence)[0] > 1.0
            for other in winners
            if other != name
        ):
            lost.add(name)
            continue
        undecided = True
    return undecided, lost


def time_interleaved(
    candidates: Mapping[str, Callable[..., Any]],
    calls: Sequence[Call] | Callable[[], Sequence[Call]],
    devices: Sequence[torch.device] = (),
    warmup: int = 2,
    repeats: int = 15,
    baseline: str | None = None,
) -> tuple[dict[str, float], dict[str, Exception]]:
    """Median seconds per call of each candidate over `calls` in `repeats` timed rounds, and the candidates that
    raised: `time_until_settled` with fixed repeats (no sequential rule)."""
    timing = time_until_settled(candidates, calls, devices, warmup, repeats, baseline)
    return timing.latencies, timing.failures


def _warm_up(
    fn: Callable[..., Any],
    make_calls: Callable[[], Sequence[Call]],
    devices: Sequence[torch.device],
    seconds: dict[str, float],
    name: str,
) -> None:
    """Untimed runs of the calls before a warm turn's timed one: `WARM_RUNS` at most, until they took `WARM_TURN_S`."""
    spent = 0.0
    for _ in range(WARM_RUNS):
        spent += _run_round(fn, make_calls(), devices, seconds, name)
        if spent >= WARM_TURN_S:
            break


def _run_round(
    fn: Callable[..., Any],
    calls: Sequence[Call],
    devices: Sequence[torch.device],
    seconds: dict[str, float],
    name: str,
) -> float:
    # A background tuner's yielding hook (`core.background`) would weigh on eager's many Python calls more than on a
    # compiled callable's few: it is off while a round is timed (only that hook; a user's profiler is left alone).
    hook = sys.getprofile()
    ours = getattr(hook, "aitune_yield", False)
    if ours:
        sys.setprofile(None)
    _synchronize(devices)
    start = _now()
    try:
        for args, kwargs in calls:
            fn(*args, **kwargs)
        _synchronize(devices)
    finally:
        elapsed = _now() - start
        seconds[name] += elapsed
        if ours:
            sys.setprofile(hook)
    return elapsed


class Stopwatch:
    """`with Stopwatch() as sw: ...; sw.seconds` — wall time of a block (`start` is a `clock()` value).

    With `devices`, CUDA devices among them are synchronised on entry and exit, so queued GPU work is counted.
    `seconds` is 0.0 until the block ends, and is set even when the block raises.
    """

    def __init__(self, devices: Sequence[torch.device] = ()) -> None:
        self.devices = devices
        self.start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        _synchronize(self.devices)
        self.start = clock()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        _synchronize(self.devices)
        self.seconds = clock() - self.start
