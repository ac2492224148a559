"""What a strategy is, below the configuration that names one: the `Strategy` interface, the registry of strategy
names, and the build-cost order. `core/strategy.py` holds the strategies and the tuning job; `core/config.py` checks
names against the registry here, so neither imports the other. This room names the configuration and the tuning job
it is handed by their shape (`StrategyConfig`, `Job`), never by importing the rooms above it."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from aitune_hf.backends.base import Backend
from aitune_hf.errors import ConfigError

if TYPE_CHECKING:
    from aitune_hf.core.decisions import Decision

#: Strategy name -> class, for `TuningConfig(strategy="...")`: filled by `core/strategy.py` (imported with the core).
STRATEGIES: dict[str, type[Strategy]] = {}


def build_cost(backend: Backend) -> str:
    """The build cost of `backend` as it declares it (`Backend.build_cost`): "slow" or "cheap" (anything else)."""
    return "slow" if getattr(backend, "build_cost", None) == "slow" else "cheap"


def cheap_first(backends: Sequence[Backend]) -> list[Backend]:
    """`backends` with the cheap builds first; the order given is kept within each cost (a stable sort)."""
    return sorted(backends, key=lambda backend: build_cost(backend) == "slow")


class StrategyConfig(Protocol):
    """What a strategy reads of the configuration here (`core.config.TuningConfig`, which imports this room)."""

    def resolve_backends(self) -> list[Backend]: ...


class Job(Protocol):
    """What a strategy is handed to decide one signature (`core.strategy.TuningJob`, above this room)."""

    config: StrategyConfig


class Strategy(abc.ABC):
    """Decides which backend serves one signature of one target.

    `order`: "cost" (default) tries cheap builds first (`cheap_first`: the order given is kept within each cost);
    "given" keeps `config.backends` as given.
    """

    name: str = ""
    order: str = "cost"

    def __init__(self, order: str = "cost") -> None:
        if order not in ("cost", "given"):
            raise ConfigError(f"{type(self).__name__}(order=...) must be 'cost' or 'given', got {order!r}")
        self.order = order

    def candidates(self, config: StrategyConfig) -> list[Backend]:
        """The candidate backends this strategy will try, eager excluded, in the order given."""
        return config.resolve_backends()

    def ordered(self, backends: Sequence[Backend]) -> list[Backend]:
        """`backends` in the order this strategy tries them."""
        return cheap_first(backends) if self.order == "cost" else list(backends)

    def validate(self, config: StrategyConfig, devices: frozenset[torch.device]) -> None:
        """Raise before anything is patched if this strategy cannot work with `config` on `devices`."""
        self.candidates(config)

    @abc.abstractmethod
    def decide(self, job: Job, backends: Sequence[Backend]) -> Decision:
        """Build, check and time candidates for `job`, and choose. With anytime tuning (`TuningConfig.anytime`) a
        strategy may choose before it has tried every candidate, leaving the rest to `refine`."""

    def refine_step(self, job: Job, current: Decision) -> bool:
        """Off the callers' threads, after `decide` chose `current` as a first plan for `job`: try the next candidate
        `decide` left; True while more are left (`core/refine.py`). Default: nothing is left."""
        return False

    def refine(self, job: Job, current: Decision) -> Decision | None:
        """Once `refine_step` is done: a decision measured better than `current`, or None to keep it. Default: None."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()" if self.order == "cost" else f"{type(self).__name__}(order={self.order!r})"
