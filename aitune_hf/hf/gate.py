"""The end-to-end quality gate of whole calls, and the checks of new shapes that a whole call leaves to a replay.

Reduced precision (`TuningConfig.reduced`) serves only once a whole call that met it, replayed, passes the end-to-end
quality budget (`Registration.gate`). A whole call (`WholeCall`) keeps a copy of its inputs (`Snapshot`) while targets
are armed or family routes may meet new shapes; at its end:

- the call that tuned a reduced-precision decision in the foreground replays itself and gates it: that caller pays
  for the gate as it paid for the tuning; a decision tuned on the worker (after `all_tuned`), and a plan the search
  after a first plan found (`core/refine.py`), are gated on the worker, after a whole call that met them;
- new shapes a family route covers are not checked in the call (`CallNotes.defer`): they run eager, and the call's
  replay checks them off the caller's thread, on the registration's worker (`Registration.worker`), then gates
  what came out reduced. The caller pays for a plain call: measured on real MiniLM under sentence-transformers,
  checking and gating new lengths in the call cost 2.8x a plain call (`benchmarks/minilm_traffic.py`, first pass).
  Until its check ends, a shape runs eager (never served unchecked); `Registration.wait()` waits for the checks;
- with `background=True`, every gate runs on the worker: no caller pays for one.

Deferring needs a copy of the call (replaying it is the check), so it applies where the gate is required (reduced
precision asked for); elsewhere a new shape is checked inside its call, as before.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aitune_hf.core.context import CallNotes
from aitune_hf.core.registration import Registration
from aitune_hf.core.signature import autocast_modes
from aitune_hf.core.timing import Stopwatch

#: Gates are reported on the mixin's logger, where they always were.
logger = logging.getLogger("aitune_hf.hf.mixin")
#: The key of a check that only gates (no new shape): one such check waits on the worker at a time.
_GATE_ONLY = object()


@dataclass
class Snapshot:
    """A whole call's inputs, deep copies (tensors, the user's generator in its state at the call's start): what the
    end-to-end quality gate replays, eager and tuned, to compare the two.

    A call that takes a `generator` (a Diffusers pipeline) and was given none draws its noise from torch's default
    generator; each replay is given a private one, seeded alike, instead: the eager and the tuned replay see the same
    noise, and neither moves the default generator, which other calls draw from (in this thread, or in others while
    this one gates)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: The thread's modes at the call (grad, inference mode, autocast): a replay in another thread runs under them,
    #: so that its blocks see the call's signatures.
    modes: tuple[bool, bool, tuple[tuple[str, Any], ...]] = (False, False, ())

    @classmethod
    def take(cls, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Snapshot | None:
        import torch

        try:
            with torch.no_grad():
                copied_args, copied_kwargs = copy.deepcopy((args, kwargs))
        except Exception as error:  # an input deepcopy refuses: reduced precision then never serves (the fallback does)
            logger.warning("the end-to-end quality gate cannot copy this call (%s); reduced precision waits", error)
            return None
        if copied_kwargs.get("generator") is None and _takes(call, "generator"):
            copied_kwargs["generator"] = torch.Generator().manual_seed(0)
        modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast_modes())
        return cls(copied_args, copied_kwargs, modes)

    def replay(self, call: Callable[..., Any]) -> Any:
        import torch

        grad, inference, autocast = self.modes
        args, kwargs = copy.deepcopy((self.args, self.kwargs))
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode() if inference else torch.set_grad_enabled(grad))
            for device, dtype in autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            return call(*args, **kwargs)


def _takes(call: Callable[..., Any], name: str) -> bool:
    """Whether `call` has a parameter `name`; a bound method is asked through its function, once per function (the
    signature is read on every whole call that keeps a copy: 0.1 ms a call, read afresh each time)."""
    try:
        return _has_parameter(getattr(call, "__func__", call), name)
    except TypeError:  # an unhashable callable
        return _has_parameter.__wrapped__(call, name)


@functools.lru_cache(maxsize=256)
def _has_parameter(function: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


class WholeCall:
    """One whole call in one thread: `with WholeCall(registration, call, args, kwargs): call(*args, **kwargs)`.

    It keeps a copy of the call when the gate may need it (targets armed, routes waiting for the gate, new shapes a
    family route may meet), notes in this thread what the call meets (`Registration.noting`), and at the end gates
    what this call tuned in the foreground and leaves its new shapes (and, in the background, every gate) to the
    worker. A call that raised leaves nothing behind: the shapes it deferred are deferred again by a later call."""

    def __init__(self, registration: Registration, call: Callable[..., Any], args: Any, kwargs: Any) -> None:
        self.registration, self.call = registration, call
        self.snapshot: Snapshot | None = None
        if registration.gate_required and (
            registration.may_defer_new_shapes
            or registration.waiting_for_gate
            or any(t.armed for t in registration.targets.values())
        ):
            # Never an earlier call's copy: its replay would not run this call's new shapes, and the gate would pass
            # them unseen. No copy: what waits for the gate keeps waiting (eager, or the fp32 fallback, serves it).
            self.snapshot = Snapshot.take(call, args, kwargs)
        self._noting = registration.noting(defer=self.snapshot is not None)

    def __enter__(self) -> CallNotes:
        self.notes = self._noting.__enter__()
        return self.notes

    def __exit__(self, kind: type[BaseException] | None, *rest: Any) -> None:
        self._noting.__exit__(None, None, None)
        if kind is not None:
            _release(self.notes.deferred)
            return
        registration, notes = self.registration, self.notes
        if self.snapshot is None:
            return
        # The call that tuned pays for the gate of what it tuned, as for the tuning; every other gate (a decision tuned
        # on the worker, a plan the search after a first plan found, new shapes) runs on the worker.
        here = registration.background is None and notes.tuned_s > 0
        if here and any(r.provisional and r.new_shape_of is None for _, r in notes.met):
            gate(registration, self.call, self.snapshot)
        if notes.deferred or (not here and any(r.provisional for _, r in notes.met)):
            deferred = list(notes.deferred)
            registration.worker.submit_check(
                f"a whole call with {len(deferred)} new shape(s)" if deferred else "the gate of a whole call",
                functools.partial(_check, registration, self.call, self.snapshot, deferred),
                functools.partial(_release, deferred),
                key=None if deferred else _GATE_ONLY,
            )


def _release(deferred: list[tuple[Any, Any]]) -> None:
    for target, signature in deferred:
        target.release(signature)


def _check(registration: Registration, call: Callable[..., Any], snapshot: Snapshot, deferred: list[Any]) -> None:
    """On the worker: replay the call to check its deferred new shapes (a target checks a new shape against eager
    in the replay, as it would have in the call), then gate what waits for it."""
    try:
        if deferred:
            with Stopwatch() as watch, registration.noting(replay=True):
                snapshot.replay(call)
            logger.debug("checked %d new shape(s) of a whole call in %.3f s", len(deferred), watch.seconds)
        if registration.waiting_for_gate:
            gate(registration, call, snapshot, tunes=False)
    finally:
        _release(deferred)


def gate(registration: Registration, call: Callable[..., Any], snapshot: Snapshot, tunes: bool = True) -> None:
    """Replay the call eager (the fp32 reference), then with the decisions waiting for the gate serving, and keep
    those whose whole output stays within `quality` (`Registration.gate`; `tunes=False` on the worker: nothing tunes
    there). The seconds count as tuning: the reference's here, the gate's replays there (less a block's fp32
    tuning inside one, which its target counts)."""
    with Stopwatch() as watch, registration.bypass():
        reference = snapshot.replay(call)
    if registration.gate(reference, lambda: snapshot.replay(call), tunes=tunes) is not None:
        assert registration.quality is not None
        registration.quality["seconds"] += watch.seconds
