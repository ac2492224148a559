"""Anytime tuning: the search that goes on after a target's first plan serves (`TuningConfig.anytime`).

The strategy (`MinLatency`) builds the cheap candidates one at a time and stops at the first that beats eager clearly
(`TuningJob.anytime`): that plan serves from the call that tuned. What it left (`TuningJob.deferred`) is searched here,
on the registration's worker (`Registration.worker`), off the callers' threads: each candidate built from a private copy
of the module (in the build process where the backend can), checked on the recorded calls against the references the
first plan was checked against, and timed side by side with eager and the plan that serves (`Strategy.refine`). A
candidate measured faster replaces the plan, for the target and for the identical siblings that took its decision
(`follow`: each builds it and checks it on its own recorded calls first); a reduced-precision one serves only once the
end-to-end quality gate passed it on a whole call: until then, and for good if it fails, the plan it would replace
serves (`Route.replaces`). A plan that fails its check never serves, and neither is a decision made in a module state
that has changed since (the route is no longer there, or its guard fails: the search is dropped). The cache keeps the
final decision only (`Refinement.run`): a process that stops before the search ends tunes again.

The search waits for the callers' tunings to end (`QUIET_S`), holds the process's tuning lock while it builds (one
tuning at a time in the process), and pauses while callers' whole calls are in flight, as the checks of new shapes do
(`core/background.py`). `Registration.wait()` waits for it; the report says while it goes on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aitune_hf.backends.base import build_context
from aitune_hf.core.decisions import Decision
from aitune_hf.core.reasons import summarize
from aitune_hf.core.report import CandidateResult, SignatureReport
from aitune_hf.core.strategy import Strategy, TuningJob
from aitune_hf.core.timing import clock

logger = logging.getLogger(__name__)

#: Seconds a search waits, at most, for the callers' tunings to end before it starts (a target left armed by a call
#: that never comes back would otherwise hold it for good); it polls every `QUIET_POLL_S`.
QUIET_S = 30.0
QUIET_POLL_S = 0.05
#: Times a search waits `QUIET_S` again, behind the worker's other jobs, while its first plan still waits for the gate
#: of the call that tuned it (SD small's tuning call takes 30-35 s); then it starts, or is dropped if the plan waits on.
QUIET_WAITS = 20


class Refinable(Protocol):
    """What the search needs of a target (`core.target.Target`, named here by its shape: this room is below it)."""

    name: str

    def serves(self, route: Any) -> bool:
        """True while `route` is one of the target's routes, its guard holds and it waits for no gate."""

    def replace_route(self, old: Any, decision: Decision) -> Any:
        """Serve `decision` where `old` served (`old` kept to fall back on until a gate passes it); the new route, or
        None where `old` is gone."""


@dataclass(eq=False)
class _Follower:
    """An identical sibling that took the decision being searched on (`Sourcing._shared`): its route and its tuning job
    (its own recorded calls and references)."""

    target: Refinable
    route: Any
    job: TuningJob


class Refinement:
    """The search after one decision's first plan: its tuning job (what is left, `job.deferred`), the strategy that
    searches, and the cache and sibling table to write the final decision to. Run a step at a time on the worker
    (`step`), by the target that made the first plan (`Target.refine_in_background`).

    Args:
        strategy: the strategy that made the first plan (`Strategy.refine_step` and `refine` search on).
        job: the first plan's tuning job.
        decision: the first plan.
        consult: a context manager giving the cache entry of the decision (or None), entered around the search: its
            builds write their artifacts there, and the final decision is stored in it.
        publish: records the final decision for the identical siblings tuned later in this process.
        build: what the builds of the search see besides `private_only` (`BuildContext`: `shared`, `state`).
    """

    def __init__(
        self,
        strategy: Strategy,
        job: TuningJob,
        decision: Decision,
        consult: Callable[[], contextlib.AbstractContextManager[Any]],
        publish: Callable[[Decision], None],
        build: dict[str, Any],
    ) -> None:
        self.strategy, self.job, self.decision = strategy, job, decision
        self._consult, self._publish, self._build = consult, publish, build
        self._owner: tuple[Refinable, Any] | None = None
        self._followers: list[_Follower] = []
        self._lock = threading.Lock()
        #: "pending" (queued), "running", or "done".
        self.state = "pending"
        #: What the search found, for the report: None until done.
        self.outcome: str | None = None
        #: `clock()` when it ended.
        self.ended_at: float | None = None
        #: The backend of the first plan (its report's `chosen` when the search began).
        self._first = decision.report.chosen if decision.report is not None else "eager"
        #: The candidates left when it began; its cache entry, held open from its first step to its last (the
        #: artifacts its builds write are staged there).
        self._left = 0
        self._entry: Any = None
        self._stack = contextlib.ExitStack()
        self._steps = 0
        self._waits = 0
        #: `close` was called; a step runs now (under the tuning lock).
        self._closing = self._executing = False
        #: When its wait for quiet ends (`time.monotonic()`, kept while it gives way to checks).
        self._quiet_until: float | None = None

    @property
    def left(self) -> int:
        """Candidates not yet tried (0 once it runs)."""
        return len(self.job.deferred)

    def bind(self, target: Refinable, route: Any) -> None:
        """The target whose tuning made the first plan, and the route that serves it."""
        self._owner = (target, route)

    def follow(self, target: Refinable, route: Any, job: TuningJob) -> bool:
        """An identical sibling that took the first plan: it gets the final one too. False where the search has ended
        (the sibling took the decision as it stood)."""
        with self._lock:
            if self.state == "done":
                return False
            self._followers.append(_Follower(target, route, job))
            return True

    @property
    def steps(self) -> int:
        """How many steps it has run (a part of each step's queue key: `Registration._search`)."""
        return self._steps

    def step(
        self,
        quiet: Callable[[], bool],
        lock: Callable[[], contextlib.AbstractContextManager[Any]],
        checks_waiting: Callable[[], bool] = lambda: False,
    ) -> bool:
        """One step of the search, on the worker: its first waits for quiet (`QUIET_S` at most); each then, holding
        `lock()` (the process's tuning lock, as a search step holds it), builds and checks one candidate
        (`Strategy.refine_step`), and the last times what was built, serves what it found and stores the final
        decision. True while steps are left: the worker queues the next behind what waits (the checks of new shapes run
        between two candidates). The wait for quiet gives way (True: queued again behind every job) while a check of
        a whole call waits on the worker: the quiet may wait for it (the gate of a plan another search found runs
        there). Contained: what raises ends the search, the first plan serving on, with the reason in the log and the
        report."""
        if self.state == "pending":
            if self._quiet_until is None:
                self._quiet_until = time.monotonic() + QUIET_S
            while not quiet() and time.monotonic() < self._quiet_until:
                if checks_waiting():
                    return True
                time.sleep(QUIET_POLL_S)
            self._quiet_until = None
            assert self._owner is not None
            if not quiet() and self._owner[1].provisional and self._waits < QUIET_WAITS:
                self._waits += 1  # the call that tuned has not gated its first plan yet (a long tuning call): later
                return True
        self._steps += 1
        with lock():
            with self._lock:
                if self.state == "done":  # closed meanwhile (`close`)
                    return False
                self._executing = True
            try:
                more = self._step() and not self._closing
            except Exception as error:  # the plan that serves stays
                logger.warning("aitune_hf: the search after %s's first plan failed", self._name(), exc_info=True)
                self.outcome, more = f"search failed: {summarize(error)}", False
            finally:
                with self._lock:
                    self._executing = False
            if not more:
                self._end()
            return more

    def _end(self) -> None:
        """The search ended (done, dropped, failed or closed): its cache entry closed, its outcome in the report."""
        with self._lock:
            if self.state == "done":
                return
            # The outcome is in the report before the state says "done": `Registration.searching` (and `wait()`)
            # count a search as ended from that moment, and a reader of the report then finds why it ended.
            if self._closing and not self.outcome:
                self.outcome = "dropped: the registration was detached"
            if self.decision.report is not None:
                self.decision.report.search = self.outcome
            self.state = "done"
            self.ended_at = clock()
            self.job.deferred = []
            self._followers = []
        self._stack.close()

    def close(self) -> None:
        """Drop the search where it stands (the registration detaches): nothing more is built or served. A step in
        flight ends the search itself when it returns."""
        with self._lock:
            if self.state == "done":
                return
            self._closing = True
            executing = self._executing
        if not executing:
            self._end()

    def _name(self) -> str:
        return self._owner[0].name if self._owner is not None else "?"

    def _step(self) -> bool:
        assert self._owner is not None
        target, route = self._owner
        if self.state == "pending":
            self.state = "running"
            self._left = self.left
            if not target.serves(route):
                self.outcome = "dropped: the module changed, or the first plan waits for (or failed) the gate"
                return False
            self.job.halted = lambda: self._closing or not target.serves(route)
            self._entry = self._stack.enter_context(self._consult())
        entry = self._entry
        with build_context(private_only=True, place=entry.place if entry is not None else None, **self._build):
            if self.strategy.refine_step(self.job, self.decision):
                return True
            found = self.strategy.refine(self.job, self.decision)
        report = self.decision.report
        assert report is not None
        if self.job.halted():
            self.outcome = "dropped: the module changed while the search ran"
            return False
        if found is not None:
            report.first_plan = self._first
            if target.replace_route(route, found) is None:
                self.outcome = "dropped: the module changed while the search ran"
                return False
            self._publish(found)
            for follower in self._take_followers():
                with build_context(private_only=True, **self._build):
                    self._apply(follower, found)
        else:
            for follower in self._take_followers():
                self._timings_to(follower)
        if entry is not None:
            entry.store(found or self.decision, self.job.signatures, new_decision=True)
        if found is None:
            self.outcome = f"searched {self._left} more candidate(s) on the worker; {self._first} stays the fastest"
        elif found.backend is None:
            self.outcome = (
                f"searched {self._left} more candidate(s) on the worker: eager replaced the first plan, {self._first} "
                f"({report.reason})"
            )
        else:
            speed = next((c.speedup for c in report.candidates if c.backend == report.chosen), None)
            self.outcome = (
                f"searched {self._left} more candidate(s) on the worker: {report.chosen} ({speed or 0.0:.2f}x) "
                f"replaced the first plan, {self._first}"
            )
        return False

    def _take_followers(self) -> list[_Follower]:
        with self._lock:
            followers, self._followers = self._followers, []
            return followers

    def _timings_to(self, follower: _Follower) -> None:
        """For an identical sibling that keeps the first plan: the figures the search left it with (the first plan
        timed fully against eager, where the tuning call had its check's estimate or a first look). Copied when it
        took the first plan, a sibling's row read the estimate on: measured on SD small's CLIP text encoder, 7.15x and
        4.99 ms eager for layers 1-3 where layer 0's row, timed by its search, read 1.46x and 0.72 ms."""
        if not follower.target.serves(follower.route):
            return
        mine = follower.job.report
        taken = next((c for c in mine.candidates if c.backend == mine.chosen), None)
        if taken is not None:
            assert self.decision.report is not None
            _owners_figures(mine, taken, self.decision.report)

    def _apply(self, follower: _Follower, found: Decision) -> None:
        """The final decision for an identical sibling: its winner built with the sibling's weights, checked on the
        sibling's own recorded calls; where that fails the sibling keeps its first plan."""
        if not follower.target.serves(follower.route):
            return
        job = follower.job
        if found.backend is None:  # eager led the search: the sibling's copy of the first plan goes too
            job.report.first_plan, job.report.eager_latency_s = self._first, found.report.eager_latency_s
            job.report.search = f"took eager from the search of {self._name()}"
            follower.target.replace_route(follower.route, job.keep_eager(found.report.reason or "eager led"))
            return
        with build_context(sibling=True):
            result, built = job.try_backend(found.backend)
        if built is None:
            logger.info("%s: %s failed here (%s); the first plan serves on", follower.target.name,
                        result.backend, result.error)  # fmt: skip
            return
        _owners_figures(job.report, result, found.report)  # as for a shared decision (`Sourcing._shared`)
        decision = job.choose(found.backend, result, built)
        job.report.first_plan = self._first
        job.report.search = f"took {result.backend} from the search of {self._name()}"
        follower.target.replace_route(follower.route, decision)


def _owners_figures(report: SignatureReport, result: CandidateResult, owner: SignatureReport) -> None:
    """An identical sibling's row (`result`, in its `report`) set to the owner's figures for the same backend: its
    latency and speed-up, and eager's time they were measured against. Nothing where the owner has no such row."""
    owned = next((c for c in owner.candidates if c.backend == result.backend), None)
    if owned is not None:
        result.latency_s, result.speedup = owned.latency_s, owned.speedup
        report.eager_latency_s = owner.eager_latency_s
