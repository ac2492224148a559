"""Random draws: a forward that draws random numbers is found before it draws anything, so that no replay for tuning
moves a random stream that calls (in this thread or another) draw from (docs/guarantees.md, global state).

The eager references of a tuning (the first replays of a recorded call) run under `no_random_draws()`: a
`TorchDispatchMode`, which is per thread, that stops the replay at the first operator that would draw from a random
generator (torch tags them `nondeterministic_seeded`: `randn`, `rand*`, `normal_`, `bernoulli`, `multinomial`,
`randperm`, a dropout in training mode, attention with `dropout_p > 0`). Such a forward keeps eager: no backend could
give its output and leave the user's random stream where eager leaves it. Nothing is saved and restored around
tuning: restoring torch's process-wide default generator would also rewind the draws other threads made meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class DrawsRandomNumbers(Exception):
    """The forward draws random numbers (the message names the operator): eager is kept, with this as the reason."""


def _value(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    for index, argument in enumerate(func._schema.arguments):
        if argument.name != name:
            continue
        if index < len(args) and not argument.kwarg_only:
            return args[index]
        if name in kwargs:
            return kwargs[name]
        return argument.default_value if argument.has_default_value() else None
    return None


def _draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of a seeded operator draws: attention only with `dropout_p > 0`, a dropout only in training
    mode with `p > 0`, any other seeded operator always."""
    names = {argument.name for argument in func._schema.arguments}
    if "dropout_p" in names:
        return float(_value(func, args, kwargs, "dropout_p") or 0.0) > 0.0
    if "train" in names:
        return bool(_value(func, args, kwargs, "train")) and float(_value(func, args, kwargs, "p") or 0.0) > 0.0
    return True


class _RandomDrawWatch(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            raise DrawsRandomNumbers(
                f"the forward draws random numbers ({func.name()}: a noise term, a dropout in training mode): no "
                "backend would leave the random stream where eager does"
            )
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_random_draws() -> Iterator[None]:
    """Raise `DrawsRandomNumbers`, before it draws, when code in the block (in this thread) would draw a random
    number. The first operator a process dispatches to a Python mode imports `torch._dynamo` (torch's lazy import: 1.6
    s of a 40 ms replay, measured): imported first, so that the replay's seconds (eager's, which a first plan's
    estimate is set against: `TuningJob.estimate`) are the forward's."""
    import torch._dynamo  # noqa: F401

    with _RandomDrawWatch():
        yield


def random_states() -> list[torch.Tensor]:
    """The states of torch's default generators (CPU, and each CUDA device once CUDA is initialised): what a forward
    that cannot run under `no_random_draws` is checked by (in its own thread; other threads may move them too)."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states
