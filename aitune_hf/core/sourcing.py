"""Where a target's decision for one group of signatures comes from, checked on the recorded calls before it serves:
an identical sibling's decision in this process (`Decision.source` "shared"), the persistent cache's ("cache"), or a
new one from the strategy ("tuned"). A new decision, and the artifact its build wrote, go to the cache.

The source is said twice, on purpose: `Decision.source` for the code, and the report's `shared_from` / `from_cache`
(what the cache stores and the report shows: `SignatureReport.source`), both set here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from aitune_hf.backends.base import Backend, BuiltBackend, build_context
from aitune_hf.core.cache import Consultation, consult
from aitune_hf.core.context import TuningContext
from aitune_hf.core.decisions import Decision
from aitune_hf.core.keys import build_state, key_fields, state_fingerprint
from aitune_hf.core.refine import Refinement
from aitune_hf.core.report import CandidateResult
from aitune_hf.core.signature import InputSignature, layout_of
from aitune_hf.core.strategy import TuningJob

logger = logging.getLogger(__name__)


@dataclass
class Sourcing:
    """The decision of one tuning of one target (`Target._decide`): its `name` (reports, the sibling table), its
    `module`, the registration's `context`, and what it rules out (`unavailable_reason`)."""

    name: str
    module: torch.nn.Module
    context: TuningContext
    unavailable_reason: Callable[[Backend], str | None]
    #: For a target kept whole over its blocks (`Target.inner`), their classes: its decisions were timed against them,
    #: so they are other cache entries than its decisions as a whole alone.
    over: tuple[str, ...] = ()

    def decide(
        self, job: TuningJob, signatures: list[InputSignature], dynamic: bool, private: bool = False
    ) -> Decision:
        """An identical sibling's decision, a cached one (`core/cache.py`), or a new one; each checked on the
        recorded calls before it serves. A new decision, and the artifact its build wrote, go to the cache; a first
        plan that left candidates to search (anytime tuning) gets its search (`Decision.refinement`), and the cache
        gets the decision it ends with. `private`: the builds may only work on private copies of the module (a tuning
        on the worker)."""
        context = self.context
        key = sibling_key(self.module, signatures) if context.config.share_identical else None
        shared = context.decisions.get(key) if key is not None else None
        # Computed once, when first asked for: by the cache's key, and by builds that share work (`build_state`).
        fingerprint = functools.cache(lambda: state_fingerprint(self.module))
        fields = functools.cache(lambda: key_fields(
            self.module, signatures, dynamic, context.config, context.candidates, repr(context.strategy),
            layout_of(job.samples[0].args, job.samples[0].kwargs), fingerprint(), self.over,
        ))  # fmt: skip
        builds = {
            "shared": {},
            "state": functools.cache(lambda: build_state(fingerprint(), self.module.training, signatures, dynamic)),
        }
        with (
            consult(context.cache, self.module, fields) as entry,
            build_context(
                place=entry.place if entry is not None else None,
                private_only=context.background is not None or private,
                **builds,
            ),
        ):  # fmt: skip
            decision = None
            # A sibling's decision, not this target's own: its own earlier one was made in another module state.
            if shared is not None and shared[0] != self.name:
                decision = self._shared(job, shared)
            if decision is None and entry is not None and entry.record is not None:
                decision = self._from_cache(job, entry)
            new = decision is None
            if new:
                for name, why, precision in context.skipped:
                    job.report.candidates.append(CandidateResult(name, error=f"skipped: {why}", precision=precision))
                if context.background is not None:  # nothing to reuse: a full tuning (a warming replica stops waiting)
                    context.background.afresh = True
                decision = context.strategy.decide(job, context.candidates)
                if job.deferred and decision.backend is not None:  # anytime: this plan serves, the search goes on
                    decision.refinement = Refinement(
                        context.strategy, job, decision,
                        consult=functools.partial(consult, context.cache, self.module, fields),
                        publish=functools.partial(self._publish, key), build=builds,
                    )  # fmt: skip
            elif shared is not None and shared[1].refinement is not None and decision.backend is not None:
                decision.refinement = shared[1].refinement  # this sibling follows the search of the one it shares
            if entry is not None:
                stats = entry.cache.stats
                stats.hits += decision.report.from_cache is not None  # its own, or its sibling's, from the cache
                stats.misses += new
                # A first plan whose search goes on is no decision for later processes yet: its artifact is kept, the
                # decision is written when the search ends (`Refinement.run`).
                entry.store(decision, signatures, new_decision=new, owner=shared[1] if shared else None,
                            write_record=decision.refinement is None)  # fmt: skip
        if key is not None and (shared is None or new):
            context.decisions[key] = (self.name, decision)
        return decision

    def _publish(self, key: Any, decision: Decision) -> None:
        """The decision a search ended with, for the identical siblings tuned later in this process."""
        if key is not None:
            self.context.decisions[key] = (self.name, decision)

    def _from_cache(self, job: TuningJob, entry: Consultation) -> Decision | None:
        """The cached decision, its winner built alone (from its cached artifact where one fits) and checked on
        every recorded call; None to tune in full (its winner is not a candidate here, or it failed)."""
        record = entry.record
        assert record is not None
        figures = record["report"]
        job.report.from_cache = entry.key
        job.report.eager_latency_s = figures.get("eager_latency_s")
        if record["chosen"] == "eager":
            return dataclasses.replace(job.keep_eager(figures.get("reason") or "eager kept"), source="cache")
        backend = next((b for b in self.context.candidates if b.describe() == record["backend"]), None)
        ruled_out = self.unavailable_reason(backend) if backend is not None else None
        if backend is None or ruled_out is not None:  # not a candidate here (the gate sent reduced precision back)
            if ruled_out is not None:
                logger.info("%s: cached winner %s is ruled out here (%s); tuning afresh", self.name, record["backend"],
                            ruled_out)  # fmt: skip
            job.report.from_cache = None
            return None
        result, built = job.try_backend(backend)
        if built is None:
            entry.cache.stats.problems.append(f"{entry.key}: cached winner {result.backend} failed: {result.error}")
            logger.warning("%s: cached winner %s failed here (%s); tuning afresh", self.name, result.backend,
                           result.error)  # fmt: skip
            job.report.candidates.clear()
            job.report.from_cache = None
            return None
        original = next((c for c in figures.get("candidates", ()) if c.get("backend") == result.backend), {})
        result.latency_s, result.speedup = original.get("latency_s"), original.get("speedup")
        decision = job.choose(backend, result, built, self._cached_fallback(job, figures, backend))
        return dataclasses.replace(decision, source="cache")

    def _cached_fallback(
        self, job: TuningJob, figures: dict[str, Any], winner: Backend
    ) -> tuple[Backend, CandidateResult, BuiltBackend] | None:
        """For a cached reduced-precision winner: the best fp32 candidate of the cached figures, built, for the
        end-to-end gate to fall back to (None: eager)."""
        if winner.precision == "fp32":
            return None
        fp32 = [
            c for c in figures.get("candidates", ())
            if c.get("precision", "fp32") == "fp32" and (c.get("speedup") or 0.0) >= job.config.min_speedup
        ]  # fmt: skip
        for figure in sorted(fp32, key=lambda c: -(c.get("speedup") or 0.0)):
            backend = next((b for b in self.context.candidates if b.describe() == figure.get("backend")), None)
            if backend is None:
                continue
            result, built = job.try_backend(backend)
            if built is not None:
                result.latency_s, result.speedup = figure.get("latency_s"), figure.get("speedup")
                return backend, result, built
        return None

    def _shared(self, job: TuningJob, shared: tuple[str, Decision]) -> Decision | None:
        """Apply an identical sibling's decision, checked for correctness only; None to tune in full."""
        owner, decision = shared
        report = job.report
        report.shared_from = owner
        report.from_cache = decision.report.from_cache
        report.eager_latency_s = decision.report.eager_latency_s
        if decision.backend is None:
            return dataclasses.replace(job.keep_eager(decision.report.reason or "eager kept"), source="shared")
        with build_context(sibling=True):
            result, built = job.try_backend(decision.backend)
        if built is None:
            report.shared_from = report.from_cache = None
            report.candidates.clear()
            return None
        original = next(c for c in decision.report.candidates if c.backend == result.backend)
        result.latency_s, result.speedup = original.latency_s, original.speedup
        fallback = None
        if decision.fallback is not None:  # a reduced-precision decision: the sibling's fp32 fallback too
            with build_context(sibling=True):
                fallback_result, fallback_built = job.try_backend(decision.fallback[0])
            if fallback_built is not None:
                figures = next((c for c in decision.report.candidates if c.backend == fallback_result.backend), None)
                if figures is not None:  # the owner's timings, as for the winner (a cached copy falls back by them)
                    fallback_result.latency_s, fallback_result.speedup = figures.latency_s, figures.speedup
                fallback = (decision.fallback[0], fallback_result, fallback_built)
        chosen = job.choose(decision.backend, result, built, fallback, decision.fp32_lost)
        return dataclasses.replace(chosen, source="shared")


def sibling_key(module: torch.nn.Module, signatures: list[InputSignature]) -> tuple[Any, ...]:
    """Modules with equal keys are interchangeable for a backend choice."""
    tensors = tuple(
        (name, tuple(t.shape), t.dtype, t.device) for name, t in [*module.named_parameters(), *module.named_buffers()]
    )
    return type(module), tensors, frozenset(signatures)
