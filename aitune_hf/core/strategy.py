"""Strategies: build candidates for one signature, check them against eager, time them, choose one."""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from aitune_hf.backends.base import Backend, BuiltBackend, Call, build_context, get_backend
from aitune_hf.core.checks import compare_outputs
from aitune_hf.core.decisions import Decision
from aitune_hf.core.guards import ModuleGuard
from aitune_hf.core.precision import block_budget
from aitune_hf.core.reasons import details, summarize
from aitune_hf.core.report import CandidateResult, SignatureReport
from aitune_hf.core.rng import DrawsRandomNumbers, no_random_draws, random_states
from aitune_hf.core.signature import InputSignature, Sample, describe_family, state_tensors
from aitune_hf.core.strategy_base import STRATEGIES, Strategy, build_cost
from aitune_hf.core.timing import MIN_ROUNDS, Stopwatch, clock, paired_ratios, time_until_settled
from aitune_hf.errors import CandidateUnavailable, ConfigError, TuningError

if TYPE_CHECKING:
    from aitune_hf.core.config import TuningConfig

logger = logging.getLogger(__name__)


class NoEvidence(Exception):
    """No sample of a signature can serve as evidence (non-finite eager output, or not replayable)."""


#: One candidate as timed on a target: its `describe()`, precision and speed-up over eager.
Timed = tuple[str, str, float | None]


class KindEvidence:
    """What the first blocks of a kind showed about each slow-build candidate, for the blocks of that kind tuned later
    (`MinLatency(prune_slow_after=N)`). One per registration (`TuningContext.evidence`): a block's kind is its module's
    class name, a candidate is its `describe()` (which names its precision: bf16 Inductor and fp32 Inductor are two
    candidates). It also keeps what was timed on each target (`record_timed`), which the search after a first plan
    hands to `Backend.cannot_win` for the targets searched later (OpenVINO's second door, `backends/openvino.py`).

    Each target that built a slow candidate leaves one outcome for it: a loss (it failed, was wrong, or was timed
    below `LOSS_RATIO` of the chosen speed-up, or below `min_speedup` when eager was kept) or not (it won, or came
    close). Once N targets of a kind have built a candidate and every one lost, later targets of that kind skip it
    ("skipped: lost on the first 2 CrossAttnDownBlock2D blocks ..."): its 5-30 s compiles are not spent where it has
    not won. One outcome that did not lose keeps it built for the kind. Pruning changes which candidates are tried,
    never what serves: whatever serves passed its checks as before.
    """

    #: A candidate timed below this share of the chosen candidate's speed-up lost; closer, it could win elsewhere.
    LOSS_RATIO = 0.9

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: dict[tuple[str, str], dict[str, str | None]] = {}  # (kind, candidate) -> {target: loss}
        self._timed: dict[str, list[Timed]] = {}  # target -> what was timed on it, first timed first

    def record_timed(self, target: str, timed: Sequence[Timed]) -> None:
        """What was timed on `target` so far (each candidate's `describe()`, precision and speed-up over eager): the
        evidence `Backend.cannot_win` weighs for the targets searched after it (`elsewhere`)."""
        with self._lock:
            self._timed[target] = list(timed)

    def timed_elsewhere(self, target: str) -> dict[str, list[Timed]]:
        """What was timed on the other targets of the same model part as `target` (the first part of its dotted name:
        a pipeline's "unet", "vae", "text_encoder"; the registered module's child), in the order they were first timed.
        Evidence about a backend's conversion of one model holds across that model's blocks, less across models: SD
        small's CLIP layer ran faster through OpenVINO's torch.export door, its UNet and VAE blocks did not."""
        part = target.split(".", 1)[0]
        with self._lock:
            return {
                name: list(timed)
                for name, timed in self._timed.items()
                if name != target and timed and name.split(".", 1)[0] == part
            }

    def record(self, kind: str, candidate: str, target: str, loss: str | None) -> None:
        """`target` (of `kind`) built `candidate`: `loss` says how it lost, None when it did not."""
        with self._lock:
            self._outcomes.setdefault((kind, candidate), {})[target] = loss

    def pruned(self, kind: str, candidate: str, after: int) -> str | None:
        """Why `candidate` is not built for another target of `kind` (it lost on each of at least `after` targets of
        that kind), or None."""
        with self._lock:
            outcomes = dict(self._outcomes.get((kind, candidate), {}))
        if after <= 0 or len(outcomes) < after or any(loss is None for loss in outcomes.values()):
            return None
        losses = "; ".join(f"{target}: {loss}" for target, loss in list(outcomes.items())[:3])
        return f"lost on the first {len(outcomes)} {kind} blocks ({losses})"


class TuningJob:
    """Everything a strategy needs to tune one signature, or one shape family, of one target.

    `samples` maps each signature to its recorded calls, hottest signature first. With `dynamic`, the signatures
    are one shape family (`InputSignature.family`): a polymorphic backend is built once for all of them
    (`Backend.build(..., dynamic=True)`), checked on every recorded call of every shape, and timed on one call
    of each of the `TIMED_SHAPES` hottest shapes (fewer where their eager calls take over `TIMED_ROUND_S` a round).
    A backend that builds one shape at a time is tried only on a family of one shape, and then serves that shape
    only.

    Replays never touch what the user holds: each replay gets fresh copies of object inputs (`Sample.as_call`),
    and a candidate's check compares both its outputs and what it did to those objects (a KV cache it
    updates) with eager's. A sample whose eager output is not finite is no evidence and is dropped.

    Budget: with `config.budget_s`, the job's `deadline` is `started` (a `timing.clock()` value: when the target began
    tuning; default: now) plus the budget. Strategies skip the candidates they have not built once it has passed,
    and timing stops at the first round past it. A build or a check in progress is not interrupted, so a target can
    overrun its budget by one build, its check and one timed round.

    Kind: `kind` (default: the module's class name), `name` (the target's) and `evidence` (the registration's
    `KindEvidence`, or None) let a strategy skip slow builds that lost on the first blocks of the same kind.

    Seconds: the report splits them into `reference_seconds` (eager reference outputs) and, per candidate,
    `build_seconds`, `check_seconds` and `timing_seconds` (its own timed runs, plus an equal share of the session's
    eager runs and input copies among the candidates timed together).

    Raises:
        NoEvidence: no sample is left to check candidates against.
    """

    #: Shapes of a family that candidates are timed on (the hottest ones).
    TIMED_SHAPES = 3
    #: Eager seconds a timed round may take: beyond the hottest shape, another is timed only while the round's eager
    #: calls stay within it. A whole MiniLM at batch 32 takes 0.5 s a call; its three shapes made a round of eager and
    #: two candidates 4.5 s, and a candidate near the threshold 15 rounds: 70 s of timing for one decision.
    TIMED_ROUND_S = 0.3

    def __init__(
        self,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        samples: Mapping[InputSignature, Sequence[Sample]],
        config: TuningConfig,
        restriction: Callable[[Backend], str | None] = lambda backend: None,
        dynamic: bool = False,
        started: float | None = None,
        kind: str | None = None,
        name: str | None = None,
        evidence: KindEvidence | None = None,
        baseline: Callable[..., Any] | None = None,
        anytime: bool = False,
        back_to_back: bool = False,
        whole: bool = False,
    ) -> None:
        started = clock() if started is None else started
        #: The target is a whole model (`Target.whole`): anytime tuning tries its quick builds first (`MinLatency`).
        self.whole = whole
        #: The target's calls run back to back (`Target.back_to_back`): where a candidate keeps its own copy of the
        #: weights, candidates are timed in warm turns (`timing.time_until_settled`), as they will serve.
        self.back_to_back = back_to_back
        #: Anytime tuning (`TuningConfig.anytime`, `core/refine.py`): a strategy may choose the first candidate that
        #: wins clearly and leave the rest of its tier (`deferred`) to a search off the callers' threads (`refine`).
        self.anytime = anytime
        #: The candidates the first plan left untried (built later by `Strategy.refine`, on the worker).
        self.deferred: list[Backend] = []
        #: The candidates still in contention when the strategy chose (the winner among them): what a refinement times
        #: its new candidates beside.
        self.contenders: list[tuple[Backend, CandidateResult, BuiltBackend]] = []
        #: Candidates built and checked with one that reads the same form (`Backend.reads`, `_checked_first`) and not
        #: timed yet, by `describe()`: the tuning call or the search after it times them without building them again.
        self.prebuilt: dict[str, tuple[CandidateResult, BuiltBackend]] = {}
        #: True when the search should stop before its next build (`core/refine.py`: the plan it searches for is gone).
        self.halted: Callable[[], bool] = lambda: False
        #: The fastest plan the search has timed so far (`MinLatency.refine_step`): the first plan, until one is timed
        #: faster than it.
        self.leader: tuple[Backend, CandidateResult, BuiltBackend] | None = None
        #: The first plan's figures are its check's estimate (`_far_ahead`) or a few rounds' (`_first_look`): the search
        #: times it against eager first.
        self.first_look = False
        #: Why eager leads the search (its first plan timed not faster than eager, nothing faster since), or None.
        self.eager_leads: str | None = None
        #: Per candidate, the seconds each recorded call took in its check (`estimate`).
        self._check_seconds: dict[str, list[float]] = {}
        self._identical: set[str] = set()  # candidates whose build was an earlier build itself (`try_backend`)
        #: What the candidates are timed against (`time`'s "eager"): `forward`, or for a target kept whole over its
        #: blocks its forward with the blocks served (`Target.inner`); references and builds use `forward`.
        self.baseline = baseline if baseline is not None else forward
        #: The block's kind (its module's class name), its target's name, and what earlier blocks of the kind showed.
        self.kind = kind if kind is not None else type(module).__name__
        self.name = name if name is not None else self.kind
        self.evidence = evidence
        self.deadline = None if config.budget_s is None else started + config.budget_s
        self.module = module
        self.forward = forward
        self.signatures = list(samples)
        self.signature = self.signatures[0]
        self.dynamic = dynamic
        self.config = config
        self.restriction = restriction
        self.devices = sorted(self.signature.devices, key=str)
        replayable = [(sig, s) for sig, kept in samples.items() for s in kept if s.unreplayable is None]
        if not replayable:
            reasons = sorted({s.unreplayable for kept in samples.values() for s in kept if s.unreplayable})
            raise NoEvidence(f"recorded calls cannot be replayed: {'; '.join(reasons)}")
        hot = set(self.signatures[: self.TIMED_SHAPES])  # timed on one call of each
        self.samples: list[Sample] = []
        self.references: list[Any] = []
        self._timed: list[int] = []  # indices into samples of the calls that are timed
        with Stopwatch(self.devices) as references, self.mode():
            try:  # stopped before it draws, if the forward draws random numbers (core/rng.py)
                with no_random_draws():
                    self._references(forward, replayable, hot)
            except DrawsRandomNumbers:
                raise
            except Exception:  # the forward raised, or cannot run under a dispatch mode: again, watching the states
                states = random_states()
                self._references(forward, replayable, set(self.signatures[: self.TIMED_SHAPES]))
                if not all(torch.equal(a, b) for a, b in zip(states, random_states(), strict=True)):
                    raise DrawsRandomNumbers(
                        "the forward draws random numbers: no backend would leave the random stream where eager does"
                    ) from None
        if not self.samples:
            raise NoEvidence(
                f"no finite eager reference: all {len(replayable)} recorded call(s) gave non-finite outputs"
            )
        if not self._timed:
            self._timed = list(range(len(self.samples)))
        self._timed = self._affordable(self._timed)
        self.report = SignatureReport(
            signature=describe_family(self.signatures),
            samples=len(self.samples),
            reference_seconds=references.seconds,
        )
        #: Guards of the built candidates, by backend name (what each depends on besides its inputs).
        self.guards: dict[str, ModuleGuard] = {}
        #: The latest (lower, upper) confidence bounds of each timed candidate's speed-up (`timing.median_bounds`).
        self.bounds: dict[str, tuple[float, float]] = {}
        #: Eager's and each candidate's seconds per round in its latest timing against eager (`time(resume=True)`).
        self.round_times: dict[str, tuple[list[float], list[float]]] = {}

    def _references(self, forward: Callable[..., Any], replayable: list[tuple[Any, Sample]], hot: set[Any]) -> None:
        """Replay every recorded call eager: the references the candidates are checked against (and which calls of
        the hottest shapes are timed)."""
        self.samples, self.references, self._timed, self._seconds, self._outputs = [], [], [], [], []
        for signature, sample in replayable:
            call = sample.as_call()
            with Stopwatch(self.devices) as watch:
                output = forward(*call[0], **call[1])
            reference = self._observe(sample, call, output)
            if _all_finite(reference):
                if signature in hot:
                    hot.discard(signature)
                    self._timed.append(len(self.samples))
                self.samples.append(sample)
                self.references.append(reference)
                self._seconds.append(watch.seconds)
                self._outputs.append(output)  # the forward's own output, for the builds (`BuildContext.outputs`)

    def _affordable(self, timed: list[int]) -> list[int]:
        """The calls to time, hottest first: the first, then each next one while the round's eager seconds (as the
        references took them) stay within `TIMED_ROUND_S`."""
        kept, spent = [], 0.0
        for index in timed:
            spent += self._seconds[index]
            if kept and spent > self.TIMED_ROUND_S:
                break
            kept.append(index)
        return kept

    @property
    def budget_spent(self) -> bool:
        """True once `config.budget_s` has passed since the target began tuning (never without a budget)."""
        return self.deadline is not None and clock() >= self.deadline

    @property
    def timed_calls(self) -> list[int]:
        """Indices into `samples` of the calls that are timed (the hottest shapes first)."""
        return list(self._timed)

    def estimate(self, result: CandidateResult) -> float | None:
        """A candidate's speed-up as its check showed it, with no timing of its own: the smallest ratio over the
        recorded calls of eager's seconds (its reference run) to the candidate's (its check run, the candidate's first
        run of each call: cold, so this errs low). None where it was not checked. One run each side: an estimate for
        a first plan that wins by far (`FIRST_PLAN_MARGIN`), which the search after it times side by side."""
        seconds = self._check_seconds.get(result.backend)
        if not seconds or len(seconds) != len(self._seconds):
            return None
        return min(eager / max(mine, 1e-9) for eager, mine in zip(self._seconds, seconds, strict=True))

    def skip(self, backend: Backend, why: str, kind: str | None = None) -> CandidateResult:
        """Record `backend` as not tried: its row says "skipped: <why>"; `kind` is `CandidateResult.skipped_for`."""
        result = CandidateResult(backend=backend.describe(), error=f"skipped: {why}", skipped_for=kind)
        self.report.candidates.append(result)
        return result

    def skip_for_budget(self, backend: Backend) -> CandidateResult:
        return self.skip(backend, f"tuning budget of {self.config.budget_s:g} s spent", kind="budget")

    def fresh_calls(self) -> list[Call]:
        """The samples as `(args, kwargs)`, object inputs copied afresh."""
        return [sample.as_call() for sample in self.samples]

    def _observe(self, sample: Sample, call: Call, output: Any) -> Any:
        """What a replay produced: its output, plus the tensors of the object inputs it may have changed."""
        objects = sample.objects_of(call)
        return (output, [state_tensors(obj) for obj in objects]) if objects else output

    @contextlib.contextmanager
    def mode(self) -> Iterator[None]:
        """The grad / inference mode the signature's calls were made in."""
        if self.signature.inference_mode:
            with torch.inference_mode():
                yield
        else:
            with torch.inference_mode(False), torch.set_grad_enabled(self.signature.grad_enabled):
                yield

    def unavailable_reason(self, backend: Backend) -> str | None:
        reason = self.restriction(backend) or backend.unavailable_reason(self.signature.devices)
        if reason is None and self.signature.grad_enabled and not backend.supports_autograd:
            reason = (
                "calls run with autograd enabled and this backend cannot backpropagate "
                "(call under torch.inference_mode() or torch.no_grad() to allow it)"
            )
        if reason is None and self.signature.has_opaque_leaves and not backend.accepts_objects:
            objects = ", ".join(sorted({str(leaf) for leaf in self.signature.opaque_leaves}))
            reason = f"inputs hold objects ({objects}) that this backend cannot take"
        return reason

    def try_backend(self, backend: Backend) -> tuple[CandidateResult, BuiltBackend | None]:
        """Build `backend` and check it on every sample; never raises for a failing backend. A reduced-precision
        candidate is checked by its relative error against the per-block budget (`precision.block_budget`). A build
        made from an identical module's work (`BuiltBackend.reused`) that fails its check is built again afresh (not the
        earlier build itself, `BuiltBackend.identical`: a fresh one would be the same)."""
        result, built = self._try_backend(backend)
        if built is None and result.reused and result.backend not in self._identical:
            logger.debug("%s: a build reusing an identical module's work failed (%s); building afresh",
                         result.backend, result.error)  # fmt: skip
            candidates = self.report.candidates
            del candidates[next(i for i, c in enumerate(candidates) if c is result)]
            with build_context(sibling=False, state=None):
                again, built = self._try_backend(backend)
            again.build_seconds = (again.build_seconds or 0.0) + (result.build_seconds or 0.0)
            again.check_seconds = (again.check_seconds or 0.0) + (result.check_seconds or 0.0)
            result = again
        return result, built

    def _try_backend(self, backend: Backend) -> tuple[CandidateResult, BuiltBackend | None]:
        result = CandidateResult(backend=backend.describe(), precision=backend.precision)
        budget = block_budget(backend.precision)
        self.report.candidates.append(result)
        reason = self.unavailable_reason(backend)
        if reason is not None:
            result.error, result.skipped_for = f"unavailable: {reason}", "unavailable"
            return result, None
        if self.dynamic and not backend.polymorphic and len(self.signatures) > 1:
            result.error = f"unavailable: builds one shape at a time, and this family has {len(self.signatures)}"
            result.skipped_for = "unavailable"
            return result, None
        building, checking = Stopwatch(self.devices), Stopwatch(self.devices)
        try:
            with building, self.mode():
                calls = self.fresh_calls()  # copied in the calls' mode, counted as the build's seconds, as before
                with build_context(outputs={id(c): out for c, out in zip(calls, self._outputs, strict=True)}):
                    if self.dynamic and backend.polymorphic:
                        built = backend.build(self.module, self.forward, calls, dynamic=True)
                    else:
                        built = backend.build(self.module, self.forward, calls)
            result.reused, result.note = built.reused, built.note
            if built.reused and built.identical:
                self._identical.add(result.backend)
            worst = worst_rel = 0.0
            seconds = self._check_seconds[result.backend] = []
            with checking, self.mode():
                for sample, reference in zip(self.samples, self.references, strict=True):
                    call = sample.as_call()
                    with Stopwatch(self.devices) as run:
                        output = built.fn(*call[0], **call[1])
                    seconds.append(run.seconds)
                    observed = self._observe(sample, call, output)
                    check = compare_outputs(reference, observed, self.config.tolerance, budget)
                    worst, worst_rel = max(worst, check.max_abs_error), max(worst_rel, check.rel_error)
                    if not check.ok:
                        result.max_abs_error, result.rel_error = check.max_abs_error, check.rel_error
                        result.error = f"wrong output: {check.reason}"
                        return result, None
                result.max_abs_error, result.rel_error = worst, worst_rel
                self.guards[result.backend] = ModuleGuard(
                    self.module, weights=built.bakes_weights, weight_check=self.config.weight_check
                )
            return result, built
        except CandidateUnavailable as error:  # found while building: it does not apply to this block (no session made)
            result.error, result.skipped_for = f"unavailable: {error}", "unavailable"
            return result, None
        except Exception as error:  # a failing backend is a finding, not a crash
            logger.debug("%s failed on %s", backend.describe(), self.signature, exc_info=True)
            result.error, result.details = summarize(error), details(error)
            return result, None
        finally:  # seconds spent count, whether the build or the check failed or not
            result.build_seconds = building.seconds
            result.check_seconds = checking.seconds if checking.start else None

    def time(
        self,
        candidates: Sequence[tuple[CandidateResult, BuiltBackend]],
        thresholds: Sequence[float] | None = None,
        against: tuple[CandidateResult, BuiltBackend] | None = None,
        rounds: int | None = None,
        warmup: int | None = None,
        resume: bool = False,
    ) -> list[CandidateResult]:
        """Time eager and the candidates side by side until each speed-up is decided against `thresholds` (default:
        `config.min_speedup`), at most `config.repeats` rounds (`timing.time_until_settled`); fills latencies,
        speed-ups (median of the per-round paired ratios), rounds, timing seconds and `self.bounds`.

        `against`: a candidate timed against eager before (the plan that serves, in the search after it), timed in
        eager's place: each speed-up is then its paired ratio to `against` times `against`'s speed-up (two ratios, each
        paired in its own rounds), its latency `against`'s over that ratio, and the thresholds are ratios to
        `against`. A search at batch 32 of a whole MiniLM then runs OpenVINO's 0.25 s call in each round where eager's
        1 s call ran. `rounds`: at most this many timed rounds (default `config.repeats`); `warmup`: untimed rounds
        before them (default `config.warmup`). `resume`: one candidate timed against eager before (its first look) goes
        on from those rounds (`timing.time_until_settled`'s `prior`: its seconds per round and eager's, `round_times`).

        Returns the candidates that survived; one that raised while being timed gets its error recorded.
        """
        scale, eager = 1.0, self.baseline
        if against is not None:
            scale, eager = against[0].speedup or 1.0, self.serving(*against)
        fns = {"eager": eager} | {result.backend: self.serving(result, built) for result, built in candidates}
        timed = [self.samples[i] for i in self._timed]
        stateful = any(sample.stateful for sample in timed)
        # Cold turns mis-rank only an engine with its own copy of the weights (and its own threads) against eager's,
        # whose weights the others share: warm turns where one is timed (each costs up to 10 ms more per turn).
        timed_builds = [built for _, built in candidates] + ([against[1]] if against is not None else [])
        warm = self.back_to_back and any(built.bakes_weights for built in timed_builds)
        self.report.back_to_back = self.report.back_to_back or warm

        def fresh() -> list[Call]:
            return [sample.as_call() for sample in timed]

        if thresholds is None:
            thresholds = (self.config.min_speedup,)
        with Stopwatch(self.devices) as watch, self.mode():
            calls = fresh if stateful else fresh()
            timing = time_until_settled(
                fns,
                calls,
                self.devices,
                self.config.warmup if warmup is None else warmup,
                rounds or self.config.repeats,
                baseline="eager",
                thresholds=thresholds,
                deadline=self.deadline,
                warm_turns=warm,
                prior=self._prior(candidates) if resume and against is None else None,
            )
        if against is None:
            for result, _ in candidates:
                if result.backend in timing.times:
                    self.round_times[result.backend] = (timing.times["eager"], timing.times[result.backend])
        own = {result.backend: timing.seconds.get(result.backend, 0.0) for result, _ in candidates}
        shared = max(watch.seconds - sum(own.values()), 0.0) / max(len(candidates), 1)  # eager's runs, copies
        for result, _ in candidates:
            result.timing_seconds = (result.timing_seconds or 0.0) + own[result.backend] + shared
        if against is None:
            self.report.eager_latency_s = timing.latencies["eager"]
        survivors = []
        for result, _ in candidates:
            if result.backend in timing.failures:
                error = timing.failures[result.backend]
                result.error, result.details = f"failed while timed: {summarize(error)}", details(error)
                continue
            result.latency_s = timing.latencies[result.backend]
            if against is not None and against[0].latency_s and timing.speedups[result.backend]:
                # In the rounds `against` was timed beside eager, as its speed-up is: a report's row then sets it
                # against eager's time from the same rounds. Its own time here is another host's load (measured: an
                # SD block's row read 6.4 ms eager, 7.1 ms tuned and 2.47x, its rounds run beside the traffic's calls).
                result.latency_s = against[0].latency_s / timing.speedups[result.backend]
            result.speedup = timing.speedups[result.backend] * scale
            result.rounds = timing.timed[result.backend]  # fewer where it was retired early
            low, high = timing.bounds[result.backend]
            self.bounds[result.backend] = (low * scale, high * scale)
            survivors.append(result)
        return survivors

    def _prior(self, candidates: Sequence[tuple[CandidateResult, BuiltBackend]]) -> dict[str, list[float]] | None:
        """The rounds a lone candidate was timed against eager before, eager's and its seconds per round; else None."""
        if len(candidates) != 1 or candidates[0][0].backend not in self.round_times:
            return None
        eager, mine = self.round_times[candidates[0][0].backend]
        return {"eager": eager, candidates[0][0].backend: mine} if len(eager) == len(mine) else None

    def serving(self, result: CandidateResult, built: BuiltBackend) -> Callable[..., Any]:
        """The candidate as it will serve: behind its guard check, whose cost is part of what is timed (checked while
        the backend computes where it computes on threads of its own, `BuiltBackend.start`, as `Target.call` does)."""
        guard = self.guards[result.backend]

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if built.start is None:
                guard.check()
                return built.fn(*args, **kwargs)
            started = built.start(*args, **kwargs)
            guard.check()
            return started.result()

        return guarded

    def keep_eager(self, reason: str) -> Decision:
        self.report.chosen, self.report.reason = "eager", reason
        return Decision(None, None, self.report)

    def choose(
        self,
        backend: Backend,
        result: CandidateResult,
        built: BuiltBackend,
        fallback: tuple[Backend, CandidateResult, BuiltBackend] | None = None,
        fp32_lost: str | None = None,
    ) -> Decision:
        """`backend` serves; a reduced-precision one with `fallback`, the fp32 candidate it falls back to, or with
        `fp32_lost`, why none would (`Decision.fp32_lost`)."""
        self.report.chosen, self.report.reason = result.backend, None
        kept = None if fallback is None else (fallback[0], fallback[2], self.guards[fallback[1].backend])
        lost = fp32_lost if kept is None and backend.precision != "fp32" else None
        return Decision(backend, built, self.report, self.guards[result.backend], kept, fp32_lost=lost)

    def failures(self) -> str:
        return "; ".join(f"{c.backend}: {c.error}" for c in self.report.candidates if c.error)


def _fp32_lost(
    job: TuningJob, fp32: list[Backend], timed: list[tuple[Backend, CandidateResult, BuiltBackend]]
) -> str | None:
    """Why no fp32 candidate would serve this signature, where tuning timed them beside the reduced winner
    (`Decision.fp32_lost`); None where the tuning budget ran out before one of them: a tuning in fp32 may then find
    one."""
    names = {backend.describe() for backend in fp32}
    if any(c.skipped_for == "budget" for c in job.report.candidates if c.backend in names):
        return None
    best = _best([c for c in timed if c[0].precision == "fp32"])
    if best is not None:
        return f"best fp32 {best[1].backend} at {best[1].speedup or 0.0:.2f}x (needs {job.config.min_speedup:.2f}x)"
    return "no fp32 candidate was built" if fp32 else "no fp32 candidate among the backends"


def _all_finite(value: Any) -> bool:
    """True when every floating-point (or complex) tensor in `value` is finite."""
    for leaf in pytree.tree_leaves(value):
        floating = isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
        if floating and not bool(torch.isfinite(leaf).all()):
            return False
    return True


class MinLatency(Strategy):
    """Keep the fastest correct candidate if it beats eager by `min_speedup`, else eager; skip slow builds once a
    cheap one clearly wins.

    The cheap candidates (`build_cost`) are built, checked and timed together first. If the fastest of them has a
    speed-up whose lower confidence bound (`timing.median_bounds`) exceeds `max(min_speedup, clear_speedup)`, it is a
    clear winner: the slow builds are skipped ("skipped: onnxruntime won clearly (at least 1.21x), and inductor
    builds slowly"). Otherwise the slow candidates are built and checked, and timed side by side with the cheap
    ones that were not settled below `min_speedup`; the fastest (highest speed-up) of all that were timed is chosen.
    `skip_slow_builds=False` builds every candidate. Measured here on CPU: ONNX Runtime won every block (1.14-2.01x),
    Inductor none (0.89-1.20x) and its builds take 5-30 s a block against 1-5 s for the ONNX export.

    `prune_slow_after` (default 2; 0: never): a slow build that lost on each of the first N blocks of a kind (the same
    module class) is skipped on the later blocks of that kind (`KindEvidence`): "skipped: lost on the first 2
    CrossAttnDownBlock2D blocks (...)". One block of the kind where it won or came within 10% keeps it built.
    A slow build of a reduced precision is skipped where a cheap build of that precision settled below
    `min_speedup` on the block and none of it won (`_precision_lost`: bf16 without AMX).

    Anytime (`TuningJob.anytime`): the cheap candidates one at a time (on a whole model, `TuningJob.whole`, a quick
    build first: OpenVINO's trace door, which waits for no export), the first that is faster than eager serving while
    the rest is searched after it (`refine_step`): one clearly ahead at once, one only ahead (`FIRST_PLAN_BAR`) as a
    first look that the search times against eager fully first. Where the first is not ahead of eager on its check,
    those that read its form (`Backend.reads`, the ONNX export) are built and checked with it and timed
    fastest-on-check first (`_checked_first`).
    """

    name = "min_latency"

    def __init__(
        self,
        skip_slow_builds: bool = True,
        clear_speedup: float = 1.05,
        order: str = "cost",
        prune_slow_after: int = 2,
    ) -> None:
        super().__init__(order)
        if isinstance(prune_slow_after, bool) or not isinstance(prune_slow_after, int) or prune_slow_after < 0:
            raise ConfigError(
                f"MinLatency(prune_slow_after=...) must be an int >= 0 (0: never prune), got {prune_slow_after!r}"
            )
        self.skip_slow_builds = skip_slow_builds
        self.clear_speedup = clear_speedup
        self.prune_slow_after = prune_slow_after

    def decide(self, job: TuningJob, backends: Sequence[Backend]) -> Decision:
        decision = self._decide(job, backends)
        _record_timed(job)
        if job.evidence is not None and self.prune_slow_after:
            self._record(job, [b.describe() for b in backends if build_cost(b) == "slow"], decision)
        return decision

    def _record(self, job: TuningJob, slow: list[str], decision: Decision) -> None:
        """What each slow candidate built for `job` showed, for the later blocks of its kind (`KindEvidence`)."""
        assert job.evidence is not None
        chosen = next((c for c in job.report.candidates if c.backend == decision.report.chosen), None)
        bar = job.config.min_speedup if chosen is None else (chosen.speedup or 0.0) * KindEvidence.LOSS_RATIO
        for result in job.report.candidates:
            if result.backend not in slow or result.build_seconds is None:  # not built here (skipped, unavailable)
                continue
            if result is chosen:
                loss: str | None = None
            elif result.error is not None:
                loss = result.error if len(result.error) <= 80 else result.error[:79] + "…"
            elif (result.speedup or 0.0) < bar:
                against = "eager" if chosen is None else f"{chosen.backend} {chosen.speedup or 0.0:.2f}x"
                loss = f"{result.speedup or 0.0:.2f}x against {against}"
            else:
                loss = None
            job.evidence.record(job.kind, result.backend, job.name, loss)

    def _decide(self, job: TuningJob, backends: Sequence[Backend]) -> Decision:
        ordered = self.ordered(backends)
        clear = max(job.config.min_speedup, self.clear_speedup)
        # Reduced precision (opt-in) first: it is what was asked for, and where it wins clearly the fp32 candidates
        # are not built at all (a block it wins by far pays no fp32 export or compile). If the end-to-end gate sends
        # it back, the block runs eager and tunes again in fp32 (`Target.demote`).
        reduced = [b for b in ordered if b.precision != "fp32"]
        timed = self._tiers(job, reduced, [], clear) if reduced else []
        winner = _best(timed)
        fp32 = [b for b in ordered if b.precision == "fp32"]
        fp32_tried = True
        if reduced and winner is not None and job.bounds.get(winner[1].backend, (0.0, 0.0))[0] > clear:
            low = job.bounds[winner[1].backend][0]
            for backend in fp32:
                job.skip(backend, f"{winner[1].backend} won clearly (at least {low:.2f}x); fp32 is tried if it fails")
            fp32_tried = False
        elif fp32:
            timed = self._tiers(job, fp32, timed, clear)
        best = _best(timed)
        job.contenders = list(timed)
        if best is None:
            job.deferred = []  # nothing serves: nothing to refine (a new tuning tries them all)
            return job.keep_eager(_nothing_worked(job, backends))
        backend, result, built = best
        if (result.speedup or 0.0) < job.config.min_speedup:
            job.deferred = []
            return job.keep_eager(
                f"nothing was faster: best {result.backend} at {result.speedup:.2f}x "
                f"(needs {job.config.min_speedup:.2f}x)"
            )
        fallback, fp32_lost = _fallback(job, backend, timed, fp32 if fp32_tried else None)
        return job.choose(backend, result, built, fallback, fp32_lost)

    def refine_step(self, job: TuningJob, current: Decision) -> bool:
        """One step of the search the first plan (`current`) left, off the callers' threads (`core/refine.py`); True
        while steps are left. Where the first plan's figures are its check's estimate (`_far_ahead`) or a few rounds'
        (`_first_look`), the first step times it against eager; where that shows it not faster than eager
        (`config.min_speedup`), eager leads (`TuningJob.eager_leads`). Each later step builds and checks the next
        deferred candidate as `decide` does (skipped where the evidence says it cannot win: `_precision_lost`,
        `_cannot_win`), and times it side by side with the fastest plan so far (`TuningJob.time(against=...)`; beside
        eager where eager leads): it leads from then on where it was timed faster by `SWITCH_MARGIN`."""
        leader = job.leader
        if leader is None and job.eager_leads is None:
            leader = next((c for c in job.contenders if c[1].backend == current.report.chosen), None)
        if (leader is None and job.eager_leads is None) or job.halted():
            job.deferred = []
            return False
        job.leader = leader
        if leader is not None and job.first_look:  # an estimate, or a few rounds: timed against eager first
            job.first_look = False
            # After a first look both ran the calls warm (the plan in its rounds, eager in the traffic): no warm-up, and
            # its rounds count as the first.
            survivors = job.time([(leader[1], leader[2])], warmup=0 if leader[1].rounds else None, resume=True)
            _record_timed(job)
            speed, failed = leader[1].speedup or 0.0, all(r is not leader[1] for r in survivors)
            if failed or speed < job.config.min_speedup:
                job.leader = None
                job.eager_leads = (
                    f"{leader[1].backend}, the first plan, failed while timed by the search: {leader[1].error}"
                    if failed
                    else f"{leader[1].backend}, the first plan, was timed by the search at {speed:.2f}x eager "
                    f"(needs {job.config.min_speedup:.2f}x)"
                )
            return bool(job.deferred)
        if not job.deferred:
            return False
        backend = job.deferred.pop(0)
        prebuilt = job.prebuilt.pop(backend.describe(), None)  # built and checked already: only its timing is left
        if prebuilt is None and job.budget_spent:
            job.skip_for_budget(backend)
        elif prebuilt is None and (lost := _precision_lost(job, backend) or _cannot_win(job, backend)) is not None:
            job.skip(backend, lost, kind="evidence")
        else:
            result, built = prebuilt or job.try_backend(backend)
            # A switch needs confidence: at least the rounds the sign test needs for a bound (`timing.MIN_ROUNDS`), and
            # no more than `SEARCH_ROUNDS`: a lead not shown by then is within the noise, and the plan stays.
            rounds = max(min(job.config.repeats, SEARCH_ROUNDS), MIN_ROUNDS)
            base = (leader[1].speedup or 1.0) if leader is not None else 1.0
            need = 1 + SWITCH_MARGIN if leader is not None else max(job.config.min_speedup, 1 + SWITCH_MARGIN)
            against = leader[1:] if leader is not None else None
            if built is not None and job.time([(result, built)], (need,), against, rounds):
                job.contenders.append((backend, result, built))
                low = job.bounds[result.backend][0] / base
                if low > 1.0 and (result.speedup or 0.0) >= base * need:
                    job.leader, job.eager_leads = (backend, result, built), None
            _record_timed(job)
        return bool(job.deferred)

    def refine(self, job: TuningJob, current: Decision) -> Decision | None:
        """The end of the search (`refine_step`): the decision of the plan that led, where it is not the first plan
        (its fallback, for reduced precision, the fastest fp32 candidate timed), eager's where eager led (the first
        plan timed slower than eager, and nothing faster found), else None: the first plan serves on."""
        if job.halted():
            return None
        if job.eager_leads is not None and job.leader is None:
            return job.keep_eager(job.eager_leads)
        leader = job.leader
        if leader is None or leader[1].backend == current.report.chosen:
            return None
        fp32 = [c[0] for c in job.contenders if c[0].precision == "fp32"]
        fallback, fp32_lost = _fallback(job, leader[0], job.contenders, fp32 or None)
        return job.choose(*leader, fallback, fp32_lost)

    def _tiers(
        self,
        job: TuningJob,
        backends: list[Backend],
        timed: list[tuple[Backend, CandidateResult, BuiltBackend]],
        clear: float,
    ) -> list[tuple[Backend, CandidateResult, BuiltBackend]]:
        """Build, check and time `backends` cheap builds first, then slow ones unless a cheap one (or one of `timed`)
        won clearly; returns every candidate still in contention, timed side by side."""
        cheap = [b for b in backends if build_cost(b) == "cheap"]
        slow = [b for b in backends if build_cost(b) == "slow"]
        if job.anytime and job.whole:  # a whole model's first plan: a quick build first (no export to wait for)
            cheap.sort(key=lambda backend: getattr(backend, "build_cost", None) != "quick")
        if self.order == "given":  # one tier, in the order given: nothing is skipped for its cost
            cheap, slow = backends, []
        for tier, thresholds, slow_tier in (
            (cheap, (job.config.min_speedup, clear), False),
            (slow, (job.config.min_speedup,), True),
        ):
            if not tier:
                continue
            winner = _best(timed)
            if slow_tier and self.skip_slow_builds and winner is not None:
                low = job.bounds.get(winner[1].backend, (0.0, 0.0))[0]
                if low > clear:
                    # A clear win skips the slow builds in fp32 and in the winner's own precision; those of another
                    # reduced precision are still built (the end-to-end gate may send an int8 win back, where bf16
                    # would pass): here, or anytime by the search after the plan (below).
                    beaten = ("fp32", winner[0].precision)
                    for backend in [b for b in tier if b.precision in beaten]:
                        job.skip(
                            backend,
                            f"{winner[1].backend} won clearly (at least {low:.2f}x), and {backend.name} builds slowly",
                        )
                    tier = [b for b in tier if b.precision not in beaten]
                    if not tier:
                        break
                if job.anytime and _ahead(job, winner):
                    # Anytime, a plan ahead of eager serves now: a slow build that builds from a private copy is left
                    # to the search after it; one that compiles the live module cannot be built there, and is skipped
                    # (anytime=False builds it in the call). Building it here put SD small's first tuned call at 63 s
                    # (Inductor: 17 s on unet.down_blocks.0, where OpenVINO served 1.22x), and a whole MiniLM's at
                    # 23.7 s where OpenVINO bf16 won clearly (ONNX Runtime's int8, another reduced precision: 9.5 s in
                    # the call; the search declines it once OpenVINO's int8 is timed, `Backend.cannot_win`).
                    for backend in [b for b in tier if not b.builds_privately]:
                        job.skip(
                            backend,
                            f"{winner[1].backend} serves as a first plan ({winner[1].speedup:.2f}x), and "
                            f"{backend.name} builds slowly from the live module, which the search after it cannot "
                            f"(anytime=False builds it in the call that tunes)",
                        )
                    job.deferred += [b for b in tier if b.builds_privately]
                    break
            # Anytime (`TuningJob.anytime`): the cheap builds one at a time, each timed as soon as it is checked; the
            # first faster than eager serves, and the rest of the tier is left to the search after it (`refine`).
            one_at_a_time = job.anytime and not slow_tier and self.skip_slow_builds
            steps = [[b] for b in tier] if one_at_a_time else [tier]
            for index, step in enumerate(steps):
                built_now = []
                for backend in step:
                    if (prebuilt := job.prebuilt.pop(backend.describe(), None)) is not None:
                        built_now.append((backend, *prebuilt))
                        continue
                    if job.budget_spent:
                        job.skip_for_budget(backend)
                        continue
                    lost = None
                    if slow_tier and self.skip_slow_builds:
                        lost = _precision_lost(job, backend)  # None for fp32: the rule is reduced precision's
                    if lost is None and slow_tier and job.evidence is not None:
                        lost = job.evidence.pruned(job.kind, backend.describe(), self.prune_slow_after)
                    if lost is not None:
                        job.skip(backend, lost, kind="evidence")
                        continue
                    result, built = job.try_backend(backend)
                    if built is not None:
                        built_now.append((backend, result, built))
                if not built_now:
                    continue
                if one_at_a_time and built_now[0][0].reads is not None:
                    built_now = [_checked_first(job, built_now[0], steps, index, clear)]
                later = [b for rest in steps[index + 1 :] for b in rest]
                first = built_now[0]
                # Earlier candidates settled below min_speedup cannot win: they are no plan to beat.
                contenders = [c for c in timed if job.bounds.get(c[1].backend, (0.0, 0.0))[1] >= job.config.min_speedup]
                if (
                    len(steps) > 1
                    and later
                    and not contenders
                    and (_far_ahead(job, first[1], clear) or _first_look(job, first, clear))
                ):
                    # A first plan that wins by far on its check alone serves without timed rounds, one clearly ahead
                    # in a few rounds after them; the search after it times it side by side with eager (fully) and
                    # the candidates it left.
                    timed, job.deferred = [first], job.deferred + _searched_first(first[0], later)
                    break
                # The rest are timed again, side by side (after a first look that fell short, on from its rounds: both
                # ran the calls warm there). Anytime, a lone first candidate is timed until it is settled against eager
                # itself (`FIRST_PLAN_BAR`): the question of a first plan is whether it is faster, not by how much.
                warm = not contenders and len(built_now) == 1 and bool(first[1].rounds)
                lone = one_at_a_time and later and not contenders and len(built_now) == 1
                survivors = {
                    id(r)
                    for r in job.time(
                        [(r, built) for _, r, built in contenders + built_now],
                        (FIRST_PLAN_BAR,) if lone else thresholds,
                        warmup=0 if warm else None,
                        resume=warm,
                    )
                }
                retimed = {id(c[1]) for c in contenders + built_now}
                timed = [c for c in timed if id(c[1]) not in retimed] + [
                    c for c in contenders + built_now if id(c[1]) in survivors
                ]
                winner = _best(timed)
                if later and winner is not None and job.bounds.get(winner[1].backend, (0.0, 0.0))[0] > clear:
                    job.deferred += _searched_first(winner[0], later)
                    break
                if lone and winner is not None and _ahead(job, winner):
                    # Faster than eager, not clearly by `clear`: it serves as a first look (the search times it against
                    # eager fully first, `refine_step`, and eager leads where that puts it below `min_speedup`), and
                    # the rest of the tier is searched after it. Timing every candidate here instead put a whole
                    # MiniLM's first tuned call at 84 s on an Ice Lake Xeon in fp32 (OpenVINO 1.08-1.16x: each timed
                    # up to 15 rounds of a 0.9 s call, twice).
                    job.first_look = True
                    job.deferred += _searched_first(winner[0], later)
                    break
        return timed

    def __repr__(self) -> str:
        options = []
        if not self.skip_slow_builds:
            options.append("skip_slow_builds=False")
        if self.clear_speedup != 1.05:
            options.append(f"clear_speedup={self.clear_speedup!r}")
        if self.order != "cost":
            options.append(f"order={self.order!r}")
        if self.prune_slow_after != 2:
            options.append(f"prune_slow_after={self.prune_slow_after!r}")
        return f"MinLatency({', '.join(options)})"


#: A refinement switches to a candidate only when it was timed at least this much faster than the plan that serves, in
#: the same rounds (`MinLatency.refine`): a lead within the noise keeps the plan, and its built state.
SWITCH_MARGIN = 0.03
#: Timed rounds a candidate of the search gets at most beside the plan that serves (at least `timing.MIN_ROUNDS`).
SEARCH_ROUNDS = 8
#: A first plan serves without timed rounds where its check alone showed it this many times `clear_speedup` ahead of
#: eager on every recorded call (`TuningJob.estimate`: one cold run each side; the search after it times it side by
#: side). Measured on real MiniLM whole at batch 32: OpenVINO bf16 3.1-3.9x, where the timed rounds of the first plan
#: took 9-12 s (eager's 1 s call in each of at least 7 rounds).
FIRST_PLAN_MARGIN = 2.0


#: Anytime tuning's bar for a first plan timed alone (`MinLatency._tiers`): settled faster than eager itself (the lower
#: bound of its speed-up above this), its median at `min_speedup` or more. One clearly ahead (above `clear_speedup`)
#: skips the slow builds; one only ahead serves as a first look, the search timing it against eager fully first.
FIRST_PLAN_BAR = 1.0


#: A first plan not far ahead on its check serves after a first look of this many looks beside eager: its check's
#: estimate where it is ahead (`TuningJob.estimate`: eager's reference run against the candidate's check run of each
#: recorded call, the smallest ratio; cold, so it errs low), then rounds timed with no warm-up (eager ran the calls
#: in the traffic and its references, the candidate in its check), where each look showed it more than `clear_speedup`
#: ahead and their median more than `FIRST_LOOK_MARGIN` x `clear_speedup` (`_first_look`); the search after it times
#: it against eager fully first. Measured on real MiniLM whole at batch 32 (Ice Lake Xeon; OpenVINO int8 1.39-1.48x):
#: the full timing of the first plan took 11.3-11.5 s (two warm-up and five timed rounds of eager's 0.9 s call beside a
#: 0.65 s one), three timed rounds 3.8 s (1.37x, 1.43x, 1.71x in one run); the check's run is one of them, spared.
FIRST_LOOK_ROUNDS = 3
FIRST_LOOK_MARGIN = 1.1


def _ahead(job: TuningJob, candidate: tuple[Backend, CandidateResult, BuiltBackend]) -> bool:
    """True where `candidate` was timed settled faster than eager itself (its lower bound above `FIRST_PLAN_BAR`) with
    a median of `min_speedup` or more: anytime tuning serves it as a first plan, clearly ahead or not."""
    result = candidate[1]
    low = job.bounds.get(result.backend, (0.0, 0.0))[0]
    return low > FIRST_PLAN_BAR and (result.speedup or 0.0) >= job.config.min_speedup


def _first_look(job: TuningJob, candidate: tuple[Backend, CandidateResult, BuiltBackend], clear: float) -> bool:
    """True where `candidate` was more than `clear` ahead of eager in each of `FIRST_LOOK_ROUNDS` looks (its check's
    estimate, then rounds timed beside eager) and more than `FIRST_LOOK_MARGIN` x `clear` in their median: its figures
    are then those rounds' (fewer than the sign test needs: the search after it times it first, going on from them,
    `TuningJob.first_look`), its bounds the lowest and highest look. The estimate is a cold run's, so it errs low: one
    not above `clear` (or none: not checked on every recorded call) is no look, and every look is a timed round."""
    _, result, built = candidate
    estimate = job.estimate(result)
    looks = [estimate] if estimate is not None and estimate > clear else []
    if not job.time([(result, built)], (), rounds=FIRST_LOOK_ROUNDS - len(looks), warmup=0):
        return False
    looks += paired_ratios(*job.round_times[result.backend])
    if min(looks) <= clear or statistics.median(looks) <= FIRST_LOOK_MARGIN * clear:
        return False
    job.bounds[result.backend], job.first_look = (min(looks), max(looks)), True
    return True


def _checked_first(
    job: TuningJob,
    built: tuple[Backend, CandidateResult, BuiltBackend],
    steps: list[list[Backend]],
    index: int,
    clear: float,
) -> tuple[Backend, CandidateResult, BuiltBackend]:
    """Anytime tuning's cheap tier, one candidate a step (`steps`, `index` the step that built `built`), where
    `built` is not ahead of eager on its check (below): the later candidates of the tier that read the same form in
    the same precision (`Backend.reads`: the ONNX export, made once) are built and checked now (a failed one is
    done: its row says why), and the one whose check showed it fastest (`TuningJob.estimate`) is timed first; the
    others come next, in the order of their estimates, and are kept built (`TuningJob.prebuilt`) for their own steps
    or for the search after a first plan. The first plan is then the candidate most likely to win, whichever comes
    first in `backends`: measured on an Ice Lake Xeon in fp32, ONNX Runtime settled at 0.65-0.72x on a whole MiniLM,
    where OpenVINO's ONNX door served 1.09-1.13x (and was timed after it: first tuned call 41.8-42.3 s, 24.5-32.3 s
    with this), while on SD small's blocks each won some. One cold run each side, so the estimate only orders: every
    candidate is still timed before it serves or loses.

    Only where the first candidate's check shows it no more than `clear` ahead of eager (ONNX Runtime's 0.98 on that
    MiniLM): one shown ahead is timed first as before (a first look, or at once where far ahead), the others left to
    the search unbuilt. Checking them all on every block put SD small's first tuned call at 28.4-28.8 s against
    24.5-26.6 s before (ONNX Runtime's estimates there 1.6-3.6 on most blocks)."""
    estimate = job.estimate(built[1])
    if estimate is None or estimate > clear:
        return built
    backend = built[0]
    group = [built]
    rest: list[list[Backend]] = []
    for step in steps[index + 1 :]:
        (other,) = step  # one candidate a step
        if other.reads != backend.reads or other.precision != backend.precision:
            rest.append(step)
        elif (prebuilt := job.prebuilt.pop(other.describe(), None)) is not None:
            group.append((other, *prebuilt))
        elif job.budget_spent:
            rest.append(step)  # its own step records it as skipped for the budget
        else:
            result, made = job.try_backend(other)
            if made is not None:
                group.append((other, result, made))
    ranked = sorted(group, key=lambda c: -(job.estimate(c[1]) or 0.0))  # stable: ties keep the order given
    for other, result, made in ranked[1:]:
        job.prebuilt[other.describe()] = (result, made)
    steps[index + 1 :] = [[c[0]] for c in ranked[1:]] + rest
    return ranked[0]


def _searched_first(winner: Backend, later: list[Backend]) -> list[Backend]:
    """The order the search after a first plan tries what it left: the winner's own backend first (its other doors and
    precisions: the likeliest to beat it, and the evidence the other runtimes' candidates are weighed by,
    `Backend.cannot_win`), then the others, each group in the order given."""
    return sorted(later, key=lambda backend: backend.name != winner.name)


def _far_ahead(job: TuningJob, result: CandidateResult, clear: float) -> bool:
    """True where `result`'s check showed it more than `FIRST_PLAN_MARGIN` x `clear` ahead of eager: its figures are
    then that estimate (`rounds` 0: not timed), and its lower bound the estimate over the margin."""
    estimate = job.estimate(result)
    if estimate is None or estimate <= FIRST_PLAN_MARGIN * clear:
        return False
    hottest = job.timed_calls[0]  # the latencies of the call timing would have timed first
    result.speedup, result.latency_s, result.rounds = estimate, job._check_seconds[result.backend][hottest], 0
    job.report.eager_latency_s = job.report.eager_latency_s or job._seconds[hottest]
    job.bounds[result.backend], job.first_look = (estimate / FIRST_PLAN_MARGIN, estimate), True
    return True


def _fallback(
    job: TuningJob,
    backend: Backend,
    timed: Sequence[tuple[Backend, CandidateResult, BuiltBackend]],
    fp32: list[Backend] | None,
) -> tuple[tuple[Backend, CandidateResult, BuiltBackend] | None, str | None]:
    """For a reduced-precision winner: the best fp32 candidate timed above `min_speedup` (what serves if the end-to-end
    quality gate rejects it), or None with why none would (`Decision.fp32_lost`; None where fp32 was not tried:
    `fp32` is None). (None, None) for an fp32 winner."""
    if backend.precision == "fp32":
        return None, None
    fp32_timed = [c for c in timed if c[0].precision == "fp32" and (c[1].speedup or 0.0) >= job.config.min_speedup]
    fallback = _best(fp32_timed)
    if fallback is None and fp32 is not None:
        return None, _fp32_lost(job, fp32, list(timed))
    return fallback, None


def _timed_here(job: TuningJob) -> list[Timed]:
    """What was timed on the job's target: each candidate's `describe()`, precision and speed-up over eager."""
    return [(c.backend, c.precision, c.speedup) for c in job.report.candidates if c.speedup is not None]


def _record_timed(job: TuningJob) -> None:
    """Leave what was timed on the job's target to the registration's other targets (`KindEvidence.record_timed`)."""
    if job.evidence is not None:
        job.evidence.record_timed(job.name, _timed_here(job))


def _cannot_win(job: TuningJob, backend: Backend) -> str | None:
    """Why the evidence says `backend` cannot win (`Backend.cannot_win`, asked with what was timed here, and on the
    registration's other targets), or None."""
    timed = _timed_here(job)
    elsewhere = job.evidence.timed_elsewhere(job.name) if job.evidence is not None else {}
    return backend.cannot_win(timed, elsewhere) if timed or elsewhere else None


def _precision_lost(job: TuningJob, backend: Backend) -> str | None:
    """Why a build of a reduced precision is not worth making for this block (a slow one in the tuning call, any one
    the search after a first plan comes to): a build of the same precision was timed here and settled below
    `min_speedup` (its upper confidence bound under it), and none of that precision was timed at `min_speedup` or more,
    so this CPU does not gain from that precision on this block (measured: OpenVINO bf16 0.72x of eager on a MiniLM
    layer with AVX512-BF16 and no AMX, where Inductor's bf16 compile took 24 s to build, then lost at 0.67x). None when
    no such evidence is at hand, and always for fp32: a build that loses in fp32 is that backend's loss, not its
    precision's (ONNX Runtime fp32 settled at 0.68x on the whole MiniLM on an Ice Lake Xeon, where OpenVINO's ONNX door
    served 1.13x and its torch.export door was then skipped for it)."""
    if backend.precision == "fp32":
        return None
    same = [r for r in job.report.candidates if r.precision == backend.precision and r.backend in job.bounds]
    if any((r.speedup or 0.0) >= job.config.min_speedup for r in same):
        return None
    for result in same:
        if job.bounds[result.backend][1] < job.config.min_speedup:
            slow = f", and {backend.name} builds slowly" if build_cost(backend) == "slow" else ""
            return (
                f"{result.backend} settled at {result.speedup or 0.0:.2f}x (needs {job.config.min_speedup:.2f}x): "
                f"{backend.precision} does not pay on this block here{slow}"
            )
    return None


def _best(
    timed: Sequence[tuple[Backend, CandidateResult, BuiltBackend]],
) -> tuple[Backend, CandidateResult, BuiltBackend] | None:
    """The timed candidate with the highest speed-up over eager (each measured side by side with eager)."""
    return max(timed, key=lambda c: c[1].speedup or 0.0, default=None)


class FirstWins(Strategy):
    """Try candidates in order (cheap builds first unless `order="given"`); the first that is correct and beats
    eager by `min_speedup` wins, and the rest are not tried."""

    name = "first_wins"

    def decide(self, job: TuningJob, backends: Sequence[Backend]) -> Decision:
        slowest: list[str] = []
        for backend in self.ordered(backends):
            if job.budget_spent:
                job.skip_for_budget(backend)
                continue
            result, built = job.try_backend(backend)
            if built is None:
                continue
            if not job.time([(result, built)]):
                continue
            if (result.speedup or 0.0) >= job.config.min_speedup:
                return job.choose(backend, result, built)
            slowest.append(f"{result.backend} at {result.speedup:.2f}x")
        if slowest:
            return job.keep_eager(f"nothing was faster: {', '.join(slowest)} (needs {job.config.min_speedup:.2f}x)")
        return job.keep_eager(_nothing_worked(job, backends))


class OneBackend(Strategy):
    """Use exactly one backend whenever it is correct, whatever its speed; where it fails, the target stays eager
    and the report (and a warning) says why. A backend unavailable on the registered devices raises at once.
    It is built even when a tuning budget is spent (it is the only candidate); its timing stops at the deadline."""

    name = "one_backend"

    def __init__(self, backend: str | Backend) -> None:
        super().__init__("given")
        self.backend = get_backend(backend)
        if self.backend.name == "eager":
            raise ConfigError("OneBackend('eager') would tune nothing; register nothing instead")

    def candidates(self, config: TuningConfig) -> list[Backend]:
        return [self.backend]

    def validate(self, config: TuningConfig, devices: frozenset[torch.device]) -> None:
        reason = self.backend.unavailable_reason(devices)
        if reason is not None:
            raise TuningError(
                f"strategy OneBackend({self.backend.describe()!r}) needs a backend that is unavailable here: {reason}"
            )

    def decide(self, job: TuningJob, backends: Sequence[Backend]) -> Decision:
        result, built = job.try_backend(self.backend)
        if built is not None and job.time([(result, built)]):
            return job.choose(self.backend, result, built)
        logger.warning("OneBackend(%r) cannot serve this target: %s", result.backend, result.error)
        return job.keep_eager(f"OneBackend({result.backend!r}) cannot serve this target: {result.error}")

    def __repr__(self) -> str:
        return f"OneBackend({self.backend.describe()!r})"


def _nothing_worked(job: TuningJob, backends: Sequence[Backend]) -> str:
    if not backends:
        return "no candidate backend configured"
    tried = [c for c in job.report.candidates if c.skipped_for != "budget"]
    if not tried:
        return f"tuning budget of {job.config.budget_s:g} s spent before any candidate was tried"
    if all(c.skipped_for == "unavailable" for c in tried):
        return f"no candidate backend is available: {job.failures()}"
    return f"every candidate failed: {job.failures()}"


STRATEGIES.update(min_latency=MinLatency, first_wins=FirstWins)


def resolve_strategy(spec: str | Strategy) -> Strategy:
    """A strategy instance from a name or an instance."""
    if isinstance(spec, Strategy):
        return spec
    if isinstance(spec, str) and spec in STRATEGIES:
        return STRATEGIES[spec]()
    raise ConfigError(
        f"unknown strategy {spec!r}; valid: {', '.join(STRATEGIES)}, or a Strategy instance "
        f"such as OneBackend('onnxruntime')"
    )
