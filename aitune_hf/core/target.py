"""`Target`: one registered module, its forward router, and its state machine.

States (`TargetState`, the one source of truth, changed only through `Target._move`):

    RECORDING --arm--> ARMED --next call--> TUNING --> TUNED | EAGER | RECORDING (no evidence yet)
    TUNED / EAGER --arm (tune(), or a guard failure with `retune`)--> ARMED
    any --detach--> DETACHED;  any --pin_eager--> EAGER (for good)

Routes (`core/routes.py`): after tuning, each input signature has routes, each a backend built in one module state,
behind a `ModuleGuard` that says whether that state still holds. Where a decision comes from (an identical sibling,
the cache, or a new tuning) is `core/sourcing.py`'s. A call is served by the first route of its signature whose
guard holds. When none holds, the module state changed since the route was built (a LoRA scale, FreeU, an adapter,
an edited weight): the call runs eager at once, is recorded, and with `config.retune` the target re-tunes at its
next call, adding a route for the new state. Routes per target are bounded by `config.max_routes`; beyond that,
calls in new states run eager and the report says why.

Tuning is contained: only KeyboardInterrupt / SystemExit leave it. Anything else that goes wrong while
recording, computing references, building, checking or timing leaves the signature eager with the reason,
and the user's call returns the eager output.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import enum
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C._dynamo.eval_frame import set_eval_frame  # what torch.compiler.disable calls around a function

from aitune_hf.backends.base import Backend, Started, running_on_the_worker
from aitune_hf.core.checks import compare_outputs
from aitune_hf.core.context import TuningContext
from aitune_hf.core.decisions import Decision
from aitune_hf.core.guards import ModuleGuard
from aitune_hf.core.precision import block_budget, less_reduced
from aitune_hf.core.reasons import details, summarize
from aitune_hf.core.report import ModuleReport, SignatureReport
from aitune_hf.core.rng import DrawsRandomNumbers
from aitune_hf.core.routes import Route
from aitune_hf.core.signature import (
    InputSignature,
    Sample,
    ShapeFamily,
    call_context,
    describe_family,
    signature_of,
    training_reason,
)
from aitune_hf.core.slots import ForwardSlot, all_slots, locate_slot
from aitune_hf.core.sourcing import Sourcing
from aitune_hf.core.strategy import NoEvidence, TuningJob
from aitune_hf.core.timing import Stopwatch, clock
from aitune_hf.errors import UsageError

logger = logging.getLogger(__name__)

#: Guard failures kept per target for the report (most recent last).
_CHANGES_KEPT = 5
#: Recorded calls of a family's one shape (the call that tunes included) from which, with anytime tuning, its first
#: builds are made for that shape (`Target._builds_family`): a shape met in two calls besides the one that tunes (a
#: denoising loop's block, a text encoder called for the prompt and the negative prompt) is the shape calls keep.
_SHAPE_KEPT_AFTER = 3
#: Shapes remembered as rejected by a polymorphic build (beyond it, they are checked again).
_REJECTED_KEPT = 1024
#: What `Target._check_new_shape` returns when no polymorphic route covers a call.
_NOT_COVERED = object()
#: Why reduced-precision candidates are unavailable to a target whose reduced-precision decision failed the gate.
_DEMOTED = "reduced precision failed the end-to-end quality gate here: this block tunes in fp32"


class _TuningLock:
    """One tuning at a time in the process: torch.export and Dynamo tracing hold process-wide state (flags such as
    `torch.compiler.is_compiling()`, patched module calls).

    A caller's tuning comes first: one that finds another caller tuning runs its call eager (and tunes at a later
    call), but one that finds the worker tuning (`tune_in_background`) or searching (a step of the search after a
    first plan, `core/refine.py`) waits for that to end, and no work on a worker starts while a caller waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._turns = threading.Condition(threading.Lock())
        self._callers_waiting = 0
        self._worker = False  # the holder is a worker (a tuning or a search step there), not a caller

    def caller(self) -> bool:
        """For a caller's call: True once held; False where another caller tunes now."""
        if self._lock.acquire(blocking=False):
            self._worker = False
            return True
        if not self._worker:
            return False
        with self._turns:
            self._callers_waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._turns:
                self._callers_waiting -= 1
                self._turns.notify_all()
        self._worker = False
        return True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold it on a worker (a tuning, or a step of a search): once no caller waits for it."""
        while True:
            with self._turns:
                self._turns.wait_for(lambda: self._callers_waiting == 0)
            self._lock.acquire()
            if self._callers_waiting == 0:
                break
            self._lock.release()  # a caller came to wait meanwhile: it goes first
        self._worker = True
        try:
            yield
        finally:
            self._worker = False
            self._lock.release()

    def release(self) -> None:
        self._worker = False
        self._lock.release()


_TUNING = _TuningLock()


class TargetState(str, enum.Enum):
    """Where a target is in its life."""

    RECORDING = "recording"
    ARMED = "armed"
    TUNING = "tuning"
    TUNED = "tuned"
    EAGER = "eager"
    DETACHED = "detached"

    def __str__(self) -> str:
        return self.value


_S = TargetState
#: The transitions `Target._move` allows (to the same state is always allowed).
_TRANSITIONS: dict[TargetState, frozenset[TargetState]] = {
    _S.RECORDING: frozenset({_S.ARMED, _S.EAGER, _S.DETACHED}),
    _S.ARMED: frozenset({_S.TUNING, _S.TUNED, _S.EAGER, _S.RECORDING, _S.DETACHED}),
    _S.TUNING: frozenset({_S.TUNED, _S.EAGER, _S.RECORDING, _S.ARMED, _S.DETACHED}),
    _S.TUNED: frozenset({_S.ARMED, _S.EAGER, _S.RECORDING, _S.DETACHED}),
    _S.EAGER: frozenset({_S.ARMED, _S.TUNED, _S.RECORDING, _S.DETACHED}),
    _S.DETACHED: frozenset({_S.RECORDING}),  # only to undo a failed descend()
}


class _ForwardRouter:
    """The callable that sits in the forward slot; after detach it is a plain pass-through.

    A copy of a module (`copy.deepcopy`, pickle, `torch.save`) gets the eager forward in its place, never
    this router: a copy is never served by the original's built backends.

    Under a user's `torch.compile` (of the model, of a forward, or Diffusers' `compile_repeated_blocks()`), Dynamo
    never traces into a router (`_outside_compile`): the outer graph breaks at each target and the router runs as
    it does outside a compile (docs/guarantees.md).
    """

    _aitune_guard_opaque = True  # guards compare the router by identity, never its state

    def __init__(self, target: Target, original: Callable[..., Any]) -> None:
        self._target = target
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        prior = set_eval_frame(None)  # Dynamo's frame hook off: nothing the call runs is compiled by the user's compile
        try:
            return self._target.call(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    # What `torch.compiler.disable` marks: Dynamo graph-breaks at a call of it instead of tracing into it (its
    # SkipFunctionVariable). `torch.compiler.disable` itself is not used: while any thread exports (torch.export sets
    # a process-wide flag), its wrapper writes into torch.fx's global node metadata on every call, from every thread;
    # threads serving while another one tuned raced on it (KeyError: 'custom') and could mark the exporting thread's
    # graph. Tests: tests/hf/test_threads.py (the race), tests/core/test_world.py and tests/hf/test_world.py (compile).
    __call__._torchdynamo_disable = True  # type: ignore[attr-defined]

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self._target.original_forward, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._target.original_forward.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"<aitune_hf forward router of {self._target.name!r} ({self._target.state})>"


class Target:
    """One registered module. Created and installed by `register`; read through `Registration`."""

    _aitune_guard_opaque = True  # guards compare it by identity, never its state

    def __init__(self, name: str, module: torch.nn.Module, context: TuningContext) -> None:
        self.name = name
        self.module = module
        self._context = context
        self._state = TargetState.RECORDING
        self._reason: str | None = None
        #: The decision that keeps this target eager for good (source "pinned", set once): it cannot be tuned where it
        #: stands. Per-signature decisions live in the routes.
        self._pinned: Decision | None = None
        self._why = "tune() was called"  # why it was armed last, logged when its tuning starts
        self._off_thread = False  # armed to tune on the worker, not in a caller's call (`arm`)
        self._no_evidence: str | None = None  # why the last tuning found no sample to check against
        self._restrictions: list[tuple[Callable[[Backend], bool], str]] = []
        #: Recorded calls not yet tuned, by signature.
        self.samples: dict[InputSignature, list[Sample]] = {}
        self.sample_bytes = 0
        self.calls_recorded = 0
        self.signatures_over_limit = 0  # calls of signatures beyond config.max_signatures (run eager)
        self.tuning_seconds = 0.0
        self.calls_served: dict[str, int] = {}
        #: Calls routed, and those of them that came right after this target's previous call ended (`back_to_back`);
        #: `_ended_at` is the registration's count of started calls when this target's latest call ended.
        self.calls_seen = 0
        self.calls_back_to_back = 0
        self._ended_at = -1
        #: Why the latest call ran in training mode (`signature.training_reason`), until a call is served again.
        self.training: str | None = None
        #: What the end-to-end gate sent back, for the report of the fp32 decision tuned in its place.
        self._demoted: str | None = None
        #: What changed, for the most recent guard failures.
        self.changes: collections.deque[str] = collections.deque(maxlen=_CHANGES_KEPT)
        self._routes: dict[InputSignature, list[Route]] = {}
        #: Polymorphic routes by shape family: a call of a new shape they cover is checked once, then served.
        self._families: dict[ShapeFamily, list[Route]] = {}
        #: (signature, route) pairs whose one-time check failed: those calls run eager without a second check.
        self._rejected: set[tuple[InputSignature, int]] = set()
        #: New shapes whose check a whole call left to a replay off its thread (`CallNotes.defer`): eager until then.
        self._pending: set[InputSignature] = set()
        #: Recorded calls per signature (the hottest shapes of a family are the ones timed).
        self._recorded_by_signature: collections.Counter[InputSignature] = collections.Counter()
        self._slot: ForwardSlot | None = None
        self._original: Callable[..., Any] | None = None
        self._router: _ForwardRouter | None = None
        #: Targets for blocks inside this one, where it is kept whole over them (`regarding`): calls no route of its own
        #: serves run its forward with its blocks routing their own calls, and its candidates are timed against that.
        self.inner: tuple[Target, ...] = ()
        #: A whole model (a pipeline's or a wrapper's component, marked by `aitune_hf.hf`), not a block of one: anytime
        #: tuning tries its quick builds first (`Backend.build_cost`: OpenVINO whole through its trace door, the
        #: peer's own path, with no ONNX export to wait for: a whole MiniLM's took 8-10 s on an Ice Lake Xeon).
        self.whole = False
        #: Kept whole over its blocks only to measure the whole against them (`targets="blocks"` with
        #: `compare_whole=True`): a decision the whole wins is reported (`SignatureReport.measured_whole`), not served.
        self.measure_only = False
        #: Held while state, samples or routes change, and while this target tunes.
        self._lock = threading.RLock()

    # -- state --------------------------------------------------------------------------------------
    @property
    def state(self) -> TargetState:
        return self._state

    @property
    def reason(self) -> str | None:
        """Why the target is eager (or why tuning has nothing to work with yet), else None."""
        return self._reason

    def _move(self, to: TargetState, reason: str | None = None) -> None:
        if to is not self._state and to not in _TRANSITIONS[self._state]:
            raise AssertionError(f"{self.name}: no transition {self._state} -> {to}")
        self._state, self._reason = to, reason

    @property
    def armed(self) -> bool:
        """True when the target tunes at its next forward call."""
        return self._state is TargetState.ARMED

    @property
    def decided(self) -> bool:
        """True once the target reached TUNED or EAGER."""
        return self._state in (TargetState.TUNED, TargetState.EAGER)

    @property
    def has_calls_to_tune(self) -> bool:
        """True when it holds recorded calls a schedule may arm it for: of a signature none of its routes was built for
        (a new shape, a new shape family), or, where `retune` allows, of a routed signature whose guard failed (the
        module changed since). With `retune=False` those wait for `tune()`: the schedule had re-tuned every changed
        model on the worker."""
        if self._context.config.retune:
            return bool(self.samples)
        return any(signature not in self._routes for signature in list(self.samples))

    @property
    def idle(self) -> bool:
        """True while the target has never been called (since registration): a VAE's encoder stages in a pipeline
        that never encodes. `Registration.all_tuned` does not wait for idle targets."""
        return not self.calls_served and not self._routes and not self.samples and self._pinned is None

    @property
    def routes(self) -> tuple[Route, ...]:
        """Every route this target holds now, over all its signatures (a snapshot, for reading)."""
        return tuple(route for routes in self._routes.values() for route in routes)

    @property
    def pinned_reason(self) -> str | None:
        """Why this target is kept eager for good, or None."""
        return self._pinned.reason if self._pinned is not None else None

    # -- installation -------------------------------------------------------------------------------
    def install(self) -> None:
        """Put the router in the module's innermost forward slot."""
        self._slot = locate_slot(self.module)
        self._original = self._slot.read()
        self._router = _ForwardRouter(self, self._original)
        self._slot.write(self._router)
        if self._state is TargetState.DETACHED:
            self._move(TargetState.RECORDING)

    def uninstall(self) -> None:
        """Take the router out wherever hooks have moved it; it stays a pass-through if it is still held."""
        with self._lock:
            self._uninstall()

    def _uninstall(self) -> None:
        if self._router is not None and self._slot is not None and self._original is not None:
            if self._slot.read() is self._router:
                self._slot.restore(self._original)
            else:
                for slot in all_slots(self.module):
                    if slot.read() is self._router:
                        slot.write(self._original)
                        break
        self._move(TargetState.DETACHED)
        self._clear_routes()
        self.samples.clear()
        self.sample_bytes = 0

    def _clear_routes(self) -> None:
        """Drop every route, and with them what the built backends hold (sessions, compiled graphs)."""
        self._routes = {}
        self._families = {}
        self._rejected.clear()
        self._pending.clear()
        self._recorded_by_signature.clear()

    @property
    def original_forward(self) -> Callable[..., Any]:
        """The forward that was in the slot before the router: the eager path."""
        assert self._original is not None
        return self._original

    @property
    def slot_description(self) -> str:
        return self._slot.description if self._slot else "-"

    # -- control ------------------------------------------------------------------------------------
    def arm(self, why: str = "tune() was called", off_thread: bool = False) -> None:
        """Tune at the next forward call that no route can serve, in the module state of that call: recorded
        signatures without a route, and states that changed since a route was built. A decided target with
        nothing recorded has nothing to tune and stays as it is. `why` is logged when the tuning starts. With
        `off_thread` (the Hugging Face layer's arming once every target was decided), that call does not tune: it runs
        eager, and the registration's worker tunes (`tune_in_background`)."""
        with self._lock:
            if self._state is TargetState.DETACHED:
                raise UsageError(f"target {self.name!r} is detached; register it again to tune it")
            if self._pinned is not None or self._state is TargetState.TUNING:
                return
            if self.decided and not any(self.samples.values()):
                return
            self._why = why
            self._off_thread = off_thread or self.measure_only  # a measurement serves nothing: never in a call
            self._move(TargetState.ARMED, self._reason)
            worker = self._context.worker() if self.measure_only and self.samples else None
        if worker is not None:  # what it measures is recorded: the worker starts now, not at its next call
            worker.submit(self)

    def pin_eager(self, reason: str) -> None:
        """Keep this target eager for good (it cannot be tuned where it stands); `reason` is reported."""
        self._pinned = Decision.pinned(reason)
        self._clear_routes()
        self.samples.clear()
        self.sample_bytes = 0
        self._move(TargetState.EAGER, reason)

    def restrict(self, allow: Callable[[Backend], bool], reason: str) -> None:
        """Only backends for which `allow(backend)` holds may serve this target; the others are reported
        unavailable with `reason` (e.g. weight-baking backends where an offload hook moves the weights)."""
        self._restrictions.append((allow, reason))

    def unavailable_reason(self, backend: Backend) -> str | None:
        """Why this target rules `backend` out, or None."""
        return next((reason for allow, reason in self._restrictions if not allow(backend)), None)

    # -- the forward path ---------------------------------------------------------------------------
    def call(self, *args: Any, **kwargs: Any) -> Any:
        """Route one forward call (from any thread), noting whether it came back to back with this target's last
        (`back_to_back`)."""
        context = self._context
        started = context.calls_started
        self.calls_seen += 1
        if started == self._ended_at:
            self.calls_back_to_back += 1
        context.calls_started = started + 1
        try:
            return self._route(*args, **kwargs)
        finally:
            self._ended_at = context.calls_started

    @property
    def back_to_back(self) -> bool:
        """True when most of this target's calls came right after its previous one ended, no other target's call
        between (a decode step of `generate()`, a component called at every denoising step; never a block among its
        siblings): its weights stay warm in the CPU's caches from one call to the next, and its candidates are timed
        so (`TuningJob.back_to_back`)."""
        return 2 * self.calls_back_to_back > self.calls_seen

    def _route(self, *args: Any, **kwargs: Any) -> Any:
        state = self._state
        context = self._context
        # While it tunes (in this thread or another), the module runs eager: backends build without touching it
        # (`Backend.build`), so other threads never wait for a tuning.
        if state in (TargetState.TUNING, TargetState.DETACHED) or self._pinned is not None or context.bypassed():
            if state is TargetState.TUNING:
                context.note_off_route()
            return self.original_forward(*args, **kwargs)
        observer = context.on_call
        if observer is not None:
            observer(self.name)
            state = self._state  # the observer may have armed this target
        signature = signature_of(args, kwargs)
        started = self._start(signature, args, kwargs)
        try:
            route, change = self._lookup(signature)
        except BaseException:
            if started is not None:
                _drop(started[1])
            raise
        if started is not None and started[0] is not route:  # its guard failed: its output is not wanted
            _drop(started[1])
            started = None
        if route is None:
            training = training_reason(self.module)
            if training is not None:  # dropout is live: nothing to record, tune or check; eager, as the module is
                self.training = training
                self._count("eager")
                context.note_off_route()
                return self.original_forward(*args, **kwargs)
        if self.training is not None:
            self.training = None
        if started is not None:
            return self._serve(signature, route, args, kwargs, started[1])
        if route is None and self._families:  # a new shape (or state) that a polymorphic build may cover
            checked = self._check_new_shape(signature, args, kwargs)
            if checked is not _NOT_COVERED:
                return checked
        if route is None and (notes := context.notes()) is not None and notes.replay:
            self._count("eager")  # a replay of a whole call (a check, the gate): it records and tunes nothing
            context.note_off_route()
            return self.original_forward(*args, **kwargs)
        held: Sample | None = None  # kept whole over its blocks: a call recorded once its blocks had routes for it
        if route is None:
            context.note_off_route()
            with self._lock:
                if change is not None:
                    self._changed(change)
                if self._accepts_samples(signature):
                    if self.inner:
                        held = self._capture(args, kwargs)
                    else:
                        self._record(signature, args, kwargs)
            if state is TargetState.ARMED:  # armed, and no route for this call
                background = context.background or (context.worker() if self._off_thread else None)
                if background is not None:  # no call waits for a tuning: the worker tunes, this call runs eager
                    background.submit(self)
                elif self._tune_if_free():
                    route, _ = self._lookup(signature)
                    if route is None and held is not None and self._families:  # what it just built may cover the call
                        checked = self._check_new_shape(signature, args, kwargs)
                        if checked is not _NOT_COVERED:
                            return checked
        if route is not None and route.built is not None:
            return self._serve(signature, route, args, kwargs)
        self._count("eager")
        if held is None:
            return self.original_forward(*args, **kwargs)
        before = context.off_route()
        output = self.original_forward(*args, **kwargs)  # its blocks route their own calls
        # Every block call inside was served by a route (its blocks decided it): a sample, unless the worker tunes this
        # target now (it holds the lock for the whole tuning: the caller never waits for it; a later call records).
        if context.off_route() == before and self._lock.acquire(blocking=False):
            try:
                self._record(signature, args, kwargs, held)
            finally:
                self._lock.release()
        return output

    def _capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sample | None:
        """A copy of this call's inputs, taken before it runs (a forward may change what it is given); None where it
        cannot be taken (`_record` says why)."""
        try:
            return Sample.capture(args, kwargs)
        except Exception:
            return None

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        """Eager's output, the reference a build is checked against: for a target kept whole over its blocks, with
        its blocks eager too (not as they serve, which is within tolerance of eager, not eager)."""
        if not self.inner:
            return self.original_forward(*args, **kwargs)
        with self._context.bypass():
            return self.original_forward(*args, **kwargs)

    def _through_blocks(self, *args: Any, **kwargs: Any) -> Any:
        """The eager side a target kept whole over its blocks is timed against: its forward with its blocks served."""
        with self._context.served():
            return self.original_forward(*args, **kwargs)

    @contextlib.contextmanager
    def regarding(self, inner: list[Target]) -> Iterator[None]:
        """Keep this target whole over `inner`, targets for blocks inside it that the block installs (`Registration.
        descend(keep=True)`). Its routes were guarded without the blocks' routers in their forward slots: each route
        whose guard holds before is guarded again once they are in (the same state, routers aside); a route whose
        guard fails now is dropped (its state is gone)."""
        with self._lock:
            held = {id(route): route.holds() is None for route in self.routes}
            fallbacks = {
                id(route): route.fallback[2].check() is None for route in self.routes if route.fallback is not None
            }
            yield
            config = self._context.config

            def regard(guard: ModuleGuard) -> ModuleGuard:
                return ModuleGuard(self.module, weights=guard.weights is not None, weight_check=config.weight_check)

            for route in self.routes:
                if held.get(id(route)):
                    route.guard = regard(route.guard)
                if route.fallback is not None:
                    backend, built, guard = route.fallback
                    route.fallback = (backend, built, regard(guard)) if fallbacks.get(id(route)) else None
            self._routes = {sig: kept for sig, rs in self._routes.items() if (kept := [r for r in rs if held[id(r)]])}
            self._families = {
                family: kept for family, rs in self._families.items() if (kept := [r for r in rs if held[id(r)]])
            }
            self.inner = tuple(inner)

    def _tune_if_free(self) -> bool:
        """Tune now unless another thread is tuning (any target): then this call runs eager and the target
        stays armed. One tuning at a time in the process: torch.export and Dynamo tracing hold process-wide
        state. Returns True when this call tuned."""
        if not _TUNING.caller():
            return False
        try:
            with self._lock:
                if self._state is not TargetState.ARMED:  # another thread tuned it meanwhile
                    return True
                self._tune()
            return True
        finally:
            _TUNING.release()

    def tune_in_background(self, tuner: Any) -> None:
        """Tune now, on the background worker (`core/background.py`): waits for any tuning in the process to end. Only
        backends that build from a private copy of the module take part (`_private_builds_only`)."""
        with _TUNING.held(), self._lock:
            if self._state is TargetState.ARMED:
                self._tune()

    def refine_in_background(self, refinement: Any) -> None:
        """A step of the search after this target's first plan (`core/refine.py`), on the worker: its first waits for
        the callers' tunings to end; each holds the process's tuning lock (not this target's: calls keep being served),
        and queues the next step behind what waits on the worker."""
        worker = self._context.worker()
        checks = (lambda: worker.checks_waiting) if worker is not None else (lambda: False)
        more = refinement.step(self._context.quiet, _TUNING.held, checks)
        if more:
            self._context.search(self, refinement)

    def serves(self, route: Route) -> bool:
        """True while `route` is one of this target's routes, its guard holds and it waits for no gate."""
        return any(r is route for r in self.routes) and not route.provisional and route.holds() is None

    def replace_route(self, old: Route, decision: Decision) -> Route | None:
        """Serve `decision` (the search after a first plan found it faster) where `old` serves, for the same shapes in
        the same module state; None where `old` is gone (a guard failure, the gate, `detach`). Where the end-to-end
        gate is required and it computes in reduced precision, it waits for the gate (`provisional`) with `old` serving
        meanwhile (`Route.replaces`), and `old` comes back if the gate fails it. An eager decision (the first plan
        timed slower than eager) covers the shapes `old` covered, in `old`'s module state."""
        backend, built = decision.backend, decision.built
        with self._lock:
            if not any(r is old for r in self.routes):
                return None
            if backend is None:
                wide = old.family_wide or (old.built is not None and old.built.dynamic_dims is not None)
                route = Route(None, None, decision.report, old.guard, old.reference, wide)
                route.served = old.served
                self._swap(old, route)
                logger.info("%s: eager replaces %s (the search after the first plan: %s)", self.name,
                            old.report.first_plan or "?", decision.report.reason)  # fmt: skip
                return route
            assert built is not None and decision.guard is not None
            route = Route(backend, built, decision.report, decision.guard, old.reference, old.family_wide)
            route.served = old.served
            if backend.precision != "fp32":
                route.fallback, route.fp32_lost = decision.fallback, decision.fp32_lost
                if self._context.gate_required:
                    route.provisional, route.replaces = True, old
                    route.fallback = None if old.built is None or old.backend is None else (
                        old.backend, old.built, old.guard)  # fmt: skip
            self._swap(old, route)
            waits = " once the gate passes it" if route.provisional else ""
            logger.info("%s: %s replaces %s (the search after the first plan)%s", self.name, backend.describe(),
                        old.report.first_plan or "?", waits)  # fmt: skip
            return route

    def _swap(self, old: Route, new: Route) -> None:
        """Put `new` in every place of `old` (copy on write: other threads read the tables without the lock)."""
        self._routes = {sig: [new if r is old else r for r in rs] for sig, rs in self._routes.items()}
        self._families = {family: [new if r is old else r for r in rs] for family, rs in self._families.items()}

    def _check_new_shape(self, signature: InputSignature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of a shape that no route of its own serves, covered by a polymorphic route of its family: run
        eager, run the build on the same inputs, compare. The user gets eager's output; from then on the shape is
        served by the build (or, if it disagreed, runs eager for good). Returns `_NOT_COVERED` when no route
        covers the call (it is then recorded, as any unserved call)."""
        routes = self._families.get(signature.family, ())
        route = next(
            (
                r
                for r in reversed(routes)  # newest first: the latest module state
                # A reduced-precision route waiting for the end-to-end gate covers no new shape yet (its fp32
                # fallback serves meanwhile, and may not take the shape).
                if (signature, id(r)) not in self._rejected
                and not r.provisional
                and r.covers(signature, alike_only=bool(self.inner))
                and r.holds() is None
            ),
            None,
        )
        if route is None:
            return _NOT_COVERED
        built = route.built
        if built is None:  # eager was decided for the whole family: so for this shape too, with no check
            with self._lock:
                if route not in self._routes.get(signature, ()):
                    self._routes = {**self._routes, signature: [*self._routes.get(signature, ()), route]}
            self._count("eager")
            return self.original_forward(*args, **kwargs)
        notes = self._context.notes()
        if notes is not None and notes.defer:
            # The whole call's new shapes are checked by a replay of it off the caller's thread (`hf/gate.py`): the
            # caller pays for a plain call, not for a check (and, in reduced precision, the gate). Eager serves.
            with self._lock:
                fresh = signature not in self._pending
                self._pending.add(signature)
            if fresh:
                notes.deferred.append((self, signature))
            self._count("eager")
            return self.original_forward(*args, **kwargs)
        with Stopwatch() as watch:
            output = self._eager(*args, **kwargs)
            fell_back = built.fell_back() if built.fell_back is not None else 0
            try:
                candidate = built.fn(*args, **kwargs)
                # The same check as the build's own: a reduced-precision build by its per-block relative error
                # (the end-to-end gate accepted it on the call that tuned), fp32 by the tolerances.
                budget = block_budget(route.backend.precision) if route.backend is not None else None
                check = compare_outputs(output, candidate, self._context.config.tolerance, budget)
                failure = None if check.ok else f"wrong output: {check.reason}"
                if failure is None and built.fell_back is not None and built.fell_back() > fell_back:
                    failure = "it ran eager at this shape (e.g. Dynamo's recompile limit)"
            except Exception as error:  # a build that fails on a shape never serves it
                failure = f"raised: {summarize(error)}"
        with self._lock:
            self._pending.discard(signature)
            report = route.report
            report.shape_checks += 1
            report.shape_check_seconds += watch.seconds
            if failure is not None:
                report.shapes_rejected.append(f"{signature.short()}: {failure}")
                if len(self._rejected) >= _REJECTED_KEPT:
                    self._rejected.clear()
                self._rejected.add((signature, id(route)))
                logger.info("%s: %s disagreed at a new shape %s: %s", self.name, report.chosen, signature, failure)
            elif route not in self._routes.get(signature, ()):
                if route.backend is not None and route.backend.precision != "fp32" and self._context.gate_required:
                    # Reduced precision at a shape the end-to-end gate never saw: a block's error at a new shape can
                    # add up to more in the whole output (more rows, longer sequences). This call's end gates it.
                    route = Route(
                        route.backend,
                        built,
                        report,
                        route.guard,
                        signature,
                        provisional=True,
                        new_shape_of=route,
                        rel_error=check.rel_error,
                    )
                else:
                    route.admit(signature)
                self._routes = {**self._routes, signature: [*self._routes.get(signature, ()), route]}  # copy on write
        self._count("eager")
        return output

    def _covered(self, signature: InputSignature) -> bool:
        """True when a family route that holds (and waits for no gate) covers `signature`'s shape."""
        return any(
            r.covers(signature, alike_only=bool(self.inner)) and not r.provisional and r.holds() is None
            for r in self._families.get(signature.family, ())
        )

    def _lookup(self, signature: InputSignature) -> tuple[Route | None, str | None]:
        """The first route of `signature` whose guard holds; else (None, what changed, if it has routes)."""
        routes = self._routes.get(signature)
        if not routes:
            return None, None
        change = None
        for route in routes:
            failed = route.holds()
            if failed is None:
                return route, None
            change = change or failed
        return None, change

    def _start(
        self, signature: InputSignature, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Route, Started] | None:
        """Where the newest route of `signature` (the module state as it last changed) serves a backend that computes on
        threads of its own (`BuiltBackend.start`: OpenVINO), its call begins before any guard is checked, and `_lookup`
        checks the guards while it runs: that route and its running call; None otherwise (the call starts after its
        guard holds). Not started: a route whose guard failed when last checked (until it holds again: a state change
        costs one cancelled call, not one a call), and a reduced-precision route waiting for its gate (`_serve` may
        send the call elsewhere). States that alternate call by call cancel the calls started for the other state."""
        routes = self._routes.get(signature)
        if not routes:
            return None
        route = routes[-1]
        built = route.built
        if built is None or built.start is None or route.provisional or not route.held:
            return None
        try:
            return route, built.start(*args, **kwargs)
        except Exception:  # served the plain way, which says what raised
            return None

    def _serve(
        self,
        signature: InputSignature,
        route: Route,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        started: Started | None = None,
    ) -> Any:
        """Serve the call by `route` (its guard held), or by its fallback or eager where it waits for the gate; with
        `started`, the route's call already running (`_start`)."""
        built, chosen = route.built, route.report.chosen
        notes = self._context.notes()
        if route.provisional and notes is not None:
            notes.meet(self, route)  # the gate of this call (or its replay) is the one to judge it
        if route.provisional and (notes is None or not notes.gating):  # reduced precision waits for the gate
            if route.fallback is None:
                self._count("eager")
                return self.original_forward(*args, **kwargs)
            built, chosen = route.fallback[1], route.fallback[0].describe()
            if route.fallback[2].check() is not None:  # its own guard: the fp32 candidate may bake other state
                self._count("eager")
                return self.original_forward(*args, **kwargs)
        try:
            if started is not None:
                output = started.result()
            elif built is None:  # another thread dropped it a moment ago
                raise RuntimeError(f"{chosen} was dropped")
            else:
                output = built.fn(*args, **kwargs)
        except Exception as error:
            logger.warning("%s: %s raised while serving; falling back to eager", self.name, chosen, exc_info=True)
            with self._lock:
                if route.built is not None:
                    route.report.reason = f"{chosen} raised while serving: {summarize(error)}"
                    route.report.details = details(error)
                    route.report.chosen = "eager"
                    route.backend, route.built = None, None  # this state is served eager from now on
                    if self._state is not TargetState.ARMED:  # an armed target settles after its next tuning
                        self._settle()
            self._count("eager")
            return self.original_forward(*args, **kwargs)
        self._count(chosen)
        return output

    # -- the end-to-end gate of reduced precision (`Registration.gate`) ---------------------------------------------
    def provisional(self) -> list[Route]:
        """The reduced-precision routes waiting for the end-to-end gate."""
        return list({id(r): r for rs in self._routes.values() for r in rs if r.provisional}.values())

    @property
    def covers_new_shapes(self) -> bool:
        """True when a family route may meet a shape it was not checked on (see `_check_new_shape`)."""
        return any(r.built is not None for rs in self._families.values() for r in rs)

    def release(self, signature: InputSignature) -> None:
        """A deferred check of `signature` ended (or was dropped): a later call of it may defer a check again."""
        with self._lock:
            self._pending.discard(signature)

    def accept(self, route: Route) -> None:
        """The gate passed: the reduced-precision decision serves from now on."""
        with self._lock:
            if route.new_shape_of is not None and route.provisional and route.reference is not None:
                route.new_shape_of.admit(route.reference)
            route.provisional = False
            route.replaces = None  # a plan the search found passed: the one it replaces is let go

    def demote(self, route: Route, why: str) -> bool:
        """The gate failed with this route among the worst: its fp32 fallback serves it from now on. Where fp32 was
        tried and lost to eager (`Route.fp32_lost`), eager serves it (for its whole shape family), with no tuning
        again. Where fp32 was not tried (the reduced precision won clearly), the route is dropped and the target tunes
        again, in fp32 only: the next call of the signature runs eager and is recorded, the one after tunes.

        Where the tuning also passed a candidate of a less reduced precision that beat the fp32 fallback (int8 won,
        bf16 was next), the route is dropped and the target tunes again without the precision that failed and any
        more reduced one, in the gate's next replay, which judges the less reduced winner (`Registration.gate`).
        Measured on real MiniLM at 8 x 128 random tokens (AMD EPYC, AVX512-BF16): OpenVINO int8 won and failed the
        gate, and its fp32 fallback served at 1.17x of eager where bf16 passes at 2.2x. Returns True in that case
        (the gate replays the call again, in which the block tunes, and judges what it chose), else False."""
        with self._lock:
            reduced = route.report.chosen
            note = f"{reduced}: {why}"
            if route.replaces is not None:  # a plan the search after the first plan found: the first plan serves on
                old, route.replaces, route.provisional = route.replaces, None, False
                self._swap(route, old)
                old.report.chosen, old.report.demoted = old.report.first_plan or reduced, note
                old.report.first_plan = None
                old.report.search = (
                    f"{(old.report.search or '').rstrip('.')}; the gate failed it, the first plan serves"
                )
                return False
            if route.new_shape_of is not None:
                # A new shape of a family that serves on: this shape runs eager in this module state, and is not
                # recorded to tune again (a tuning would offer the same reduced builds, which the gate just failed).
                route.backend, route.built, route.provisional = None, None, False
                route.report.shapes_rejected.append(f"{route.reference.short()}: the end-to-end quality gate: {why}")
                return False
            failed = route.backend.precision if route.backend is not None else "fp32"
            if self._less_reduced_won(route, failed):
                self._tune_again_without(
                    route, note, lambda backend: less_reduced(backend.precision, than=failed),
                    f"{failed} failed the end-to-end quality gate here: this block tunes in less reduced precisions",
                    f"the end-to-end quality gate sent it back from {failed} ({note})",
                )  # fmt: skip
                return True
            if route.fallback is not None:
                route.backend, route.built, route.guard = route.fallback
                route.report.chosen = route.backend.describe()
                route.report.demoted = note
                route.fallback, route.provisional = None, False
                if self._state is not TargetState.ARMED:
                    self._settle()
                return False
            if route.fp32_lost is not None:
                # Measured: a MiniLM layer's fp32 candidates at 0.84-1.04x (needs 1.05x) were tuned again for 22-37 s
                # here, to reach the same eager.
                route.backend, route.built, route.guard = None, None, ModuleGuard(self.module)
                family = route.reference.family if route.reference is not None else None
                route.family_wide = any(r is route for r in self._families.get(family, ()))
                route.report.chosen = "eager"
                route.report.reason = f"{note}; fp32 lost to eager when tuned ({route.fp32_lost})"
                route.report.demoted = note
                route.fp32_lost, route.provisional = None, False
                if self._state is not TargetState.ARMED:
                    self._settle()
                return False
            self._tune_again_without(
                route, note, lambda backend: backend.precision == "fp32", _DEMOTED,
                f"the end-to-end quality gate sent it back to fp32 ({note})",
            )  # fmt: skip
            return False

    def _tune_again_without(
        self, route: Route, note: str, allow: Callable[[Backend], bool], reason: str, why: str
    ) -> None:
        """Drop `route` and arm the target to tune again with only the backends `allow` keeps (the others unavailable
        with `reason`, once). Called under the lock."""
        route.provisional = False
        self._routes = {sig: kept for sig, rs in self._routes.items() if (kept := [r for r in rs if r is not route])}
        self._families = {
            family: kept for family, rs in self._families.items() if (kept := [r for r in rs if r is not route])
        }
        self._demoted = note
        if not any(known == reason for _, known in self._restrictions):
            self.restrict(allow, reason)
        self._why = why
        self._move(TargetState.ARMED, self._reason)

    def _less_reduced_won(self, route: Route, failed: str) -> bool:
        """True when the tuning of `route` passed a candidate of a precision less reduced than `failed`, but reduced,
        that beat `min_speedup` and the fp32 fallback (what tuning again without `failed` would choose)."""
        if failed == "fp32":
            return False
        fallback = route.fallback[0].describe() if route.fallback is not None else None
        floor = max(
            [self._context.config.min_speedup]
            + [c.speedup or 0.0 for c in route.report.candidates if c.backend == fallback]
        )  # fmt: skip
        return any(
            c.error is None and c.precision != "fp32" and less_reduced(c.precision, than=failed)
            and (c.speedup or 0.0) > floor
            for c in route.report.candidates
        )  # fmt: skip

    def _count(self, backend: str) -> None:
        with self._lock:
            self.calls_served[backend] = self.calls_served.get(backend, 0) + 1

    def _route_count(self) -> int:
        """Routes built by tuning (a polymorphic route that serves many shapes counts once)."""
        return len({id(route) for routes in self._routes.values() for route in routes})

    def _changed(self, change: str) -> None:
        """A guard failed: the module changed since the signature's routes were built. Re-tune later, if allowed."""
        if not self.changes or self.changes[-1] != change:
            self.changes.append(change)
            logger.info("%s: %s; running eager until re-tuned", self.name, change)
        limit = self._context.config.max_routes
        if self._route_count() >= limit:
            return
        if self._context.config.retune and self._state in (TargetState.TUNED, TargetState.EAGER):
            self._why = f"re-tuning after a change: {change}"
            self._off_thread = False  # the caller changed the module: its next call tunes, as the first tuning did
            self._move(TargetState.ARMED, self._reason)

    def _accepts_samples(self, signature: InputSignature) -> bool:
        """Record this call? Not when it could not get a route anyway (the route bound is reached)."""
        return not (self._routes.get(signature) and self._route_count() >= self._context.config.max_routes)

    def _record(
        self, signature: InputSignature, args: tuple[Any, ...], kwargs: dict[str, Any], sample: Sample | None = None
    ) -> None:
        """Keep a copy of this call for tuning (`sample`, where it was taken before the call ran), within the sample
        bounds (config.max_sample_bytes: the most recent calls are kept; config.max_signatures: further signatures are
        counted, not kept)."""
        config = self._context.config
        self.calls_recorded += 1
        try:
            known = signature in self.samples or signature in self._routes
            if not known and len(self.samples) + self._route_count() >= config.max_signatures:
                self.signatures_over_limit += 1
                return
            self._recorded_by_signature[signature] += 1
            kept = self.samples.get(signature, [])
            if len(kept) < config.max_samples_per_signature:
                sample = sample if sample is not None else Sample.capture(args, kwargs)
                if sample.nbytes <= config.max_sample_bytes:
                    self._evict(config.max_sample_bytes - sample.nbytes)
                    self.samples.setdefault(signature, []).append(sample)
                    self.sample_bytes += sample.nbytes
        except Exception:  # recording must never break the user's call
            logger.warning("%s: could not record a call; it is not used for tuning", self.name, exc_info=True)
        if config.after_calls and self._state is TargetState.RECORDING and self.calls_recorded >= config.after_calls:
            self._why = f"{self.calls_recorded} calls recorded (trigger after_calls={config.after_calls})"
            self._move(TargetState.ARMED)

    def _evict(self, budget: int) -> None:
        """Drop samples until they take at most `budget` bytes: first the oldest of signatures that keep more
        than one, then the oldest signatures' only ones (dicts keep insertion order: oldest first)."""
        while self.sample_bytes > budget and self.samples:
            signature = next((sig for sig, kept in self.samples.items() if len(kept) > 1), None)
            if signature is None:
                signature = next(iter(self.samples))
            kept = self.samples[signature]
            self.sample_bytes -= kept.pop(0).nbytes
            if not kept:
                del self.samples[signature]

    # -- tuning -------------------------------------------------------------------------------------
    def _tune(self) -> None:
        """Tune every signature with recorded calls. Contained: only KeyboardInterrupt / SystemExit leave it,
        and they leave a working state (routes that hold keep serving; the rest runs eager)."""
        # Calls recorded while another thread was tuning may already have a route that holds, or a family route that
        # covers their shape (checked once at their next call): nothing to tune.
        for signature in [sig for sig in self.samples if self._lookup(sig)[0] is not None or self._covered(sig)]:
            self.sample_bytes -= sum(sample.nbytes for sample in self.samples.pop(signature))
        waiting = [signature for signature, kept in self.samples.items() if kept]
        # Replays must see the modes their calls saw (autocast, default dtype, ...): a signature recorded under other
        # modes waits, armed, for a call made under them.
        context = call_context()
        pending = [signature for signature in waiting if signature.context == context]
        if not pending:
            if not waiting:
                self._settle()
            return
        self._move(TargetState.TUNING)
        self._context.progress.started(self.name)
        # Tuning runs inside the caller's call, which it makes slower: say so where logging is on (INFO).
        logger.info("%s: tuning %d input signature(s) now, in this call: %s", self.name, len(pending), self._why)
        interrupted = None
        try:
            with Stopwatch() as watch:
                for group, dynamic in self._groups(pending):
                    self._decide(group, {sig: self.samples[sig] for sig in group}, dynamic, started=watch.start)
                    for signature in group:
                        del self.samples[signature]  # released once decided; kept if interrupted
                        self._recorded_by_signature.pop(signature, None)
            self.tuning_seconds += watch.seconds
            if (notes := self._context.notes()) is not None:
                notes.tuned_s += watch.seconds
            logger.info("%s: tuning took %.1f s", self.name, watch.seconds)
        except BaseException:  # KeyboardInterrupt / SystemExit: _decide contains everything else
            interrupted = "tuning was interrupted; call tune() to try again"
            raise
        finally:
            self.sample_bytes = sum(s.nbytes for kept in self.samples.values() for s in kept)
            self._settle(interrupted)
            self._context.progress.finished()
            self._context.decided_at = clock()
            self._context.decided()

    def _groups(self, pending: list[InputSignature]) -> list[tuple[list[InputSignature], bool]]:
        """The signatures to tune together, and whether as one shape family (config.shapes == "family"; calls
        that hold objects, whose sizes the signature cannot see, are tuned one signature at a time). Each group
        is ordered hottest first."""
        if self._context.config.shapes == "exact":
            return [([signature], False) for signature in pending]
        groups: dict[Any, list[InputSignature]] = {}
        for signature in pending:
            groups.setdefault(signature if signature.has_opaque_leaves else signature.family, []).append(signature)
        hottest = self._recorded_by_signature
        return [
            (sorted(group, key=lambda sig: -hottest[sig]), not group[0].has_opaque_leaves) for group in groups.values()
        ]

    def _decide(
        self,
        signatures: list[InputSignature],
        samples: dict[InputSignature, list[Sample]],
        dynamic: bool,
        started: float | None = None,
    ) -> None:
        """Add a route for `signatures` (one signature, or the shapes of one family when `dynamic`) in the current
        module state (or an eager one, with the reason). `started`: when this target's tuning began (its budget).

        Kept whole over its blocks (`inner`): references, builds and checks run with the blocks eager (a build exports
        the module as it computes, never through a router), and the candidates are timed against the forward with the
        blocks served (`_through_blocks`): the whole serves a family only where it beats its blocks."""
        with self._context.bypass() if self.inner else contextlib.nullcontext():
            self._decide_here(signatures, samples, dynamic, started)

    def _decide_here(
        self,
        signatures: list[InputSignature],
        samples: dict[InputSignature, list[Sample]],
        dynamic: bool,
        started: float | None,
    ) -> None:
        context = self._context
        described = describe_family(signatures)
        restriction = self.unavailable_reason
        # On the worker (`tune_in_background`: `core/background.py` runs each job inside `on_the_worker`), while calls
        # are served: only builds from a private copy of the module.
        off_thread = running_on_the_worker()
        if off_thread:
            restriction = self._private_builds_only
        # What the builds make: for the family, or (a family met at one shape, first tuned) for that shape alone.
        builds_family = dynamic and self._builds_family(signatures)
        try:
            job = TuningJob(
                self.module, self.original_forward, samples, context.config, restriction, builds_family, started,
                name=self.name, evidence=context.evidence, baseline=self._through_blocks if self.inner else None,
                anytime=context.config.anytime, back_to_back=self.back_to_back, whole=self.whole,
            )  # fmt: skip
        except NoEvidence as error:
            self._no_evidence = str(error)  # nothing decided: record again, tune when armed again
            logger.info("%s [%s]: %s", self.name, described, error)
            return
        except DrawsRandomNumbers as error:
            count = sum(len(kept) for kept in samples.values())
            report = SignatureReport(described, count, reason=str(error))
            self._add_route(signatures, Route(None, None, report, ModuleGuard(self.module)))
            return
        except Exception as error:
            reason = f"the eager forward raised when replayed for tuning: {summarize(error)}"
            logger.warning("%s: %s", self.name, reason, exc_info=True)
            count = sum(len(kept) for kept in samples.values())
            report = SignatureReport(described, count, reason=reason, details=details(error))
            self._add_route(signatures, Route(None, None, report, ModuleGuard(self.module)))
            return
        try:
            over = tuple(type(t.module).__qualname__ for t in self.inner)
            decision = Sourcing(self.name, self.module, self._context, restriction, over).decide(
                job, signatures, builds_family, private=off_thread
            )
        except Exception as error:
            reason = f"tuning failed: {summarize(error)}"
            logger.warning("%s: %s", self.name, reason, exc_info=True)
            decision = job.keep_eager(reason)
            decision.report.details = details(error)
        if self.measure_only and decision.backend is not None:
            decision = _measured_not_served(decision)
        logger.info("%s [%s]: %s", self.name, described, decision.report.chosen)
        # An eager decision holds for this module state too: a new state (FreeU off again) is tuned afresh.
        guard = decision.guard if decision.built is not None else ModuleGuard(self.module)
        decision.report.shapes = len(signatures)
        decision.report.calls = sum(self._recorded_by_signature[signature] for signature in signatures)
        if self._demoted is not None:  # this decision replaces a reduced-precision one the gate sent back
            decision.report.demoted, self._demoted = self._demoted, None
        family_wide = dynamic and decision.built is None
        route = Route(decision.backend, decision.built, decision.report, guard, job.signature, family_wide)
        route.served = list(signatures)
        if decision.backend is not None and decision.backend.precision != "fp32":
            route.fallback, route.provisional = decision.fallback, context.gate_required
            route.fp32_lost = decision.fp32_lost
        self._add_route(signatures, route)
        refinement = decision.refinement
        if refinement is not None and decision.backend is not None:  # anytime: the search after this first plan
            if decision.source == "tuned":
                refinement.bind(self, route)
                context.search(self, refinement)
            else:
                refinement.follow(self, route, job)

    def _builds_family(self, signatures: list[InputSignature]) -> bool:
        """Whether the builds of a shape family's tuning (`signatures`, `_groups`) are made for the whole family
        (`Backend.build(..., dynamic=True)`: a route that checks each new shape once, then serves it) or for its one
        shape. With anytime tuning, a family never tuned before whose recorded calls all had one shape, met again and
        again (`_SHAPE_KEPT_AFTER`), is first built for that shape: a SD block's export with its shapes fixed costs a
        third to a half of its family's (on an Ice Lake Xeon, SD small's first tuned call 35.8 s against 52.1 s, its
        final plan 56.0 s against 115.7 s: `benchmarks/results/anytime_icelake.md`); a pipeline at one resolution
        meets no other shape. The family's next new shape is tuned as a family, which then serves every shape after
        it; an eager decision covers the family either way. A shape met once before the call that tunes (a query's
        length) is built for its family at once, as without anytime tuning."""
        if len(signatures) > 1 or not self._context.config.anytime:
            return True
        if self._recorded_by_signature[signatures[0]] < _SHAPE_KEPT_AFTER:
            return True
        family = signatures[0].family  # every route, a family's too, is in `_routes` under the signatures it serves
        return any(signature.family == family for signature in self._routes)

    def _private_builds_only(self, backend: Backend) -> str | None:
        """The restriction of a tuning on the worker (`tune_in_background`): what the target rules out, and every
        backend that builds from the live module (Inductor compiles the module other threads are calling)."""
        reason = self.unavailable_reason(backend)
        if reason is None and not backend.builds_privately:
            reason = (
                "tuned off the callers' threads (background tuning, or a tuning after all_tuned), which builds only "
                "from a private copy of the module; this backend compiles the live module"
            )
        return reason

    def _add_route(self, signatures: list[InputSignature], route: Route) -> None:
        self._no_evidence = None
        # Copy on write: other threads read the routes without the lock.
        routes = dict(self._routes)
        for signature in signatures:
            routes[signature] = [*routes.get(signature, ()), route]
        self._routes = routes
        if route.family_wide or (route.built is not None and route.built.dynamic_dims is not None):
            family = signatures[0].family
            self._families = {**self._families, family: [*self._families.get(family, ()), route]}

    def _settle(self, note: str | None = None) -> None:
        """Leave TUNING (or re-read the routes): TUNED if a route serves, EAGER if all are eager, else RECORDING
        (with `note`, e.g. why tuning stopped)."""
        if self._pinned is not None:
            return
        routes = [route for routes in self._routes.values() for route in routes]
        if any(route.built is not None for route in routes):
            self._move(TargetState.TUNED, self._limit_reason())
        elif routes:
            reasons = {route.report.reason for route in routes if route.report.reason}
            self._move(TargetState.EAGER, "; ".join(sorted(reasons)) or None)
        elif self._no_evidence is not None:
            self._move(TargetState.EAGER, self._no_evidence)
        else:
            self._move(TargetState.RECORDING, note)

    def _limit_reason(self) -> str | None:
        limit = self._context.config.max_routes
        if self._route_count() >= limit and self.changes:
            return (
                f"{limit} routes built (max_routes); calls in a new module state run eager "
                f"(last change: {self.changes[-1]})"
            )
        return None

    # -- reporting ----------------------------------------------------------------------------------
    def report(self) -> ModuleReport:
        """A fresh ModuleReport of this target."""
        return ModuleReport(
            name=self.name,
            module_class=type(self.module).__name__,
            state=str(self._state),
            reason=self._reason or self._limit_reason(),
            # The latest decision per signature (routes built for earlier module states still serve those).
            signatures=list({id(r.report): r.report for r in (rs[-1] for rs in self._routes.values() if rs)}.values()),
            tuning_seconds=self.tuning_seconds,
            calls=dict(self.calls_served),
            changes=list(self.changes),
            routes=self._route_count(),
            signatures_over_limit=self.signatures_over_limit,
            idle=self.idle,
            training=self.training,
            blocks=[t.name for t in self.inner],
            measure_only=self.measure_only,
        )

    def __repr__(self) -> str:
        return f"Target({self.name!r}, {type(self.module).__name__}, state={self._state})"


def _measured_not_served(decision: Decision) -> Decision:
    """A whole that beat its blocks, where it is only measured (`Target.measure_only`): eager (the blocks serve), the
    winner and its speed-up against the blocks kept in the report. The build is dropped, and no search follows."""
    report = decision.report
    assert report is not None
    winner, speedup = report.chosen, report.speedup or 0.0
    report.measured_whole, report.chosen = winner, "eager"
    report.reason = (
        f"measured, not served: the whole through {winner} ran at {speedup:.2f}x its blocks as they serve "
        f"(targets='auto' would serve it so)"
    )
    return Decision(None, None, report, source=decision.source)


def _drop(started: Started) -> None:
    """Cancel a started call whose output is not wanted (`Target._start`)."""
    try:
        started.cancel()
    except Exception:  # nothing of it reaches the caller
        logger.debug("cancelling a started call whose output was not wanted raised", exc_info=True)
