"""The one timer's sequential rule: it stops once a speed-up is decided and keeps timing while one is within noise.

The rule is tested on a scripted clock (each callable advances it by a given amount: exact and sleep-free) and,
where the outcome is far from any threshold, on real torch work of different sizes (no bound on wall time is
asserted, so a loaded machine cannot make these fail).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable

import pytest
import torch

from aitune_hf.core import timing
from aitune_hf.core.timing import Stopwatch, median_bounds, time_interleaved, time_until_settled

CALLS = [((), {})]


class ScriptedClock:
    """A clock that moves only when a scripted callable runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def runs(self, seconds: Iterable[float]) -> Callable[[], None]:
        """A callable whose successive runs take `seconds` (the last value repeats)."""
        script = iter(seconds)
        last = [0.0]

        def run() -> None:
            last[0] = next(script, last[0])
            self.now += last[0]

        return run


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ScriptedClock:
    scripted = ScriptedClock()
    monkeypatch.setattr(timing, "_now", scripted)
    return scripted


def test_median_bounds_are_the_sign_tests_order_statistics() -> None:
    assert median_bounds([1.0, 2.0, 3.0, 4.0]) == (0.0, math.inf)  # 4 rounds settle nothing at 0.95
    assert median_bounds([5.0, 1.0, 4.0, 2.0, 3.0]) == (1.0, 5.0)  # 5: the extremes (1/32 <= 0.05)
    assert median_bounds(list(range(1, 9))) == (2, 7)  # 8: one value from each end may lie beyond
    assert median_bounds(list(range(1, 12))) == (3, 9)  # 11: two
    assert median_bounds(list(range(1, 12)), confidence=0.99) == (2, 10)


def test_far_from_the_threshold_it_stops_after_the_minimum_rounds(clock: ScriptedClock) -> None:
    fns = {"eager": clock.runs([1.0]), "fast": clock.runs([0.5]), "slow": clock.runs([2.0])}
    result = time_until_settled(fns, CALLS, warmup=2, max_rounds=30, baseline="eager", thresholds=(1.05,))
    assert result.stopped == "settled" and result.rounds == timing.MIN_ROUNDS
    assert result.speedups == {"fast": 2.0, "slow": 0.5}
    assert result.bounds["fast"] == (2.0, 2.0) and result.latencies == {"eager": 1.0, "fast": 0.5, "slow": 2.0}
    assert result.seconds["eager"] == pytest.approx(7.0)  # warm-up runs counted in the seconds spent


def test_rounds_timed_before_count_as_the_first(clock: ScriptedClock) -> None:
    """A first look's three rounds (`prior`) and two more reach the sign test's five: it settles there, its figures
    those of all five (the prior ones are 0.6 s against eager's 1.2 s: 2x, the new ones 0.5 s against 1.0 s)."""
    fns = {"eager": clock.runs([1.0]), "fast": clock.runs([0.5])}
    prior = {"eager": [1.2, 1.2, 1.2], "fast": [0.6, 0.6, 0.6]}
    result = time_until_settled(fns, CALLS, warmup=0, max_rounds=30, baseline="eager", thresholds=(1.05,), prior=prior)
    assert result.stopped == "settled" and result.rounds == timing.MIN_ROUNDS == 5
    assert result.timed == {"eager": 5, "fast": 5}
    assert timing.paired_ratios(result.times["eager"], result.times["fast"]) == [2.0] * 5
    assert result.times["fast"] == [0.6, 0.6, 0.6, 0.5, 0.5] and result.latencies["eager"] == 1.2
    assert result.seconds["eager"] == pytest.approx(2.0)  # only the new rounds ran
    capped = time_until_settled(fns, CALLS, warmup=0, max_rounds=4, baseline="eager", thresholds=(1.05,), prior=prior)
    assert capped.rounds == 4 and capped.stopped == "max_rounds"  # the prior rounds count toward max_rounds too


def test_within_noise_of_the_threshold_it_times_every_round(clock: ScriptedClock) -> None:
    # The paired ratio alternates 1.10x and 1.00x around a threshold of 1.05: undecided, so all 15 rounds are timed.
    fns = {"eager": clock.runs([1.0]), "close": clock.runs(itertools.cycle([1 / 1.10, 1.0]))}
    result = time_until_settled(fns, CALLS, warmup=0, max_rounds=15, baseline="eager", thresholds=(1.05,))
    assert result.stopped == "max_rounds" and result.rounds == 15
    low, high = result.bounds["close"]
    assert low <= 1.05 <= high


def test_one_outlying_round_costs_three_more_rounds(clock: ScriptedClock) -> None:
    # A disturbance in the second timed round: 5 rounds no longer settle; 8 with one outlier do.
    fns = {"eager": clock.runs([1.0]), "fast": clock.runs([0.8, 1.5, 0.8])}
    result = time_until_settled(fns, CALLS, warmup=0, max_rounds=15, baseline="eager", thresholds=(1.05,))
    assert result.stopped == "settled" and result.rounds == 8
    assert result.speedups["fast"] == pytest.approx(1.25)


def test_a_candidate_beaten_by_a_settled_winner_needs_no_threshold_decision(clock: ScriptedClock) -> None:
    # "close" hovers at the threshold, but "fast" (2x, settled) beats it in every round: it cannot be chosen.
    fns = {
        "eager": clock.runs([1.0]),
        "fast": clock.runs([0.5]),
        "close": clock.runs(itertools.cycle([1 / 1.10, 1.0])),
    }
    result = time_until_settled(fns, CALLS, warmup=0, max_rounds=15, baseline="eager", thresholds=(1.05,))
    assert result.stopped == "settled" and result.rounds == timing.MIN_ROUNDS


def test_a_candidate_that_can_no_longer_win_sits_out_the_later_rounds(clock: ScriptedClock) -> None:
    # "close" hovers at the threshold for all 15 rounds; "slow" (0.5x) is settled below it after 5 and stops running.
    runs = {"slow": 0}

    def slow() -> None:
        runs["slow"] += 1
        clock.now += 2.0

    fns = {"eager": clock.runs([1.0]), "close": clock.runs(itertools.cycle([1 / 1.10, 1.0])), "slow": slow}
    result = time_until_settled(fns, CALLS, warmup=1, max_rounds=15, baseline="eager", thresholds=(1.05,))
    assert result.stopped == "max_rounds" and result.rounds == 15
    assert result.timed == {"eager": 15, "close": 15, "slow": timing.MIN_ROUNDS}
    assert runs["slow"] == 1 + timing.MIN_ROUNDS  # its warm-up and the rounds before it was retired
    assert result.speedups["slow"] == pytest.approx(0.5) and result.bounds["slow"] == pytest.approx((0.5, 0.5))
    assert result.seconds["slow"] == pytest.approx(2.0 * (1 + timing.MIN_ROUNDS))


def test_every_threshold_must_be_settled(clock: ScriptedClock) -> None:
    # 1.30x is settled above 1.05 at once, and within noise of 1.30 (a second threshold) for good.
    fns = {"eager": clock.runs([1.0]), "fast": clock.runs(itertools.cycle([1 / 1.35, 1 / 1.25]))}
    one = time_until_settled(fns, CALLS, warmup=0, max_rounds=12, baseline="eager", thresholds=(1.05,))
    fns = {"eager": clock.runs([1.0]), "fast": clock.runs(itertools.cycle([1 / 1.35, 1 / 1.25]))}
    two = time_until_settled(fns, CALLS, warmup=0, max_rounds=12, baseline="eager", thresholds=(1.05, 1.30))
    assert (one.stopped, one.rounds) == ("settled", 5)
    assert (two.stopped, two.rounds) == ("max_rounds", 12)


def test_max_rounds_below_the_minimum_means_fixed_repeats(clock: ScriptedClock) -> None:
    fns = {"eager": clock.runs([1.0]), "fast": clock.runs([0.1])}
    result = time_until_settled(fns, CALLS, warmup=1, max_rounds=3, baseline="eager", thresholds=(1.05,))
    assert result.rounds == 3 and result.stopped == "max_rounds" and result.bounds["fast"] == (0.0, math.inf)


def test_without_thresholds_or_baseline_it_times_max_rounds(clock: ScriptedClock) -> None:
    fns = {"eager": clock.runs([1.0]), "fast": clock.runs([0.1])}
    assert time_until_settled(fns, CALLS, warmup=0, max_rounds=9, baseline="eager").rounds == 9
    fns = {"eager": clock.runs([1.0]), "fast": clock.runs([0.1])}
    assert time_until_settled(fns, CALLS, warmup=0, max_rounds=9, thresholds=(1.05,)).rounds == 9


def test_a_deadline_stops_after_one_timed_round(clock: ScriptedClock) -> None:
    fns = {"eager": clock.runs([1.0]), "close": clock.runs(itertools.cycle([1 / 1.10, 1.0]))}
    result = time_until_settled(fns, CALLS, warmup=2, max_rounds=15, baseline="eager", thresholds=(1.05,), deadline=0.5)
    assert result.stopped == "deadline" and result.rounds == 1


def test_a_raising_candidate_is_dropped_and_the_rest_decide(clock: ScriptedClock) -> None:
    calls = {"n": 0}
    fast = clock.runs([0.5])

    def flaky() -> None:
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("engine lost")
        clock.now += 0.5

    fns = {"eager": clock.runs([1.0]), "flaky": flaky, "fast": fast}
    result = time_until_settled(fns, CALLS, warmup=1, max_rounds=15, baseline="eager", thresholds=(1.05,))
    assert set(result.failures) == {"flaky"} and "flaky" not in result.latencies
    assert result.stopped == "settled" and result.rounds == timing.MIN_ROUNDS


def test_the_baseline_raising_propagates(clock: ScriptedClock) -> None:
    def broken() -> None:
        raise ValueError("eager broke")

    with pytest.raises(ValueError, match="eager broke"):
        time_until_settled({"eager": broken, "fast": clock.runs([0.5])}, CALLS, baseline="eager", thresholds=(1.0,))


def test_time_interleaved_keeps_fixed_repeats_and_its_two_results(clock: ScriptedClock) -> None:
    runs = {"n": 0}
    eager = clock.runs([1.0])

    def counted() -> None:
        runs["n"] += 1
        eager()

    latencies, failures = time_interleaved({"eager": counted, "fast": clock.runs([0.25])}, CALLS * 2, warmup=1)
    assert latencies == {"eager": 1.0, "fast": 0.25} and failures == {}  # per call, of 2 calls a round
    assert runs["n"] == 2 * (1 + 15)


def test_stopwatch_reads_the_same_clock(clock: ScriptedClock) -> None:
    with Stopwatch() as watch:
        clock.now += 2.5
    assert watch.seconds == 2.5 and watch.start == 0.0
    with Stopwatch(devices=[torch.device("cpu")]) as watch:  # nothing to synchronise on CPU
        clock.now += 1.0
    assert watch.seconds == 1.0


def test_warm_turns_run_a_short_call_once_untimed_at_the_start_of_each_turn(clock: ScriptedClock) -> None:
    # A run right after another candidate's finds its weights cold: 4 ms more, for the fast engine as for eager, which
    # compresses the engine's speed-up; serving back to back, every run is warm (eager 8 ms, the engine 2 ms: 4x).
    last = [""]

    def cold_after_others(name: str, warm_s: float) -> Callable[[], None]:
        def run() -> None:
            clock.now += warm_s + (0.004 if last[0] != name else 0.0)
            last[0] = name

        return run

    fns = {name: cold_after_others(name, s) for name, s in (("eager", 0.008), ("engine", 0.002), ("other", 0.005))}
    cold = time_until_settled(fns, CALLS, warmup=1, max_rounds=5, baseline="eager", thresholds=(1.05,))
    warm = time_until_settled(fns, CALLS, warmup=1, max_rounds=5, baseline="eager", thresholds=(1.05,), warm_turns=True)
    assert cold.speedups["engine"] == pytest.approx(12 / 6)  # every turn cold
    assert warm.latencies == pytest.approx({"eager": 0.008, "engine": 0.002, "other": 0.005})
    assert warm.speedups["engine"] == pytest.approx(4.0)
    # A call longer than WARM_TURN_S is not run twice: its warm-up would only double the timing.
    long_calls = {"eager": clock.runs([0.5]), "engine": clock.runs([0.25])}
    before = clock.now
    result = time_until_settled(long_calls, CALLS, warmup=1, max_rounds=5, baseline="eager", warm_turns=True)
    assert result.rounds == 5 and clock.now - before == pytest.approx(0.75 * 6 + 0.75)  # warm-ups: the first turns


# -- real work: outcomes far from the threshold, so load on the machine cannot change them -------------------------


def _work(size: int, repeats: int) -> Callable[[], torch.Tensor]:
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0))

    def run() -> torch.Tensor:
        out = a
        for _ in range(repeats):
            out = torch.tanh(out @ a)
        return out

    return run


def test_real_work_an_eight_times_faster_candidate_settles_early() -> None:
    with torch.inference_mode():
        fns = {"eager": _work(96, 16), "fast": _work(96, 2), "slow": _work(96, 128)}
        result = time_until_settled(fns, CALLS, warmup=1, max_rounds=40, baseline="eager", thresholds=(1.05,))
    assert result.stopped == "settled"
    assert result.rounds < 40
    assert result.speedups["fast"] > 1.05 > result.speedups["slow"]
    assert result.bounds["fast"][0] > 1.05 > result.bounds["slow"][1]
