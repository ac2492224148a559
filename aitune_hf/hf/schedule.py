"""Whole-call arming: which whole call records and which one arms tuning.

A whole call is a call a user makes of a pipeline or model: its `__call__`, a model's `generate()`, a VAE's
`encode()` / `decode()` (`AITuneMixin._aitune_call` brings them here; a boundary reached inside another one on
the same thread is part of it). Each object with aitune enabled has one `Schedule`, an explicit state machine
over its whole calls (`Phase`); these are its only moves (`_TRANSITIONS`):

    RECORDING -> ARMED      at the end of whole call `tune_after_calls`, which arms every target: they tune at their
                            next forward (inside the next call, or on the background worker)
    RECORDING -> SERVING    every target decided before that (from the cache, or kept eager by offload)
    ARMED     -> SERVING    every target decided
    (either)  -> DESCENDED  the same two, with targets="auto": the mixin gives the components that stayed eager on a
                            shape family their blocks as targets beneath them, which record in the next whole call
    DESCENDED -> SERVING    at the end of that next whole call, which arms the blocks (where arming is automatic)
    SERVING   -> DESCENDED  targets="auto": a component whose first plan served was put back to eager by the search
                            after it (anytime tuning); it gets its blocks then, as it would have when all were decided

Two rules hold in every phase where arming is automatic (`tune_after_calls` is an int): the end of whole call
number `tune_after_calls` arms, even where the phase moved on before it (every component decided at
registration, from the cache or kept eager by offload); and the end of a whole call that recorded input shapes no
route serves (a new shape family) arms again, so that the next call tunes them. With `tune_after_calls=None`
nothing here arms: `aitune.tune()` does.

Where no whole call is ever seen (sentence-transformers calls the model's `forward` itself), the first target
called outside one marks the object's calls (`observe`): its call number `tune_after_calls + 1` arms before it
runs (RECORDING -> ARMED), as the end of whole call `tune_after_calls` would have.

The end-to-end quality gate of reduced precision, and the checks of new shapes a whole call leaves to a replay of
it, are `hf/gate.py`'s.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Callable, Iterator

from aitune_hf.core.registration import Registration
from aitune_hf.core.target import TargetState

#: Arming is reported on the mixin's logger, where it always was (users and docs filter on it).
logger = logging.getLogger("aitune_hf.hf.mixin")

#: With tune_after_calls=None and no whole call seen: calls after which a warning says nothing tunes until tune().
MANUAL_WARNING_CALLS = 8


class Phase(enum.Enum):
    """Where an object's whole calls stand (the module docstring says when each move happens)."""

    RECORDING = "recording"  # targets record; the end of call `tune_after_calls` arms (None: only tune() arms)
    ARMED = "armed"  # armed by the schedule: calls tune until every target is decided
    DESCENDED = "descended"  # targets="auto": eager components gave way to their blocks; the next call's end arms
    SERVING = "serving"  # the schedule has nothing left to arm but new shapes

    def __str__(self) -> str:
        return self.value


_P = Phase
_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    _P.RECORDING: frozenset({_P.ARMED, _P.DESCENDED, _P.SERVING}),
    _P.ARMED: frozenset({_P.DESCENDED, _P.SERVING}),
    _P.DESCENDED: frozenset({_P.SERVING}),
    _P.SERVING: frozenset({_P.DESCENDED}),
}


class Schedule:
    """The whole-call state machine of one object (`Phase`): it counts whole calls, arms its `registration`, and
    runs the end-to-end quality gate.

    Args:
        registration: what it arms (`Registration.tune`).
        owner: the object's class name, for the log.
        tune_after_calls: the whole call whose end arms; None: only `aitune.tune()` arms.
        auto: targets="auto": once every component is decided, the mixin gives those that stayed eager on a shape
            family their blocks as targets beneath them (the `descend` given to `arm_after`), and the end of the next
            call arms them.
    """

    def __init__(self, registration: Registration, owner: str, tune_after_calls: int | None, auto: bool) -> None:
        self.registration = registration
        self.owner = owner
        self.tune_after_calls = tune_after_calls
        self.auto = auto
        # Reduced precision serves only once a whole call that met it, replayed, passes its budget (`hf/gate.py`).
        registration.gate_required = registration.config.reduced
        self._phase = Phase.RECORDING
        self._calls = 0  # whole calls ended
        self._descended_at = 0  # the whole call at whose end the phase became DESCENDED
        self._marker: str | None = None  # with no whole call seen: the target whose calls count as the object's
        self._outside_calls = 0  # calls of `_marker` outside any whole call
        self._lock = threading.Lock()  # whole calls may come from many threads: each count is seen by one
        self._descending = threading.Lock()  # one descent at a time (whole calls ending on many threads)
        self._inside = threading.local()  # `.depth`: this thread is in a whole call

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def calls(self) -> int:
        """Whole calls ended so far."""
        return self._calls

    @property
    def automatic(self) -> bool:
        """True when the schedule arms by itself (`tune_after_calls` is an int), False when only tune() arms."""
        return self.tune_after_calls is not None

    def _move(self, to: Phase) -> None:
        if to is not self._phase and to not in _TRANSITIONS[self._phase]:
            raise AssertionError(f"{self.owner}: no whole-call transition {self._phase} -> {to}")
        self._phase = to

    # -- the boundary ------------------------------------------------------------------------------------
    @property
    def in_whole_call(self) -> bool:
        """True while this thread is inside a whole call (or a measurement): nested boundaries are part of it."""
        return bool(getattr(self._inside, "depth", 0))

    @contextlib.contextmanager
    def whole_call(self) -> Iterator[None]:
        """Mark this thread as inside a whole call for the duration of the block."""
        self._inside.depth = 1
        try:
            yield
        finally:
            self._inside.depth = 0

    # -- a whole call ends ------------------------------------------------------------------------------
    def call_ends(self) -> int:
        """Count a whole call that ended; returns its number (each number is returned to exactly one thread)."""
        with self._lock:
            self._calls += 1
            return self._calls

    def arm_after(self, calls: int, descend: Callable[[], bool]) -> None:
        """Move on after whole call number `calls` (from `call_ends`) and arm where the phase or a rule says so.

        `descend` (targets="auto") adds the blocks of the components that stayed eager on a shape family beneath
        them, and says whether it added any; it runs when every component is decided, before this call's arming (which
        arms the new blocks too), and again at the end of each later call while SERVING: the search after a first plan
        may put eager back on a component whose plan served (its blocks then record in the next call, and tune after
        it on the worker)."""
        registration = self.registration
        with self._lock:  # one thread moves the phase at a time; descend and tune run outside the lock
            descends = False
            if self._phase in (Phase.RECORDING, Phase.ARMED) and registration.all_tuned:
                descends = self.auto
                self._move(Phase.DESCENDED if descends else Phase.SERVING)
                if descends:
                    self._descended_at = calls
        if descends:
            with self._descending:
                descend()
        with self._lock:
            due = self._phase is Phase.DESCENDED and calls > self._descended_at  # the call after the descent
            if due:
                self._move(Phase.SERVING)
            if calls == self.tune_after_calls and self._phase is Phase.RECORDING:
                self._move(Phase.ARMED)
            later = not descends and self.auto and self._phase is Phase.SERVING and registration.all_tuned
        if later:  # a component the search put back to eager since: its blocks record in the next call
            with self._descending:
                if descend():
                    with self._lock:
                        self._move(Phase.DESCENDED)
                        self._descended_at = calls
        # Once every target was decided (SERVING, or DESCENDED), what arms tunes on the worker: no call tunes inside
        # itself after `all_tuned` (the blocks a descent added, new shape families); a re-tune after a change the user
        # made (a LoRA scale, a weight edit) still tunes in the call that meets it (`Target._changed`).
        off_thread = self._phase is not Phase.RECORDING and self._phase is not Phase.ARMED
        if calls == self.tune_after_calls:
            registration.tune(f"whole call {calls} of {self.owner} done (tune_after_calls={calls})", off_thread)
        elif due and self.automatic:
            registration.tune(f"whole call {calls} of {self.owner} done (re-armed to tune what changed)", off_thread)
        elif self._new_shapes_waiting():
            registration.tune(f"new input shapes recorded in whole call {calls} of {self.owner}", off_thread)

    def _new_shapes_waiting(self) -> bool:
        """True when a decided target has recorded calls to tune (a new shape family, a shape its build does not cover,
        or a changed module state where `retune` allows: `Target.has_calls_to_tune`), or a target kept whole over its
        blocks and not tuning has recorded calls (it records a call only once its blocks served all of it): with
        automatic arming, the next call tunes them."""
        if not self.automatic:
            return False
        return any(
            (t.decided and t.has_calls_to_tune) or (t.inner and t.state is TargetState.RECORDING and t.samples)
            for t in self.registration.targets.values()
        )

    # -- no whole call seen ---------------------------------------------------------------------------------
    def observe(self, target: str) -> None:
        """The observer of every routed call (`Registration.observe_calls`): arming when no whole call is seen,
        because the object's forwards are driven from elsewhere (sentence-transformers calls `model.forward(...)`
        itself; a user's own denoising loop calls the UNet).

        Until the object sees a whole call, the first target called outside one marks the object's calls. Its call
        number `tune_after_calls + 1` arms every target before it runs, so tuning happens inside that call, as it
        would at the start of the whole call after `tune_after_calls` whole calls; each later call of it arms again
        when calls of new shapes are waiting (as each whole call does). Once the object has seen a whole call, whole
        calls arm and this observer removes itself. With `tune_after_calls=None`, one warning after
        `MANUAL_WARNING_CALLS` calls says that nothing tunes until `aitune.tune()` is called."""
        registration = self.registration
        if self._calls:  # whole calls are seen (they arm): off the hot path from the first call after one
            registration.observe_calls(None)
            return
        marker = self._marker  # read without the lock: only the marker's calls count (every target's call comes here)
        if (marker is not None and target != marker) or self.in_whole_call or registration.bypassed:
            return
        with self._lock:
            if self._marker is None:
                self._marker = target
            if target != self._marker:
                return
            self._outside_calls += 1
            count = self._outside_calls
            after = self.tune_after_calls
            first = after is not None and count == after + 1
            if first and self._phase is Phase.RECORDING:
                self._move(Phase.ARMED)
        if after is None:
            if count == MANUAL_WARNING_CALLS:
                registration.observe_calls(None)
                if not any(t.armed or t.decided for t in registration.targets.values()):
                    logger.warning(
                        "aitune_hf on %s: %d calls recorded and nothing tunes: it was enabled with "
                        "tune_after_calls=None, so tuning waits for .aitune.tune()",
                        self.owner,
                        count,
                    )
        elif first:
            logger.info(
                "aitune_hf on %s: no whole call seen (its forwards are called directly); arming at call %d of %s",
                self.owner,
                count,
                target,
            )
            registration.tune(f"call {count} of {target} (tune_after_calls={after})")
        elif count > after + 1 and self._new_shapes_waiting():
            off_thread = self._phase is not Phase.RECORDING and registration.all_tuned
            registration.tune(f"new input shapes recorded in call {count} of {target}", off_thread)
