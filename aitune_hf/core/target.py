"""`Target`: one registered module, its forward router, and its state machine.

RECORDING -> TUNING -> TUNED | EAGER -> DETACHED. The router replaces the forward (never the module): it
records calls, tunes when armed, and then serves each call whose signature was tuned from the chosen
backend; any other call runs eager and is recorded for a later tune.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from aitune_hf.backends.base import Backend, BuiltBackend
from aitune_hf.core.report import ModuleReport, SignatureReport
from aitune_hf.core.signature import InputSignature, Sample, signature_of
from aitune_hf.core.slots import ForwardSlot, all_slots, locate_slot
from aitune_hf.core.strategy import Decision, TuningError, TuningJob
from aitune_hf.core.timing import Stopwatch

if TYPE_CHECKING:
    from aitune_hf.core.registration import Registration
    from aitune_hf.core.weights import WeightsFingerprint

logger = logging.getLogger(__name__)


class TargetState(str, enum.Enum):
    """Where a target is in its life."""

    RECORDING = "recording"
    TUNING = "tuning"
    TUNED = "tuned"
    EAGER = "eager"
    DETACHED = "detached"

    def __str__(self) -> str:
        return self.value


@dataclass
class _Route:
    """How calls of one signature are served once decided."""

    backend: Backend | None  # None: eager
    built: BuiltBackend | None
    report: SignatureReport
    fingerprint: WeightsFingerprint | None = None  # set when the backend baked the weights
    stale: bool = False  # dropped after a failure or a weight change: eager, recorded, re-tuned by tune()


class _ForwardRouter:
    """The callable that sits in the forward slot; after detach it is a plain pass-through."""

    def __init__(self, target: Target, original: Callable[..., Any]) -> None:
        self._target = target
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target.call(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<aitune_hf forward router of {self._target.name!r} ({self._target.state})>"


class Target:
    """One registered module. Created and installed by `register`; read through `Registration`."""

    def __init__(self, name: str, module: torch.nn.Module, registration: Registration) -> None:
        self.name = name
        self.module = module
        self._registration = registration
        self.state = TargetState.RECORDING
        self.reason: str | None = None
        self.armed = False
        self.samples: dict[InputSignature, list[Sample]] = {}
        self.sample_bytes = 0
        self.calls_recorded = 0
        self.tuning_seconds = 0.0
        self.calls_served: dict[str, int] = {}
        self._routes: dict[InputSignature, _Route] = {}
        self._pinned_reason: str | None = None
        self._restrictions: list[tuple[Callable[[Backend], bool], str]] = []
        self._slot: ForwardSlot | None = None
        self._original: Callable[..., Any] | None = None
        self._router: _ForwardRouter | None = None

    # -- installation -------------------------------------------------------------------------------
    def install(self) -> None:
        """Put the router in the module's innermost forward slot."""
        self._slot = locate_slot(self.module)
        self._original = self._slot.read()
        self._router = _ForwardRouter(self, self._original)
        self._slot.write(self._router)

    def uninstall(self) -> None:
        """Take the router out wherever hooks have moved it; it stays a pass-through if it is still held."""
        if self._router is None or self._slot is None or self._original is None:
            self.state = TargetState.DETACHED
            return
        if self._slot.read() is self._router:
            self._slot.restore(self._original)
        else:
            for slot in all_slots(self.module):
                if slot.read() is self._router:
                    slot.write(self._original)
                    break
        self.state = TargetState.DETACHED
        self._routes.clear()
        self.samples.clear()

    @property
    def original_forward(self) -> Callable[..., Any]:
        """The forward that was in the slot before the router: the eager path."""
        assert self._original is not None
        return self._original

    @property
    def slot_description(self) -> str:
        return self._slot.description if self._slot else "-"

    # -- control ------------------------------------------------------------------------------------
    def arm(self) -> None:
        """Tune at the next forward call."""
        if self.state is TargetState.DETACHED:
            raise RuntimeError(f"target {self.name!r} is detached; register it again to tune it")
        if self._pinned_reason is None:
            self.armed = True

    def pin_eager(self, reason: str) -> None:
        """Keep this target eager for good (it cannot be tuned where it stands); `reason` is reported."""
        self._pinned_reason = reason
        self._routes.clear()
        self.samples.clear()
        self.state, self.reason = TargetState.EAGER, reason

    def restrict(self, allow: Callable[[Backend], bool], reason: str) -> None:
        """Only backends for which `allow(backend)` holds may serve this target; the others are reported
        unavailable with `reason` (e.g. weight-baking backends where an offload hook moves the weights)."""
        self._restrictions.append((allow, reason))

    def unavailable_reason(self, backend: Backend) -> str | None:
        """Why this target rules `backend` out, or None."""
        return next((reason for allow, reason in self._restrictions if not allow(backend)), None)

    @property
    def pinned_reason(self) -> str | None:
        """Why this target is kept eager for good, or None."""
        return self._pinned_reason

    @property
    def decided(self) -> bool:
        """True once the target reached TUNED or EAGER."""
        return self.state in (TargetState.TUNED, TargetState.EAGER)

    # -- the forward path ---------------------------------------------------------------------------
    def call(self, *args: Any, **kwargs: Any) -> Any:
        """Route one forward call."""
        state = self.state
        if (
            state is TargetState.DETACHED
            or state is TargetState.TUNING
            or self._pinned_reason is not None
            or self._registration.bypassed
        ):
            return self.original_forward(*args, **kwargs)
        signature = signature_of(args, kwargs)
        route = self._routes.get(signature)
        if route is not None and route.built is not None:
            return self._serve(route, signature, args, kwargs)
        armed = self.armed  # armed before this call: tune now (recording may arm for the next call)
        if route is None or route.stale:
            self._record(signature, args, kwargs)
        if armed:
            self._tune()
            route = self._routes.get(signature)
            if route is not None and route.built is not None:
                return self._serve(route, signature, args, kwargs)
        self._count("eager")
        return self.original_forward(*args, **kwargs)

    def _serve(self, route: _Route, signature: InputSignature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert route.built is not None
        if route.fingerprint is not None:
            change = route.fingerprint.changed()
            if change is not None:
                self._drop_route(
                    signature,
                    f"weights changed since {route.report.chosen} was built ({change}); "
                    "running eager until tune() is called again",
                )
                self._record(signature, args, kwargs)
                return self.original_forward(*args, **kwargs)
        try:
            output = route.built.fn(*args, **kwargs)
        except Exception as error:
            logger.warning(
                "%s: %s raised while serving; falling back to eager", self.name, route.report.chosen, exc_info=True
            )
            self._drop_route(signature, f"{route.report.chosen} raised while serving: {type(error).__name__}: {error}")
            return self.original_forward(*args, **kwargs)
        self._count(route.report.chosen)
        return output

    def _count(self, backend: str) -> None:
        self.calls_served[backend] = self.calls_served.get(backend, 0) + 1

    def _drop_route(self, signature: InputSignature, reason: str) -> None:
        """Serve `signature` eager from now on, record it again, and say why."""
        report = self._routes[signature].report
        report.chosen, report.reason = "eager", reason
        self._routes[signature] = _Route(None, None, report, stale=True)
        self._update_state()

    def _record(self, signature: InputSignature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        config = self._registration.config
        self.calls_recorded += 1
        kept = self.samples.setdefault(signature, [])
        if len(kept) < config.max_samples_per_signature:
            nbytes = Sample.nbytes_of(args, kwargs)
            if self.sample_bytes + nbytes <= config.max_sample_bytes or not kept:
                kept.append(Sample.capture(args, kwargs))
                self.sample_bytes += nbytes
        if config.after_calls and self.state is TargetState.RECORDING and self.calls_recorded >= config.after_calls:
            self.armed = True

    # -- tuning -------------------------------------------------------------------------------------
    def _tune(self) -> None:
        """Tune every recorded signature that has no route yet. Leaves a working state if interrupted."""
        self.armed = False
        pending = [sig for sig in self.samples if sig not in self._routes or self._routes[sig].stale]
        if not pending:
            return
        previous_state = self.state
        self.state = TargetState.TUNING
        registration = self._registration
        registration._tuning_started(self)
        completed = False
        try:
            with Stopwatch() as watch:
                for signature in pending:
                    self._routes[signature] = self._decide(signature)
                    self.samples.pop(signature, None)
            self.tuning_seconds += watch.seconds
            completed = True
        except TuningError:
            completed = True
            raise
        finally:
            self.sample_bytes = sum(s.nbytes for kept in self.samples.values() for s in kept)
            if completed:
                self._update_state()
            else:
                self.state = previous_state if self._routes else TargetState.RECORDING
                self.reason = "tuning was interrupted; call tune() to try again"
            registration._tuning_finished(self)

    def _decide(self, signature: InputSignature) -> _Route:
        registration = self._registration
        config = registration.config
        job = TuningJob(
            self.module, self.original_forward, signature, self.samples[signature], config, self.unavailable_reason
        )
        sibling_key = _sibling_key(self.module, signature) if config.share_identical else None
        shared = registration._shared_decisions.get(sibling_key) if sibling_key else None
        decision: Decision | None = None
        if shared is not None:
            decision = self._reuse(job, shared)
        if decision is None:
            try:
                decision = registration.strategy.decide(job, registration.candidates)
            except TuningError:
                self._routes[signature] = _Route(None, None, job.report)
                raise
            if sibling_key is not None:
                registration._shared_decisions[sibling_key] = (self.name, decision)
        logger.info("%s [%s]: %s", self.name, signature.short(), decision.report.chosen)
        fingerprint = job.fingerprints.get(decision.report.chosen) if decision.built is not None else None
        return _Route(decision.backend, decision.built, decision.report, fingerprint)

    def _reuse(self, job: TuningJob, shared: tuple[str, Decision]) -> Decision | None:
        """Apply an identical sibling's decision, checked for correctness only; None to tune in full."""
        owner, decision = shared
        report = job.report
        report.shared_from = owner
        report.eager_latency_s = decision.report.eager_latency_s
        if decision.backend is None:
            return job.keep_eager(decision.report.reason or "eager kept")
        result, built = job.try_backend(decision.backend)
        if built is None:
            report.shared_from = None
            report.candidates.clear()
            return None
        original = next(c for c in decision.report.candidates if c.backend == result.backend)
        result.latency_s, result.speedup = original.latency_s, original.speedup
        return job.choose(decision.backend, result, built)

    def _update_state(self) -> None:
        if any(route.built is not None for route in self._routes.values()):
            self.state, self.reason = TargetState.TUNED, None
        elif self._routes:
            reasons = {route.report.reason for route in self._routes.values() if route.report.reason}
            self.state, self.reason = TargetState.EAGER, "; ".join(sorted(reasons)) or None
        else:
            self.state = TargetState.RECORDING

    # -- reporting ----------------------------------------------------------------------------------
    def report(self) -> ModuleReport:
        """A fresh ModuleReport of this target."""
        return ModuleReport(
            name=self.name,
            module_class=type(self.module).__name__,
            state=str(self.state),
            reason=self.reason,
            signatures=[route.report for route in self._routes.values()],
            tuning_seconds=self.tuning_seconds,
            calls=dict(self.calls_served),
        )

    def __repr__(self) -> str:
        return f"Target({self.name!r}, {type(self.module).__name__}, state={self.state})"


def _sibling_key(module: torch.nn.Module, signature: InputSignature) -> tuple[Any, ...]:
    """Modules with equal keys are interchangeable for a backend choice."""
    tensors = tuple(
        (name, tuple(t.shape), t.dtype, t.device) for name, t in [*module.named_parameters(), *module.named_buffers()]
    )
    return type(module), tensors, signature
