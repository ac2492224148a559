"""Work off the callers' threads: tuning in the background (`TuningConfig.background`: no call waits for a tuning),
and the checks of new shapes that whole calls leave to a replay of themselves (`hf/gate.py`), in one worker thread
per registration (`Registration.worker`), one job at a time. Checks queue at most `MAX_CHECKS` deep.

A target that would tune inside a call (armed, and no route for the call) is queued instead, and the call runs eager
at once. One worker thread per registration tunes the queued targets, one at a time (and one tuning at a time in the
process, as ever), from the calls they recorded; each target switches to its decision when it is made, while calls
keep being served: eager, or by the routes already built. Calls of a target being tuned run eager.

Only backends that build from a private copy of the module may tune in the background: an ONNX Runtime export traces
a deep copy, while Inductor compiles (and Dynamo traces) the live module that other threads are calling. Those are
left out, and the report says so.

The worker yields to the serving threads. Building a block (an export) is Python-heavy and holds the GIL; a
request's thread needs the GIL between its operators and, without this, waits for it again and again (measured on
MiniLM: a 39 ms request took 272 ms at the median and up to 1.4 s beside an export). So the worker runs under a
profile hook of its own thread (`sys.setprofile` is per thread) that sleeps `YIELD_S` every `YIELD_EVERY` Python
calls, handing the GIL over (measured: median 88 ms, worst 187 ms; the export about 2x slower). While a caller's whole
call is in flight it also lets go of the GIL every `YIELD_SERVING` events (measured: an eager BERT query of 22-24 ms
beside a thread deep-copying a model, three interleaved rounds of 30 calls: 1.40-1.42x its time alone at the median and
1.60-1.86x at worst with the hand-over every 1000 events only; 1.16-1.18x and 1.30-1.31x with it every 300 too; the
copying thread 15-20% slower). The hook is off while a round is timed (`core.timing`), so eager's many Python calls
are not weighed down against a compiled callable's few.

What no yielding can break up leaves the process: C++ steps of a build that hold the GIL for up to seconds (an ONNX
export's serialisation, ONNX Runtime's graph optimisation, an int8 quantization: the slowest MiniLM request beside them
took 6-16 s). A backend's build under `BuildContext.private_only` may run them in the build process
(`backends/base.py`: `run_in_build_process`, one worker process per process, started on first use); ONNX Runtime's
does (export, quantization, optimisation there; this process only loads the optimised model), and builds here as
before a block that cannot be pickled. What stays here (the private copy, its pickling, reading the export back, the
session's loading, the timed rounds) still runs under the yielding hook.

Timing under live traffic is noisy: serving threads share the cores with the timed rounds. The choice stays honest
the same way as in the foreground: candidates are timed side by side with eager, round by round, and the paired
ratios' median decides, with the sequential rule's confidence bounds (`core/timing.py`) setting how many rounds it
takes; a candidate whose lead is within the noise is not chosen over eager (`min_speedup`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from aitune_hf.backends.base import on_the_worker

logger = logging.getLogger(__name__)

#: The worker sleeps YIELD_S seconds every YIELD_EVERY profile events (Python and C calls and returns) of its thread,
#: and lets go of the GIL (`time.sleep(0)`) every YIELD_SERVING events between while a caller's whole call is in flight.
YIELD_EVERY = 1000
YIELD_S = 1e-4
YIELD_SERVING = 300
#: While a caller's whole call is in flight (`BackgroundTuner.serving`), a check pauses at each of those points
#: until none is, PAUSE_S at most (then it goes on for YIELD_EVERY events: it always progresses). Its work (replays of
#: whole calls) shares the memory bandwidth and the GIL with the callers' calls: on 2 cores, unseen single queries
#: served beside the checks of a batch pass took 1.30x a plain call in one pass; the benchmark's rounds of first
#: sights read 0.97-1.19x (median 1.02x) with the pauses, the checks taking 0.02-0.09 s of CPU beside a 0.5 s pass
#: (docs/precision.md: the rest of a single pass's swing is the host). A check with a search step queued behind it does
#: not pause (`_busy`): the worker is the search's next, which yields and does not pause.
PAUSE_S = 0.05


def _yielding_hook(busy: Callable[[], bool], serving: Callable[[], bool]) -> Callable[[Any, str, Any], None]:
    """A `sys.setprofile` function that hands the GIL to other threads now and then, more often while `serving()`,
    and pauses while `busy()` (see the module's docstring and `PAUSE_S`)."""
    count = [0]

    def hook(frame: Any, event: str, arg: Any) -> None:
        count[0] += 1
        if count[0] % YIELD_SERVING == 0 and count[0] < YIELD_EVERY and serving():
            time.sleep(0)
        if count[0] >= YIELD_EVERY:
            count[0] = 0
            time.sleep(YIELD_S)
            until = time.monotonic() + PAUSE_S
            while busy() and time.monotonic() < until:
                time.sleep(1e-3)

    hook.aitune_yield = True  # type: ignore[attr-defined]  (core.timing turns only this hook off while timing)
    return hook


#: Checks of whole calls (`submit_check`) queued at most; beyond, a new one is dropped (its shapes are deferred again
#: by a later call): a service meeting new shapes faster than they are checked keeps serving eager, never queues more.
MAX_CHECKS = 8
#: Workers alive in this process: stopped and joined at exit, so that a worker thread never outlives the runtimes it
#: called (a daemon thread frozen at exit with ONNX Runtime state left C++ to abort: "terminate called without an
#: active exception").
_WORKERS: weakref.WeakSet[BackgroundTuner] = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    workers = list(_WORKERS)
    for worker in workers:
        worker.stop()
    for worker in workers:
        worker.join(timeout=10.0)


class Tunable(Protocol):
    """What the worker needs of a target (`core.target.Target`, named here by its shape so that this room, below the
    target, does not import it): its name, and its tuning run on the worker."""

    name: str

    def tune_in_background(self, tuner: BackgroundTuner) -> None: ...


@dataclass(eq=False)
class _Job:
    """One piece of work for the worker: a target's tuning, a check of a whole call (`hf/gate.py`), or the search after
    a first plan (`core/refine.py`)."""

    name: str
    run: Callable[[], None]
    key: Any  # queued at most once per key (a target; a check's key, or the job itself)
    tuning: bool
    dropped: Callable[[], None] | None = None  # what a check that never ran undoes
    #: A search after a first plan: it yields as a tuning does (its heavy steps run in the build process where they
    #: can), never dropped for the checks' bound.
    search: bool = False


class BackgroundTuner:
    """The queue of work off the callers' threads (targets waiting to tune, checks of whole calls), and the worker
    thread that runs it, one job at a time."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: collections.deque[_Job] = collections.deque()
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        _WORKERS.add(self)
        self._running: _Job | None = None
        self._stopped = False
        self._afresh = False
        self.tuned = 0  # targets tuned here so far
        self._serving = 0  # callers' whole calls in flight (`serving`)
        self._serving_lock = threading.Lock()

    @property
    def thread_name(self) -> str:
        """The worker thread's name (in log records' `threadName`)."""
        return f"aitune_hf worker ({self._name})"

    @property
    def afresh(self) -> bool:
        """True while the running tuning tunes afresh (no decision from the cache or an identical sibling)."""
        return self._afresh

    @afresh.setter
    def afresh(self, value: bool) -> None:
        # Wakes `wait(until=...)`: a replica waits for decisions from the cache, and stops when a full tuning starts.
        # Before, nothing woke it then, and it waited for the whole tuning.
        with self._condition:
            self._afresh = value
            self._condition.notify_all()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """A caller's whole call is in flight: a check on the worker pauses at its yield points (`PAUSE_S`)."""
        with self._serving_lock:
            self._serving += 1
        try:
            yield
        finally:
            with self._serving_lock:
                self._serving -= 1

    @property
    def callers(self) -> int:
        """Callers' whole calls in flight now (`serving`)."""
        return self._serving

    def _in_flight(self) -> bool:
        return self._serving > 0

    def _busy(self) -> bool:
        """A check pauses: a caller's whole call is in flight, and no search step waits behind the check. Where one
        does, the worker is the search's next anyway (a step yields, it does not pause): a check that paused there
        only held the search back (MiniLM's checks behind a search: 24-27 s of wall time each turn, for 0.4 s of work
        each)."""
        if self._serving <= 0:
            return False
        with self._condition:
            return not any(job.search for job in self._queue)

    def submit(self, target: Tunable) -> None:
        """Queue `target`'s tuning (once) and make sure the worker runs; returns at once."""
        self._submit(_Job(target.name, functools.partial(target.tune_in_background, self), target, tuning=True))

    def submit_check(self, name: str, run: Callable[[], None], dropped: Callable[[], None], key: Any = None) -> bool:
        """Queue a check of a whole call (`run`), once per `key` (None: always), unless `MAX_CHECKS` wait already:
        then `dropped()` runs here and False is returned."""
        job = _Job(name, run, key if key is not None else object(), tuning=False, dropped=dropped)
        with self._condition:
            full = sum(not queued.tuning and not queued.search for queued in self._queue) >= MAX_CHECKS
        if full or not self._submit(job):
            dropped()
            return False
        return True

    def submit_search(self, name: str, run: Callable[[], None], key: Any) -> None:
        """Queue a step of the search after a first plan (`run`), once per `key`; returns at once. It goes behind every
        job queued: the checks of new shapes waiting (at most `MAX_CHECKS`) and the targets waiting for a first plan run
        before the next candidate is built. A new shape is served eager until its check passes, and a step takes
        seconds (a build, or timed rounds): behind one check only, the single queries of a MiniLM service were served
        eager through the whole search (0.27-0.9x a plain call, beside the search's export) while 8 checks waited.
        The bound keeps the search going: a step waits for at most the jobs queued before it. Never dropped for the
        checks' bound."""
        self._submit(_Job(name, run, key, tuning=False, search=True))

    @property
    def checks_waiting(self) -> bool:
        """True while a check of a whole call (new shapes, a gate) is queued."""
        with self._condition:
            return any(not job.tuning and not job.search for job in self._queue)

    def _submit(self, job: _Job) -> bool:
        with self._condition:
            running = self._running
            if self._stopped or (running is not None and running.key is job.key):
                return False
            if any(queued.key is job.key for queued in self._queue):
                return False
            self._queue.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name=self.thread_name, daemon=True)
                self._thread.start()
            self._condition.notify_all()
            return True

    @property
    def pending(self) -> int:
        """Targets queued or being tuned."""
        with self._condition:
            return len(self._queue) + (self._running is not None)

    def status(self) -> dict[str, Any]:
        with self._condition:
            running = self._running
            return {
                "pending": len(self._queue) + (running is not None),
                "tuning": running.name if running is not None and running.tuning else None,
                "checks": sum(not job.tuning and not job.search for job in self._queue)
                + (running is not None and not running.tuning and not running.search),
                "searches": sum(job.search for job in self._queue) + (running is not None and running.search),
                "afresh": self.afresh,
                "tuned": self.tuned,
                # what the worker runs now: "tuning", "search" (a step after a first plan), "check", or None
                "running": None
                if running is None
                else "tuning"
                if running.tuning
                else "search"
                if running.search
                else "check",
            }

    def wait(self, timeout: float | None = None, until: Callable[[], bool] | None = None) -> bool:
        """Wait until nothing is pending (True), `until()` holds, or `timeout` seconds pass (False)."""
        with self._condition:
            return (
                self._condition.wait_for(
                    lambda: (not self._queue and self._running is None) or (until is not None and until()), timeout
                )
                and not self._queue
                and self._running is None
            )

    def stop(self) -> None:
        """Forget what is queued; the worker ends after the tuning it runs (if any)."""
        with self._condition:
            self._stopped = True
            dropped = [job.dropped for job in self._queue if job.dropped is not None]
            self._queue.clear()
            self._condition.notify_all()
        for undo in dropped:
            undo()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker thread to end (after `stop`)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _work(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._queue or self._stopped, timeout=30.0)
                if self._stopped or not self._queue:  # stopped, or idle a while: a later submit starts another
                    self._thread = None
                    return
                job = self._running = self._queue.popleft()
            # This thread only. A check pauses while callers are served (it replays whole calls: as heavy as theirs);
            # a tuning only yields, as it did (its export and builds are measured under traffic, docs/serving.md).
            sys.setprofile(
                _yielding_hook(self._busy if not job.tuning and not job.search else lambda: False, self._in_flight)
            )
            try:
                with on_the_worker():
                    job.run()
            except BaseException:  # contained in the target already; never let the worker die silently
                kind = "tuning" if job.tuning else "search" if job.search else "check"
                logger.exception("aitune_hf: background %s of %s failed", kind, job.name)
            finally:
                sys.setprofile(None)
                with self._condition:
                    self._running = None
                    self.afresh = False
                    self.tuned += job.tuning
                    self._condition.notify_all()
