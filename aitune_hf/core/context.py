"""`TuningContext`: the narrow view of its registration that a target tunes with."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from aitune_hf.backends.base import Backend
from aitune_hf.core.background import BackgroundTuner
from aitune_hf.core.cache import TuningCache
from aitune_hf.core.config import TuningConfig
from aitune_hf.core.decisions import Decision
from aitune_hf.core.strategy import KindEvidence, Strategy


@dataclass(eq=False)
class CallNotes:
    """What the targets note about one whole call in one thread (`Registration.noting`); the Hugging Face layer
    reads them at the call's end to gate it, or to check its new shapes off the caller's thread (`hf/gate.py`).

    Attributes:
        defer: a call of a new shape that a family route covers runs eager and is not checked in the call: it is
            listed in `deferred` (each shape once: `Target.release` lets it be deferred again), for a replay of the
            whole call to check off the caller's thread.
        replay: a replay of a whole call off the caller's thread (checking its new shapes, or gating): nothing is
            recorded or tuned in it (a block it meets armed runs eager, and tunes in a caller's call).
        gating: the end-to-end gate's replay: decisions waiting for the gate serve.
        deferred: (target, signature) of each new shape left unchecked.
        met: (target, route) of each route waiting for the gate that the call met (served by its fallback, or by
            itself in the gate's replay).
        tuned_s: seconds the targets tuned inside the call (each target counts them in its own tuning seconds; a
            gate's replay leaves them out of its own).
    """

    defer: bool = False
    replay: bool = False
    gating: bool = False
    deferred: list[tuple[Any, Any]] = field(default_factory=list)
    met: list[tuple[Any, Any]] = field(default_factory=list)
    tuned_s: float = 0.0

    def meet(self, target: Any, route: Any) -> None:
        if not any(r is route for _, r in self.met):
            self.met.append((target, route))


class Progress:
    """One tqdm bar over the targets that tune in a burst; opened by the first, closed when none is pending."""

    def __init__(self, pending: Callable[[], int], enabled: bool) -> None:
        self._pending = pending
        self._enabled = enabled
        self._bar: Any = None

    def started(self, name: str) -> None:
        if self._bar is None:
            # disable=None: tqdm draws it only where its stream is a terminal (never in a redirected log).
            self._bar = tqdm(
                total=max(self._pending(), 1), desc="aitune_hf tuning", unit="target",
                disable=None if self._enabled else True, leave=False,
            )  # fmt: skip
        self._bar.set_postfix_str(name, refresh=True)

    def finished(self) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        if not self._pending():
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclass
class TuningContext:
    """What a target needs from its registration to tune, and nothing more.

    Attributes:
        config: the registration's TuningConfig.
        strategy: builds, checks, times and chooses.
        candidates: the candidate backends, eager excluded.
        decisions: decisions shared by identical siblings (sibling key -> (owner name, Decision)).
        cache: decisions and artifacts kept across processes, or None.
        progress: the progress bar.
        bypassed: True while the registration runs everything eager (`Registration.bypass()`).
        bypass: runs everything eager in this thread inside the block (`Registration.bypass()`); `served` lifts it
            inside the block (a target kept whole over its blocks times them as they serve: `Target.inner`).
        on_call: an observer of routed calls (the Hugging Face layer arms tuning from it where it sees no
            whole call).
    """

    config: TuningConfig
    strategy: Strategy
    candidates: list[Backend]
    progress: Progress
    bypassed: Callable[[], bool]
    decisions: dict[Any, tuple[str, Decision]] = field(default_factory=dict)
    #: The persistent cache (`core/cache.py`), or None when it is off.
    cache: TuningCache | None = None
    #: Called with the target's name at the start of each routed call, while set (`Registration.observe_calls`).
    on_call: Callable[[str], None] | None = None
    #: Routed calls started so far, in every thread (`Target.back_to_back`: whether a target's calls follow each other).
    calls_started: int = 0
    #: Candidates left out here (reduced precisions this machine does not compute natively, backends that cannot
    #: build in the background): (name, why, precision), in the report of every new decision.
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    #: True when a reduced-precision decision waits for the end-to-end gate (`Registration.gate`) before it serves
    #: (the fp32 candidate it falls back to serves meanwhile); False: the per-block filter suffices.
    gate_required: bool = False
    #: This thread's notes on the whole call it makes (`Registration.noting`), or None outside one.
    notes: Callable[[], CallNotes | None] = lambda: None
    #: The background tuner (`TuningConfig.background`), or None: targets then tune inside the calls that arm them.
    background: BackgroundTuner | None = None
    #: What the first blocks of each kind showed about slow builds (`MinLatency(prune_slow_after=...)`).
    evidence: KindEvidence = field(default_factory=KindEvidence)
    bypass: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    served: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    #: The registration's worker (`Registration.worker`): tunings armed off the callers' threads, and the searches
    #: after first plans, run there.
    worker: Callable[[], BackgroundTuner | None] = lambda: None
    #: Queues the search after a target's first plan (`core/refine.py`) on the worker: `search(target, refinement)`.
    search: Callable[[Any, Any], None] = lambda target, refinement: None
    #: True when no target that has been called tunes or waits to tune, and nothing waits for the end-to-end gate:
    #: a search after a first plan starts then (`Refinement.run`).
    quiet: Callable[[], bool] = lambda: True
    #: `timing.clock()` at registration, when every target that had been called first had a decision (`all_tuned`: the
    #: next call is served by what tuning chose; None before), and when the latest tuning ended (None before).
    started: float = 0.0
    first_served: float | None = None
    decided_at: float | None = None
    #: Called at the end of each tuning (`Registration._decided`: it notes when `all_tuned` first held).
    decided: Callable[[], None] = lambda: None
    #: Per thread: `off_route`, how many routed calls this thread made that no decision covered (recorded, tuned, or
    #: run eager while tuning or in training): a target kept whole over its blocks records a call only where its blocks
    #: made none (a new shape a family route covers, checked once, counts as covered).
    _local: threading.local = field(default_factory=threading.local)

    def note_off_route(self) -> None:
        """A routed call in this thread that no decision covered: it recorded, or tuned, or ran eager meanwhile."""
        self._local.off_route = getattr(self._local, "off_route", 0) + 1

    def off_route(self) -> int:
        """How many routed calls of this thread no decision covered so far (`note_off_route`)."""
        return getattr(self._local, "off_route", 0)
