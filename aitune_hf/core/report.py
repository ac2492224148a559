"""What tuning did, per target and in total: plain-text table, JSON, and HTML for notebooks."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from aitune_hf.errors import MissingExtraError, UserInputError

#: Draws a TuningReport as a matplotlib Figure: registered by `aitune_hf.plotting` when it is imported (the package
#: imports it), so that the report, which only holds data, never imports the plotting layer above it.
_PLOTTER: Callable[..., Any] | None = None


def register_plotter(plotter: Callable[..., Any]) -> None:
    """Set the function `TuningReport.plot()` and the HTML report draw with (`aitune_hf.plotting.plot_report`)."""
    global _PLOTTER
    _PLOTTER = plotter


@dataclass
class CandidateResult:
    """One backend tried on one signature."""

    backend: str
    build_seconds: float | None = None  # building it, failed builds included
    latency_s: float | None = None  # median seconds per call over the timed rounds
    max_abs_error: float | None = None
    error: str | None = None  # why it failed, summarised as its cause (aitune_hf.core.reasons.summarize)
    speedup: float | None = None  # eager latency / this latency
    details: str | None = None  # the full text behind `error` when an exception caused it (every chained cause)
    check_seconds: float | None = None  # running it on every recorded call and comparing with eager
    timing_seconds: float | None = None  # its timed runs plus its share of eager's runs timed beside it
    rounds: int | None = None  # timed rounds (the sequential rule stops once its speed-up is decided)
    precision: str = "fp32"  # what it computes in (`core/precision.py`): reduced ones are checked by relative error
    rel_error: float | None = None  # its largest relative L2 error against eager on the recorded calls
    #: Why it was not tried, as a kind the code can test (its `error` text says it for people): "budget" (the tuning
    #: budget was spent: the decision is incomplete, and the cache does not keep it), "unavailable" (it cannot run
    #: here, or cannot take this shape family), "evidence" (a slow build that lost on the first blocks of this
    #: block's kind: `core/strategy.py` `KindEvidence`), or None.
    skipped_for: str | None = None
    #: Built from an identical module's work in this process (ONNX Runtime: its export, with these weights put in;
    #: `BuiltBackend.reused`), which is why its build took a fraction of a fresh one's.
    reused: bool = False
    #: What its build computes otherwise than its name says (`BuiltBackend.note`: an int8 build's layers kept in a float
    #: precision on this CPU), shown beside the chosen one in the report; None: nothing to say.
    note: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def seconds(self) -> float:
        """Tuning seconds spent on this candidate: build, check and timing."""
        return sum(s or 0.0 for s in (self.build_seconds, self.check_seconds, self.timing_seconds))


@dataclass
class SignatureReport:
    """The decision for one input signature of a target."""

    signature: str
    samples: int
    chosen: str = "eager"
    eager_latency_s: float | None = None
    candidates: list[CandidateResult] = field(default_factory=list)
    reason: str | None = None  # why eager was kept, when it was
    shared_from: str | None = None  # the identical sibling whose decision was reused
    from_cache: str | None = None  # the persistent cache entry whose decision was reused (its winner built alone)
    details: str | None = None  # the full text behind `reason` when an exception caused it (every chained cause)
    shapes: int = 1  # concrete input shapes this decision serves: those tuned on, then those admitted after a check
    shape_checks: int = 0  # one-time checks against eager of new shapes (a polymorphic build), and their cost
    shape_check_seconds: float = 0.0
    shapes_rejected: list[str] = field(default_factory=list)  # new shapes whose check failed (they run eager)
    reference_seconds: float = 0.0  # computing eager's reference outputs for the checks
    demoted: str | None = None  # a reduced-precision winner the end-to-end quality gate sent back to fp32, and why
    #: Anytime tuning (`core/refine.py`): the backend that served first, where the search after it replaced it.
    first_plan: str | None = None
    #: What the search after the first plan did ("searched 3 more candidate(s) on the worker; ..."); None where no
    #: search was left to do, or while it is queued.
    search: str | None = None
    #: Where the target is only measured whole over its blocks (`Target.measure_only`): the backend that beat the
    #: blocks as they serve, at `speedup`; the blocks serve (`chosen` is "eager").
    measured_whole: str | None = None
    #: The calls of this decision's signatures recorded before it was tuned (the traffic's mix then): a target's row
    #: weighs each signature by them (`ModuleReport.eager_latency_s`). 0 where unknown (it then counts as 1).
    calls: int = 0
    #: Timed in warm turns (`timing.time_until_settled`'s `warm_turns`): the target's calls ran back to back, and a
    #: candidate kept its own copy of the weights.
    back_to_back: bool = False

    @property
    def source(self) -> str:
        """Where the decision came from (`core/sourcing.py`, which sets it with `Decision.source`): "shared" (an
        identical sibling's, `shared_from`), "cache" (`from_cache`) or "tuned" (here). Read from the fields the cache
        stores, so a report read back says it too."""
        return "shared" if self.shared_from else "cache" if self.from_cache else "tuned"

    @property
    def source_text(self) -> str:
        """`source` as the report says it: "shared with <sibling>", "from the cache" or "tuned here"."""
        if self.shared_from:
            return f"shared with {self.shared_from}"
        return "from the cache" if self.from_cache else "tuned here"

    @property
    def chosen_latency_s(self) -> float | None:
        if self.chosen == "eager":
            return self.eager_latency_s
        return next((c.latency_s for c in self.candidates if c.backend == self.chosen), None)

    @property
    def precision(self) -> str:
        """What the chosen backend computes in ("fp32" for eager)."""
        return next((c.precision for c in self.candidates if c.backend == self.chosen), "fp32")

    @property
    def speedup(self) -> float | None:
        """The chosen candidate's speed-up as measured (median of per-round paired ratios), else the latency ratio."""
        chosen = next((c for c in self.candidates if c.backend == self.chosen and c.speedup is not None), None)
        return chosen.speedup if chosen is not None else _ratio(self.eager_latency_s, self.chosen_latency_s)


@dataclass
class ModuleReport:
    """Everything known about one registered target."""

    name: str
    module_class: str
    state: str
    reason: str | None = None
    signatures: list[SignatureReport] = field(default_factory=list)
    tuning_seconds: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)  # backend name -> calls it served
    changes: list[str] = field(default_factory=list)  # what changed, for the latest guard failures (oldest first)
    routes: int = 0  # built routes: one per (signature, guarded module state)
    signatures_over_limit: int = 0  # calls of signatures beyond max_signatures: run eager, not recorded
    idle: bool = False  # never called since registration (a VAE's encoder where nothing encodes)
    training: str | None = None  # why its latest calls ran eager in training mode (`signature.training_reason`)
    #: Kept whole over blocks that are targets of their own (`Target.inner`): their names. Its "eager" is then its
    #: forward with those blocks served: what it was timed against, and what serves the families it does not win.
    blocks: list[str] = field(default_factory=list)
    #: Kept over its blocks only to measure the whole against them (`targets="blocks"`, `compare_whole=True`).
    measure_only: bool = False

    @property
    def backend(self) -> str:
        """The chosen backend (several joined by '+' when signatures differ)."""
        chosen = sorted({s.chosen for s in self.signatures}) or ["eager"]
        return "+".join(chosen)

    @property
    def precision(self) -> str:
        """What the chosen backends compute in (several joined by '+')."""
        return "+".join(sorted({s.precision for s in self.signatures})) or "fp32"

    @property
    def eager_latency_s(self) -> float | None:
        """Eager's seconds per call: each signature's median, weighted by its calls (`SignatureReport.calls`)."""
        return _per_call(self.signatures, lambda s: s.eager_latency_s)

    @property
    def tuned_latency_s(self) -> float | None:
        """The chosen backends' seconds per call, weighted as `eager_latency_s`."""
        return _per_call(self.signatures, lambda s: s.chosen_latency_s)

    @property
    def speedup(self) -> float | None:
        """One signature: the speed-up its decision was made on (`SignatureReport.speedup`); several: the ratio of
        the seconds per call, each signature weighted by its calls (a prefill and 31 decode steps: the decode step's
        speed-up, nearly; not the ratio of a prefill's and one step's latencies added up)."""
        if len(self.signatures) == 1:
            return self.signatures[0].speedup
        return _ratio(self.eager_latency_s, self.tuned_latency_s)

    @property
    def max_abs_error(self) -> float | None:
        errors = [
            c.max_abs_error
            for s in self.signatures
            for c in s.candidates
            if c.backend == s.chosen and c.max_abs_error is not None
        ]
        return max(errors) if errors else None  # eager kept: nothing to compare

    def seconds_split(self) -> dict[str, dict[str, float]]:
        """Tuning seconds by backend and phase: {backend: {"build_s", "check_s", "timing_s"}}, plus {"eager":
        {"reference_s"}} for eager's reference outputs. What is left of `tuning_seconds` went to bookkeeping (and to
        builds a shared or cached decision discarded when they failed)."""
        return _split(self.signatures)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            seconds_split=self.seconds_split(),
            backend=self.backend,
            eager_latency_s=self.eager_latency_s,
            tuned_latency_s=self.tuned_latency_s,
            speedup=self.speedup,
            max_abs_error=self.max_abs_error,
            precision=self.precision,
        )
        for sig, sig_data in zip(self.signatures, data["signatures"], strict=True):
            sig_data.update(chosen_latency_s=sig.chosen_latency_s, speedup=sig.speedup, precision=sig.precision)
        return data


@dataclass
class TuningReport:
    """The report of one registration: per-target rows plus, when measured, end-to-end timings."""

    modules: dict[str, ModuleReport]
    end_to_end: dict[str, float] | None = None  # eager_s, tuned_s, speedup (measured by the caller)
    tuning_seconds: float = 0.0
    descended: dict[str, ModuleReport] = field(default_factory=dict)  # replaced by targets inside them
    cache: str | None = None  # what the persistent cache did (`CacheStats.line()`), when it is on
    #: The end-to-end quality gate of reduced precision (`Registration.gate`): metric, value, budget, passed, kind,
    #: demoted (the blocks it sent back to fp32), replays; None when no reduced-precision decision was gated.
    quality: dict[str, Any] | None = None
    #: Anytime tuning (`Registration.plan_seconds`): seconds from registration to the first tuned call (`first_tuned_s`:
    #: every target called had a decision) and to the final plan (`final_plan_s`, None while the search goes on), and
    #: the searches after first plans still going on (`searching`); None before any.
    plans: dict[str, Any] | None = None

    #: The keys of `to_dict()`, which `from_dict` reads back; anything else in a saved report is its writer's own facts
    #: (the CLI's `demo --json` adds the run's), which readers print as such.
    KEYS = ("end_to_end", "tuning_seconds", "modules", "descended", "cache", "quality", "plans")

    COLUMNS = (
        "target",
        "class",
        "state",
        "backend",
        "precision",
        "eager ms",
        "tuned ms",
        "speed-up",
        "max err",
        "note",
    )

    def rows(self) -> list[list[str]]:
        """Table rows, one per target, as strings."""
        rows = []
        for report in self.modules.values():
            if report.idle:  # listed in the summary, not as a row
                continue
            note = report.reason or ""
            # Where the decision came from, where not here: the timings shown are then the sibling's (this block was
            # checked, not timed) or an earlier process's.
            source = next((s for kind in ("shared", "cache") for s in report.signatures if s.source == kind), None)
            if source is not None:
                note = f"{note}; " if note else ""
                note += f"decision and timings {source.source_text}"
                if source.source == "cache":
                    note += " (winner built alone, checked against eager)"
                owner = self.modules.get(source.shared_from or "")
                if owner is not None and owner.backend != report.backend:  # the gate or a change moved one of them
                    note += f", which serves {owner.backend} now"
            shapes = sum(s.shapes for s in report.signatures if s.chosen != "eager")
            checks = sum(s.shape_checks for s in report.signatures)
            if checks or shapes > len(report.signatures):
                note = f"{note}; " if note else ""
                seconds = sum(s.shape_check_seconds for s in report.signatures)
                note += f"serves {shapes} shapes ({checks} new shape(s) checked once against eager, {seconds:.2f} s)"
            rejected = [text for s in report.signatures for text in s.shapes_rejected]
            if rejected:
                note = f"{note}; " if note else ""
                note += f"{len(rejected)} new shape(s) run eager, their check failed (first: {rejected[0]})"
            if report.signatures_over_limit:
                note = f"{note}; " if note else ""
                note += f"{report.signatures_over_limit} call(s) of signatures beyond max_signatures ran eager"
            if report.changes:  # a guard failed: say what changed since the backend was built
                note = f"{note}; " if note else ""
                note += f"changed since built: {report.changes[-1]} ({report.routes} route(s))"
            if report.training:
                note = f"{note}; " if note else ""
                note += f"runs eager in training mode, never tuned in it: {report.training}"
            if report.blocks:
                note = f"{note}; " if note else ""
                note += (
                    f"measured whole against its {len(report.blocks)} blocks (compare_whole), never served whole: "
                    "eager here is its blocks as they serve"
                    if report.measure_only
                    else f"kept whole over its {len(report.blocks)} blocks: eager here is its blocks as they serve, "
                    "timed against the whole; a shape family the whole does not win runs its blocks"
                )
            demoted = next((s for s in report.signatures if s.demoted), None)
            if demoted:
                note = f"{note}; " if note else ""
                note += f"sent back to {demoted.precision} by the end-to-end quality gate: {demoted.demoted}"
            for built in sorted({c.note for s in report.signatures for c in s.candidates
                                 if c.backend == s.chosen and c.note}):  # fmt: skip
                note = f"{note}; " if note else ""
                note += built
            for search in dict.fromkeys(s.search for s in report.signatures if s.search):
                note = f"{note}; " if note else ""
                note += search
            state = report.state
            eager, served = report.calls.get("eager", 0), sum(n for k, n in report.calls.items() if k != "eager")
            if state == "tuned" and eager > served:  # tuned for some shapes; most of its calls ran eager
                state = "tuned/eager"
                note = f"{note}; " if note else ""
                note += (f"eager served {eager} of its {eager + served} calls (shapes not tuned, waiting for their "
                         "check, or in another module state)")  # fmt: skip
            rows.append(
                [
                    report.name,
                    report.module_class,
                    state,
                    report.backend,
                    report.precision,
                    _ms(report.eager_latency_s),
                    _ms(report.tuned_latency_s),
                    _x(report.speedup),
                    _err(report.max_abs_error),
                    note,
                ]
            )
            rows.extend(self.signature_rows(report))
        return rows

    @staticmethod
    def signature_rows(report: ModuleReport) -> list[list[str]]:
        """Where a target met several input signatures (shape families: batch sizes, resolutions), one row each under
        the target's: what each one serves and, when it kept eager, why. Empty for a target with one signature."""
        if len(report.signatures) < 2:
            return []
        rows = []
        for signature in report.signatures:
            tuned = signature.chosen != "eager"
            note = "" if tuned else (signature.reason or "not tuned yet")
            if signature.demoted:
                note = f"{note}; " if note else ""
                note += f"sent back to {signature.precision}: {signature.demoted}"
            rows.append(
                [
                    f"  · {_clip(signature.signature, 56)}",
                    "",
                    "tuned" if tuned else "eager",
                    signature.chosen,
                    signature.precision,
                    _ms(signature.eager_latency_s),
                    _ms(signature.chosen_latency_s),
                    _x(signature.speedup),
                    _err(next((c.max_abs_error for c in signature.candidates if c.backend == signature.chosen), None)),
                    note,
                ]
            )
        return rows

    def summary_lines(self) -> list[str]:
        counts: dict[str, int] = {}
        for report in self.modules.values():
            state = "idle" if report.idle else report.state
            counts[state] = counts.get(state, 0) + 1
        lines = [
            f"targets: {len(self.modules)} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}); "
            f"tuning {self.tuning_seconds:.1f} s"
        ]
        plans = self.plan_line()
        if plans:
            lines.append(plans)
        idle = [name for name, report in self.modules.items() if report.idle]
        if idle:
            lines.append(f"idle (never called, not waited for): {', '.join(idle)}")
        split = self.seconds_split()
        if split:
            parts = []
            for backend, phases in split.items():
                if backend == "eager":
                    parts.append(f"eager references {phases['reference_s']:.1f}")
                else:
                    parts.append(
                        f"{backend} build {phases['build_s']:.1f} + check {phases['check_s']:.1f} "
                        f"+ timing {phases['timing_s']:.1f}"
                    )
            lines.append(f"tuning seconds: {'; '.join(parts)}")
        skipped = self.not_built()
        if skipped:
            lines.append("not built: " + "; ".join(f"{backend} ({why})" for backend, why in skipped.items()))
        if self.cache:
            lines.append(self.cache)
        warm = [name for name, report in self.modules.items() if any(s.back_to_back for s in report.signatures)]
        if warm:
            lines.append(
                f"timed back to back (their calls follow each other, so each candidate's turn starts warm): "
                f"{', '.join(warm)}"
            )
        for name, report in self.descended.items():
            lines.append(f"descended into {name} ({report.module_class}): as a whole it stayed eager: {report.reason}")
        for name, report in self.modules.items():
            if report.measure_only:
                if not report.idle:  # never called (a VAE's encoder where nothing encodes): nothing to measure
                    lines.append(_whole_line(name, report))
            elif report.blocks:
                lines.append(
                    f"kept whole over its blocks: {name} ({report.module_class}) serves whole the shape families where "
                    f"it beats its {len(report.blocks)} blocks as they serve; its blocks serve the others"
                )
        quality = self.quality_line()
        if self.end_to_end and self.end_to_end.get("speedup") is None:  # whole calls seen, none comparable
            lines.insert(0, f"end to end: not measured ({self.end_to_end.get('method', 'no comparable calls')})")
            if quality:
                lines.insert(1, f"quality: {quality}")
        elif self.end_to_end:
            e2e = self.end_to_end
            lines.insert(
                0,
                f"end to end: eager {_ms(e2e.get('eager_s'))} ms -> tuned {_ms(e2e.get('tuned_s'))} ms "
                f"= {_x(e2e.get('speedup'))} (measured){_spread(e2e.get('speedup_range'))}"
                + (f"; quality: {quality}" if quality else ""),
            )
        elif quality:
            lines.insert(0, f"quality: {quality}")
        payback = self.payback()
        if payback is not None:
            saved_ms = payback["saved_per_call_s"] * 1e3
            calls = payback["calls"]
            lines.insert(
                1,
                f"payback: tuning {payback['tuning_s']:.1f} s, saves {saved_ms:.1f} ms per whole call: "
                + ("never pays off" if calls is None else f"paid off after {calls} call(s)"),
            )
        return lines

    def not_built(self) -> dict[str, str]:
        """The candidates no target built (skipped: a clear winner, the evidence, the budget; or unavailable here), each
        with the first reason given: what the tuning seconds do not show (a demo that names Inductor among its
        candidates, and never builds it)."""
        built = set(self.seconds_split())
        reasons: dict[str, str] = {}
        for report in [*self.modules.values(), *self.descended.values()]:
            for signature in report.signatures:
                for c in signature.candidates:
                    if c.backend not in built and c.error and c.build_seconds is None:
                        reasons.setdefault(c.backend, c.error.removeprefix("skipped: "))
        return reasons

    def plan_line(self) -> str | None:
        """When tuned calls began and when the plan that serves was settled: "plans: first tuned call 8.1 s after
        registration, final plan after 23.4 s"; "...; searching on the worker (2 decision(s))" while the search after a
        first plan goes on (`core/refine.py`); None before any tuned call."""
        plans = self.plans or {}
        first = plans.get("first_tuned_s")
        if first is None:
            return None
        text = f"plans: first tuned call {first:.1f} s after registration"
        final, searching = plans.get("final_plan_s"), plans.get("searching") or 0
        if searching:
            return f"{text}; searching on the worker ({searching} decision(s)): a faster plan may still replace it"
        return f"{text}, final plan after {final:.1f} s" if final is not None else text

    def quality_line(self) -> str | None:
        """The end-to-end quality of reduced precision, as the summary shows it next to the speed-up: "PSNR 41.2 dB
        (>= 35) against fp32 eager; 2 block(s) sent back to fp32"; None without a gated reduced-precision decision."""
        if not self.quality:
            return None
        from aitune_hf.core.quality import QualityFigure

        q = self.quality
        figure = QualityFigure(q["metric"], q["value"], q["budget"], q["passed"], q["kind"], q.get("threshold"))
        gates = q.get("gates", 1)
        text = f"{figure.text()} against fp32 eager on the " + (
            "call that tuned" if gates <= 1 else f"worst of {gates} calls gated (new shapes are gated too)"
        )
        if q.get("demoted"):
            text += f"; {len(q['demoted'])} block(s) sent back to fp32 ({', '.join(q['demoted'])})"
        return text

    def seconds_split(self) -> dict[str, dict[str, float]]:
        """`ModuleReport.seconds_split` summed over every target (descended ones included)."""
        return _split([s for r in [*self.modules.values(), *self.descended.values()] for s in r.signatures])

    def payback(self) -> dict[str, Any] | None:
        """Where whole calls were measured (`end_to_end`): tuning seconds, seconds saved per whole call (eager's median
        minus tuned's), and the number of whole calls after which the saving has repaid the tuning (None: never,
        nothing is saved). None without an end-to-end measurement."""
        e2e = self.end_to_end or {}
        eager_s, tuned_s = e2e.get("eager_s"), e2e.get("tuned_s")
        if eager_s is None or tuned_s is None:
            return None
        saved = eager_s - tuned_s
        calls = math.ceil(self.tuning_seconds / saved) if saved > 0 else None
        return {"tuning_s": self.tuning_seconds, "saved_per_call_s": saved, "calls": calls}

    def __str__(self) -> str:
        backend = self.COLUMNS.index("backend")
        rows = [list(self.COLUMNS)]
        for row in self.rows():
            rows.append([*row[:backend], compact_backend(row[backend]), *row[backend + 1 :]])
        # The backend and precision columns are never cut (every precision and kernel chosen stays readable: long
        # backend texts are abbreviated, `compact_backend`); the others are capped, a cut one ends in "…"; the note
        # (last) is printed whole.
        whole = {backend, self.COLUMNS.index("precision")}
        widths = [max(len(r[i]) for r in rows) if i in whole else min(max(len(r[i]) for r in rows), COLUMN_WIDTH)
                  for i in range(len(self.COLUMNS) - 1)] + [0]  # fmt: skip
        lines = list(self.summary_lines())
        for index, row in enumerate(rows):
            cells = [_clip(cell, w).ljust(w) for cell, w in zip(row[:-1], widths, strict=False)] + [row[-1]]
            lines.append("  ".join(cells).rstrip())
            if index == 0:
                lines.append("  ".join("-" * w for w in [*widths[:-1], len(self.COLUMNS[-1])]))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        return self.to_html()

    def to_html(self, path: str | Path | None = None, *, figure: bool = True) -> str:
        """The report as HTML: summary, the figure of `plot()` embedded as a PNG (when `figure` and matplotlib is
        installed; otherwise a line says why it is missing), and the table with a row per input signature where a
        target met several. Written as a standalone page to `path` when given."""
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = "".join(
            ("<tr style='color:#555'>" if row[0].startswith("  ") else "<tr>")
            + "".join(f"<td>{html.escape(cell)}</td>" for cell in row)
            + "</tr>"
            for row in self.rows()
        )
        summary = "".join(f"<p><b>{html.escape(line)}</b></p>" for line in self.summary_lines())
        picture = self._figure_html() if figure else ""
        text = f"<div>{summary}{picture}<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
        if path is not None:
            Path(path).write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>aitune_hf report</title>"
                                  f"</head><body>{text}</body></html>")  # fmt: skip
        return text

    def _figure_html(self) -> str:
        try:
            fig = self.plot()
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=80)  # Agg renders it: no display, no backend switch
        except ImportError as error:  # matplotlib is an extra
            return f"<p><i>{html.escape(str(error))}</i></p>"
        data = base64.b64encode(buffer.getvalue()).decode("ascii")
        return f"<img alt='eager vs tuned latency per target' src='data:image/png;base64,{data}'/>"

    def to_dict(self) -> dict[str, Any]:
        payback = self.payback()
        return {
            # The payback is derived from the measurement and tuning seconds; kept under it so readers of the other
            # keys see nothing new, and recomputed (never read back) by from_dict.
            "end_to_end": self.end_to_end if payback is None else {**self.end_to_end, "payback": payback},
            "tuning_seconds": self.tuning_seconds,
            "modules": {name: report.to_dict() for name, report in self.modules.items()},
            "descended": {name: report.to_dict() for name, report in self.descended.items()},
            "cache": self.cache,
            "quality": self.quality,
            "plans": self.plans,
        }

    @classmethod
    def from_dict(cls, data: Any) -> TuningReport:
        """Rebuild a report from `to_dict()` or the parsed JSON of `to_json()` (derived keys are ignored)."""
        if not isinstance(data, dict) or not isinstance(data.get("modules"), dict):
            raise UserInputError("not an aitune_hf report: expected a JSON object with a 'modules' object")

        def build(kind: type, raw: Any, **nested: Any) -> Any:
            if not isinstance(raw, dict):
                raise UserInputError(f"not an aitune_hf report: a {kind.__name__} entry is not an object")
            names = {f.name for f in fields(kind)} - set(nested)
            return kind(**{k: v for k, v in raw.items() if k in names}, **nested)

        def module(raw: Any) -> ModuleReport:
            signatures = [
                build(SignatureReport, sig, candidates=[build(CandidateResult, c) for c in sig.get("candidates") or []])
                for sig in (raw.get("signatures") or [] if isinstance(raw, dict) else [])
            ]
            return build(ModuleReport, raw, signatures=signatures)

        end_to_end = data.get("end_to_end")
        if isinstance(end_to_end, dict):
            end_to_end = {k: v for k, v in end_to_end.items() if k != "payback"}
        return cls(
            {name: module(raw) for name, raw in data["modules"].items()},
            end_to_end=end_to_end,
            tuning_seconds=data.get("tuning_seconds") or 0.0,
            descended={name: module(raw) for name, raw in (data.get("descended") or {}).items()},
            cache=data.get("cache") if isinstance(data.get("cache"), str) else None,
            quality=data.get("quality") if isinstance(data.get("quality"), dict) else None,
            plans=data.get("plans") if isinstance(data.get("plans"), dict) else None,
        )

    def plot(self, ax: Any = None, **kwargs: Any) -> Any:
        """Per-target and end-to-end latency, eager vs tuned, as a matplotlib Figure (needs matplotlib).

        `ax`: None (a new Figure), a pair of Axes (per-target, end-to-end) or one Axes (per-target only);
        `title`, `figsize`, `log_scale` as in `aitune_hf.plotting.plot_report`.
        """
        if _PLOTTER is None:  # importing aitune_hf (as any import of aitune_hf.core does) registers it
            raise MissingExtraError("no plotter is registered: import aitune_hf.plotting")
        return _PLOTTER(self, ax, **kwargs)

    def to_json(self, path: str | Path | None = None, indent: int = 2) -> str:
        """The report as JSON (non-finite numbers become null); written to `path` when given."""
        text = json.dumps(_finite(self.to_dict()), indent=indent)
        if path is not None:
            Path(path).write_text(text)
        return text


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _split(signatures: Any) -> dict[str, dict[str, float]]:
    split: dict[str, dict[str, float]] = {}
    reference = 0.0
    for signature in signatures:
        reference += signature.reference_seconds or 0.0
        for c in signature.candidates:
            if c.build_seconds is None and c.check_seconds is None and c.timing_seconds is None:
                continue  # not tried (unavailable, skipped)
            phases = split.setdefault(c.backend, {"build_s": 0.0, "check_s": 0.0, "timing_s": 0.0})
            phases["build_s"] += c.build_seconds or 0.0
            phases["check_s"] += c.check_seconds or 0.0
            phases["timing_s"] += c.timing_seconds or 0.0
    if reference:
        split["eager"] = {"reference_s": reference}
    return split


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _whole_line(name: str, report: ModuleReport) -> str:
    """What measuring a component whole against its blocks found (`targets="blocks"` with `compare_whole=True`)."""
    what = f"{name} ({report.module_class})"
    faster = [s for s in report.signatures if s.measured_whole]
    if faster:
        speedups = [next((c.speedup for c in s.candidates if c.backend == s.measured_whole), None) for s in faster]
        figures = ", ".join(
            f"{s.measured_whole} at {_x(x)} on {_clip(s.signature, 40)}" for s, x in zip(faster, speedups, strict=True)
        )
        return (
            f"whole would be faster: {what} as a whole beat its {len(report.blocks)} blocks as they serve on "
            f"{len(faster)} of {len(report.signatures)} shape famil{'y' if len(report.signatures) == 1 else 'ies'} "
            f"({figures}); targets='auto' serves it so"
        )
    if report.signatures:
        reasons = "; ".join(sorted({s.reason or "eager" for s in report.signatures}))
        return f"blocks are faster: {what} as a whole did not beat its {len(report.blocks)} blocks ({reasons})"
    return f"whole not measured yet: {what} is measured against its blocks once they serve a call whole"


def _per_call(signatures: list[SignatureReport], latency: Callable[[SignatureReport], float | None]) -> float | None:
    """Seconds per call over `signatures`: their latencies weighted by their calls (at least 1 each); None where one
    has no latency."""
    values = [latency(s) for s in signatures]
    if not values or any(v is None for v in values):
        return None
    weights = [max(s.calls, 1) for s in signatures]
    return sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)


def _spread(bounds: Any) -> str:
    """ ", rounds 1.25x..1.35x": the per-round speed-ups of an interleaved measurement, when it has them."""
    if not isinstance(bounds, list | tuple) or len(bounds) != 2 or not all(isinstance(b, int | float) for b in bounds):
        return ""
    return f", rounds {_x(bounds[0])}..{_x(bounds[1])}"


#: The widest a table column is printed (but the backend, precision and note columns, which are never cut).
COLUMN_WIDTH = 60
#: Backend options shown by their value alone in `compact_backend` (the value names itself: "bf16", "int8", "fused").
_VALUE_SAYS_IT = ("precision", "kernels")


def compact_backend(text: str, width: int = COLUMN_WIDTH) -> str:
    """The table's backend text, abbreviated where it is wider than `width`, never cut: in each backend of it
    ("name(key=value, ...)", several joined by "+"), an option whose value names itself shows its value alone
    ("precision=bf16" -> "bf16", "kernels=fused" -> "fused"), a flag set to True its key ("freezing=True" ->
    "freezing"), and "onnxruntime" becomes "ort". Every option stays visible (int8 and fused kernels stay apart);
    a text still wider is returned so, whole."""
    if len(text) <= width:
        return text
    return "+".join(_compact_one(part) for part in text.split("+"))


def _compact_one(backend: str) -> str:
    match = re.fullmatch(r"(\w+)\((.*)\)", backend)
    name, options = (match.group(1), match.group(2).split(", ")) if match else (backend, [])
    name = "ort" if name == "onnxruntime" else name
    shown = []
    for option in options:
        key, _, value = option.partition("=")
        shown.append(value if key in _VALUE_SAYS_IT and value else key if value == "True" else option)
    return f"{name}({', '.join(shown)})" if shown else name


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _err(error: float | None) -> str:
    return "-" if error is None or math.isnan(error) else f"{error:.1e}"
