"""The one timer: interleaved rounds, warm-up, medians; synchronised when CUDA tensors are involved."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

Call = tuple[tuple[Any, ...], dict[str, Any]]


def _synchronize(devices: Sequence[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def time_interleaved(
    candidates: Mapping[str, Callable[..., Any]],
    calls: Sequence[Call] | Callable[[], Sequence[Call]],
    devices: Sequence[torch.device] = (),
    warmup: int = 2,
    repeats: int = 15,
    baseline: str | None = None,
) -> tuple[dict[str, float], dict[str, Exception]]:
    """Median seconds per call of each candidate over `calls`, and the candidates that raised.

    Candidates take turns in each round (rotating who goes first), so drift in the machine's speed hits
    all of them alike: the ratio of two medians is then a fair side-by-side comparison. A candidate that
    raises is dropped from later rounds and returned in the second dict; the `baseline` raising propagates.
    `calls` may be a function that returns fresh calls: it runs before each round, outside the clock (inputs
    that a call mutates, such as a KV cache, start each round from the recorded state).
    """
    make_calls = calls if callable(calls) else lambda: calls
    names = list(candidates)
    failures: dict[str, Exception] = {}
    rounds: dict[str, list[float]] = {name: [] for name in names}
    per_call = 1
    for r in range(warmup + repeats):
        live = [name for name in names if name not in failures]
        shift = r % len(live)
        for name in live[shift:] + live[:shift]:
            try:
                batch = make_calls()
                per_call = max(len(batch), 1)
                seconds = _run_round(candidates[name], batch, devices)
            except Exception as error:
                if name == baseline:
                    raise
                failures[name] = error
                continue
            if r >= warmup:
                rounds[name].append(seconds)
    latencies = {name: statistics.median(times) / per_call for name, times in rounds.items() if name not in failures}
    return latencies, failures


def _run_round(fn: Callable[..., Any], calls: Sequence[Call], devices: Sequence[torch.device]) -> float:
    _synchronize(devices)
    start = time.perf_counter()
    for args, kwargs in calls:
        fn(*args, **kwargs)
    _synchronize(devices)
    return time.perf_counter() - start


class Stopwatch:
    """`with Stopwatch() as sw: ...; sw.seconds` — wall time of a block."""

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
