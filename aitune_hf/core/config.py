"""`TuningConfig`: every knob of the tuning core in one dataclass."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from aitune_hf.backends.base import Backend, get_backend

if TYPE_CHECKING:
    from aitune_hf.core.strategy import Strategy

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
        backends: candidates, by name or as `Backend` instances with options; eager is always the baseline.
        strategy: "min_latency" (default), "first_wins", or a `Strategy` instance such as `OneBackend(...)`.
        min_speedup: the eager/candidate latency ratio a non-eager candidate must reach to be chosen;
            0 prefers any correct candidate to eager.
        tolerances: (atol, rtol) per dtype for comparing a candidate's outputs with eager's.
        warmup: untimed runs per candidate before timing.
        repeats: timed rounds per candidate (interleaved with eager; the median counts).
        max_samples_per_signature: captured calls kept per input signature.
        max_sample_bytes: memory cap for the captured inputs of one target.
        trigger: "manual" (tune when `Registration.tune()` arms it) or "after_calls=N" (arm itself after
            recording N calls).
        share_identical: identical siblings reuse the first one's decision (checked for correctness only).
        progress: show a tqdm progress bar over targets while tuning.
    """

    backends: Sequence[str | Backend] = ("inductor", "onnxruntime")
    strategy: str | Strategy = "min_latency"
    min_speedup: float = 1.05
    tolerances: Mapping[torch.dtype, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    warmup: int = 2
    repeats: int = 15
    max_samples_per_signature: int = 2
    max_sample_bytes: int = 512 * 2**20
    trigger: str = "manual"
    share_identical: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.backends, str | Backend):
            self.backends = (self.backends,)
        if not _TRIGGER.match(self.trigger):
            raise ValueError(f"trigger must be 'manual' or 'after_calls=N' (N >= 1), got {self.trigger!r}")
        if self.after_calls == 0:
            raise ValueError("trigger 'after_calls=N' needs N >= 1")
        if self.min_speedup < 0:
            raise ValueError(f"min_speedup must be >= 0, got {self.min_speedup}")
        if self.repeats < 1 or self.warmup < 0 or self.max_samples_per_signature < 1:
            raise ValueError("repeats and max_samples_per_signature must be >= 1, warmup >= 0")

    @property
    def after_calls(self) -> int | None:
        """N for trigger "after_calls=N", else None."""
        match = _TRIGGER.match(self.trigger)
        return int(match.group(2)) if match and match.group(2) else None

    def resolve_backends(self) -> list[Backend]:
        """Backend instances, eager excluded (it is always the baseline). Unknown names raise ValueError."""
        resolved = [get_backend(spec) for spec in self.backends]
        return [b for b in resolved if b.name != "eager"]

    def resolve_strategy(self) -> Strategy:
        from aitune_hf.core.strategy import resolve_strategy

        return resolve_strategy(self.strategy)

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        return self.tolerances.get(dtype, (0.0, 0.0))

    @classmethod
    def coerce(cls, config: TuningConfig | Mapping[str, Any] | None) -> TuningConfig:
        """Accept a TuningConfig, a dict of its fields, or None (defaults)."""
        if config is None:
            return cls()
        if isinstance(config, TuningConfig):
            return config
        if isinstance(config, Mapping):
            unknown = set(config) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(
                    f"unknown TuningConfig fields {sorted(unknown)}; valid: {sorted(cls.__dataclass_fields__)}"
                )
            return cls(**config)
        raise TypeError(f"config must be a TuningConfig, a dict or None, got {type(config).__name__}")
