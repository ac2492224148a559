"""`TuningConfig`: every knob of the tuning core in one dataclass."""

from __future__ import annotations

import difflib
import functools
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aitune_hf.backends.base import PRECISIONS, Backend, backend_names, default_backend_names, get_backend
from aitune_hf.core.quality import METRICS
from aitune_hf.core.strategy_base import STRATEGIES, Strategy
from aitune_hf.errors import ConfigError, InputTypeError

#: (atol, rtol) per output dtype; compiled backends reorder reductions, so these are looser than bitwise.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-6, 1e-5),
    torch.float32: (1e-3, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}

_TRIGGER = re.compile(r"^(manual|after_calls=(\d+))$")


@dataclass
class TuningConfig:
    """How targets are tuned.

    Args:
        backends: candidates, by name or as `Backend` instances with options; eager is always the baseline. Default:
            Inductor, ONNX Runtime and, where installed, OpenVINO (`backends.base.default_backend_names`).
        strategy: "min_latency" (default), "first_wins", or a `Strategy` instance such as `OneBackend(...)`.
        min_speedup: the eager/candidate latency ratio a non-eager candidate must reach to be chosen;
            0 prefers any correct candidate to eager.
        tolerances: (atol, rtol) per dtype for comparing a candidate's outputs with eager's.
        warmup: untimed runs per candidate before timing.
        repeats: timed rounds per candidate (interleaved with eager; the median counts).
        max_samples_per_signature: captured calls kept per input signature.
        max_sample_bytes: memory cap for the captured inputs of one target, across all its signatures. When a
            new call would exceed it, the oldest samples are evicted first from signatures that keep more than
            one, then the oldest signatures' only ones: the most recent calls are kept. A call larger than the
            cap on its own is not recorded.
        max_signatures: at most this many input signatures per target (routed or recorded); calls of further
            signatures run eager, are not recorded, and are counted in the report.
        trigger: "manual" (tune when `Registration.tune()` arms it) or "after_calls=N" (arm itself after
            recording N calls).
        share_identical: identical siblings reuse the first one's decision (checked for correctness only).
        progress: show a tqdm progress bar over targets while tuning (drawn only where stderr is a terminal).
        max_routes: at most this many built routes per target: one per input signature and guarded module
            state; beyond it, calls in a new state run eager and the report says why.
        weight_check: how the values of weights a backend baked are verified before each call it serves.
            "sampled" (default): each tensor's version counter and storage pointer (when they move, that tensor
            is compared in full) plus about 16 spread elements per tensor; misses only a write through `.data`
            (no version bump) confined to a few rows or elements. "full": every tensor in full on every call
            (one pass over the weights: 5-10% of a MiniLM call at batch 1, 32 tokens).
        shapes: "family" (default): signatures that differ only in tensor sizes (batch, sequence length,
            resolution; equal structure, ranks, dtypes, devices and plain values) are one shape family, tuned
            together: one polymorphic build per family (ONNX Runtime with dynamic axes, Inductor with
            `dynamic=True`), checked on every recorded shape and timed on the hottest ones. A later call of a new
            shape the build covers is checked against eager once (it returns eager's output), then served.
            "exact": one build per exact signature; calls of any other shape run eager and are recorded.
            Calls that hold objects (a KV cache) are tuned per exact signature either way.
        cache_dir: where decisions and artifacts persist across processes (docs/cache.md): a folder, or an fsspec
            URL (`s3://...`, `gs://...`, `memory://...`). None: the `AITUNE_HF_CACHE` environment variable (a folder,
            a URL, or "off"), else `aitune_hf` under the user's cache folder.
        cache: "rw" (default: reuse entries and write new ones), "ro" (reuse, never write; the report says so) or
            "off".
        budget_s: an optional tuning budget per target, in seconds; None: no budget.
        retune: after a guard failure (module state or structure changed since a backend was built), re-tune
            on its own at a later call; False: only when `tune()` is called.
        precision: "fp32" (default: never lossy beyond fp32 tolerances), "auto" (also every reduced precision this
            machine computes natively: bf16 with AVX512-BF16 or AMX and on CUDA, int8 with VNNI or AMX, fp16 on CUDA),
            or a list of names from `PRECISIONS` (e.g. ["fp32", "int8"]). A reduced-precision candidate serves only
            after a per-block error filter and, under the Hugging Face layer, the end-to-end `quality` gate
            (docs/precision.md).
        background: tune on a worker thread while calls keep being served (eager, or by what is tuned already): no
            call waits for a tuning; only backends that build from a private copy of the module take part (ONNX
            Runtime; Inductor compiles the live module). docs/serving.md.
        anytime: serve the first plan that is correct and faster than eager as soon as it is checked and timed (and,
            in reduced precision, gated), and search the other cheap candidates after it on the worker, off the
            callers' threads, switching only to a plan measured faster that passes the same checks (default;
            `core/refine.py`, docs/backends.md). False: every candidate is tried before anything serves.
        quality: the end-to-end budget of reduced precision by metric (`aitune_hf.core.quality.METRICS`): e.g.
            {"psnr": 40} for images, {"cosine": 0.995} for embeddings; None: the defaults per output kind (PSNR >= 35
            dB, min per-row cosine >= 0.99, the same argmax, the same tokens).

    Every field is checked on construction (and again by `coerce`): a wrong type, a bool where an int is
    meant, NaN, an infinity or a value out of range is a `ConfigError` that names the field, the value and
    what is valid.

    Example:
        >>> TuningConfig(backends=["onnxruntime"], repeats=5).repeats
        5
        >>> TuningConfig(min_speedup=float("nan"))
        Traceback (most recent call last):
        ...
        aitune_hf.errors.ConfigError: TuningConfig.min_speedup must be a finite number >= 0, got nan
    """

    backends: Sequence[str | Backend] = field(default_factory=default_backend_names)
    strategy: str | Strategy = "min_latency"
    min_speedup: float = 1.05
    tolerances: Mapping[torch.dtype, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    warmup: int = 2
    repeats: int = 15
    max_samples_per_signature: int = 2
    max_sample_bytes: int = 512 * 2**20
    max_signatures: int = 32
    trigger: str = "manual"
    share_identical: bool = True
    progress: bool = True
    max_routes: int = 8
    shapes: str = "family"
    retune: bool = True
    weight_check: str = "sampled"
    cache_dir: str | os.PathLike[str] | None = None
    cache: str = "rw"
    budget_s: float | None = None
    precision: str | Sequence[str] = "fp32"
    quality: Mapping[str, float] | None = None
    background: bool = False
    anytime: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (in field order; the first bad one raises `ConfigError`) and normalise them:
        `backends` becomes a tuple, counts plain ints, `min_speedup` a float, `tolerances` a new dict of
        float pairs. Idempotent; `coerce` calls it again, so a field assigned after construction is checked."""
        self.backends = _check_backends(self.backends)
        self.strategy = _check_strategy(self.strategy)
        self.min_speedup = _check_number("min_speedup", self.min_speedup)
        self.tolerances = _check_tolerances(self.tolerances)
        self.warmup = _check_int("warmup", self.warmup, 0)
        self.repeats = _check_int("repeats", self.repeats, 1)
        self.max_samples_per_signature = _check_int("max_samples_per_signature", self.max_samples_per_signature, 1)
        self.max_sample_bytes = _check_int("max_sample_bytes", self.max_sample_bytes, 1)
        self.max_signatures = _check_int("max_signatures", self.max_signatures, 1)
        self.trigger = _check_trigger(self.trigger)
        self.share_identical = _check_bool("share_identical", self.share_identical)
        self.progress = _check_bool("progress", self.progress)
        self.max_routes = _check_int("max_routes", self.max_routes, 1)
        if self.shapes not in ("family", "exact"):
            raise _error("shapes", self.shapes, "'family' or 'exact'")
        self.retune = _check_bool("retune", self.retune)
        if self.weight_check not in ("sampled", "full"):
            raise _error("weight_check", self.weight_check, "'sampled' or 'full'")
        if self.cache_dir is not None and not isinstance(self.cache_dir, str | os.PathLike):
            raise _error("cache_dir", self.cache_dir, "a folder path, an fsspec URL or None")
        if self.cache not in ("rw", "ro", "off"):
            raise _error("cache", self.cache, "'rw', 'ro' or 'off'")
        if self.budget_s is not None:
            self.budget_s = _check_number("budget_s", self.budget_s)
            if self.budget_s <= 0:
                raise _error("budget_s", self.budget_s, "a finite number > 0, or None")
        self.precision = _check_precision(self.precision)
        self.background = _check_bool("background", self.background)
        self.anytime = _check_bool("anytime", self.anytime)
        self.quality = _check_quality(self.quality)

    @property
    def precisions(self) -> tuple[str, ...]:
        """The precisions asked for: ("fp32",), every one of `PRECISIONS` for "auto" (the machine then offers those
        it computes natively), or the list given."""
        if self.precision == "auto":
            return PRECISIONS
        return (self.precision,) if isinstance(self.precision, str) else tuple(self.precision)

    @property
    def reduced(self) -> bool:
        """True when a precision other than fp32 may be used."""
        return any(p != "fp32" for p in self.precisions)

    @property
    def after_calls(self) -> int | None:
        """N for trigger "after_calls=N", else None."""
        match = _TRIGGER.match(self.trigger)
        return int(match.group(2)) if match and match.group(2) else None

    def resolve_backends(self) -> list[Backend]:
        """Backend instances, eager excluded (it is always the baseline); names were checked on construction."""
        resolved = [get_backend(spec) for spec in self.backends]
        return [b for b in resolved if b.name != "eager"]

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        return self.tolerances.get(dtype, (0.0, 0.0))

    @classmethod
    def coerce(cls, config: TuningConfig | Mapping[str, Any] | None) -> TuningConfig:
        """Accept a TuningConfig (checked again), a dict of its fields, or None (defaults).

        Raises:
            ConfigError: an unknown key, or a field with a bad value.
            InputTypeError: `config` is none of the three.
        """
        if config is None:
            return cls()
        if isinstance(config, TuningConfig):
            config.validate()
            return config
        if isinstance(config, Mapping):
            _check_names(config)
            return cls(**config)
        raise InputTypeError(
            f"config must be a TuningConfig, a dict of its fields or None, got {type(config).__name__}: {config!r:.80}"
        )


_dataclass_init = TuningConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self: TuningConfig, *args: Any, **fields: Any) -> None:
    _check_names(fields)  # a misspelt field is a ConfigError naming the valid ones, not the dataclass' TypeError
    _dataclass_init(self, *args, **fields)


TuningConfig.__init__ = _init  # type: ignore[method-assign]


def _check_names(fields: Mapping[str, Any]) -> None:
    valid = list(TuningConfig.__dataclass_fields__)
    unknown = sorted(set(fields) - set(valid))
    if not unknown:
        return
    hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, valid, n=1)) else
             repr(name) for name in unknown]  # fmt: skip
    raise ConfigError(f"unknown TuningConfig field(s) {', '.join(hints)}; valid: {', '.join(valid)}")


# -- field checks: each returns the normalised value or raises ConfigError naming field, value and what is valid --


def _error(name: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"TuningConfig.{name} must be {valid}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise _error(name, value, f"an int >= {minimum}")
    return int(value)


def _check_number(name: str, value: Any, minimum: float = 0.0) -> float:
    if not _is_real(value) or not math.isfinite(value) or value < minimum:
        raise _error(name, value, f"a finite number >= {minimum:g}")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _error(name, value, "True or False")
    return value


def _check_backends(value: Any) -> tuple[str | Backend, ...]:
    valid = f"backend names ({', '.join(backend_names())}) or Backend instances"
    if isinstance(value, str | Backend):
        value = (value,)
    if not isinstance(value, Sequence):  # a set has no order, and the order is the order of trial
        raise _error("backends", value, f"a list or tuple of {valid}")
    for spec in value:
        if isinstance(spec, type) and issubclass(spec, Backend):
            raise _error("backends", value, f"a list of {valid} (pass {spec.__name__}(), an instance)")
        if isinstance(spec, str) and spec not in backend_names():
            raise ConfigError(
                f"TuningConfig.backends: unknown backend {spec!r}; valid names: {', '.join(backend_names())}"
            )
        if not isinstance(spec, str | Backend):
            raise _error("backends", value, f"a list of {valid}; {spec!r} is a {type(spec).__name__}")
    return tuple(value)


def _check_strategy(value: Any) -> str | Strategy:
    if isinstance(value, Strategy) or (isinstance(value, str) and value in STRATEGIES):
        return value
    if isinstance(value, str):
        raise ConfigError(
            f"TuningConfig.strategy: unknown strategy {value!r}; valid: {', '.join(map(repr, STRATEGIES))}, "
            f"or a Strategy instance such as OneBackend('onnxruntime')"
        )
    raise _error("strategy", value, f"one of {', '.join(map(repr, STRATEGIES))} or a Strategy instance")


def _check_tolerances(value: Any) -> dict[torch.dtype, tuple[float, float]]:
    if not isinstance(value, Mapping):
        raise _error("tolerances", value, "a dict of torch.dtype -> (atol, rtol), e.g. {torch.float32: (1e-3, 1e-3)}")
    checked = {}
    for dtype, pair in value.items():
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(
                f"TuningConfig.tolerances keys must be torch dtypes (e.g. torch.float32), got {dtype!r} "
                f"({type(dtype).__name__})"
            )
        if (
            not isinstance(pair, tuple | list)
            or len(pair) != 2
            or not all(_is_real(x) and math.isfinite(x) and x >= 0 for x in pair)
        ):
            raise _error(f"tolerances[{dtype}]", pair, "an (atol, rtol) pair of finite numbers >= 0")
        checked[dtype] = (float(pair[0]), float(pair[1]))
    return checked


def _check_precision(value: Any) -> str | tuple[str, ...]:
    valid = f"'fp32', 'auto', or a list of {', '.join(map(repr, PRECISIONS))}"
    if isinstance(value, str):
        if value in ("fp32", "auto") or value in PRECISIONS:
            return value
        raise ConfigError(f"TuningConfig.precision: unknown precision {value!r}; valid: {valid}")
    if not isinstance(value, Sequence) or not value:
        raise _error("precision", value, valid)
    for name in value:
        if name not in PRECISIONS:
            raise ConfigError(
                f"TuningConfig.precision: unknown precision {name!r} in {list(value)!r}; valid names: "
                f"{', '.join(map(repr, PRECISIONS))}"
            )
    return tuple(dict.fromkeys(value))


def _check_quality(value: Any) -> dict[str, float] | None:
    if value is None:
        return None
    valid = ", ".join(f"{name!r} ({what}, default {default:g})" for name, (what, default) in METRICS.items())
    if not isinstance(value, Mapping) or not value:
        raise _error("quality", value, f"a dict of metric -> budget, e.g. {{'psnr': 40}}; metrics: {valid}")
    checked = {}
    for name, budget in value.items():
        if name not in METRICS:
            raise ConfigError(f"TuningConfig.quality: unknown metric {name!r}; valid: {valid}")
        if not _is_real(budget) or not math.isfinite(budget):
            raise _error(f"quality[{name!r}]", budget, "a finite number")
        checked[name] = float(budget)
    return checked


def _check_trigger(value: Any) -> str:
    match = _TRIGGER.fullmatch(value) if isinstance(value, str) else None
    if match is None or (match.group(2) is not None and int(match.group(2)) < 1):
        raise _error("trigger", value, "'manual' or 'after_calls=N' with N >= 1")
    return value
