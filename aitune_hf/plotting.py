"""Before/after latency plots of a `TuningReport` (``TuningReport.plot()`` delegates here).

The figure is a ``matplotlib.figure.Figure`` made without pyplot: no global backend is chosen. It saves with
``fig.savefig("report.png")`` on a machine without a display (matplotlib renders PNG with Agg), and Jupyter
shows it as a PNG when it is a cell's last expression (with or without ``%matplotlib inline``).

Left panel: one pair of horizontal bars per target, eager ms and tuned ms of the block, annotated with the
speed-up and the chosen backend; targets that kept eager are hatched and say why. Right panel: the measured
end-to-end latency of whole calls, eager against tuned, or "not measured".

Everything stays inside the figure: a long target name is wrapped at its dots (its input signature on a line of its
own), never cut; the figure grows with the lines; the annotations are kept out of the layout and the x-axis is
widened until each ends inside its panel (a long backend is abbreviated as in the table: `compact_backend`).

matplotlib is imported inside the functions: ``import aitune_hf.plotting`` works without it.
"""

from __future__ import annotations

import functools
import io
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aitune_hf.core.report import compact_backend, register_plotter
from aitune_hf.errors import InputTypeError, MissingExtraError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from aitune_hf.core.report import ModuleReport, SignatureReport, TuningReport

__all__ = ["plot_report"]

EAGER_COLOR = "#9e9e9e"
TUNED_COLOR = "#2a7ab9"
KEPT_COLOR = "#d9d9d9"
E2E_TUNED_COLOR = "#2e9e57"
#: Above this ratio between the largest and smallest bar, the per-target panel uses a log scale.
LOG_SCALE_RATIO = 30.0
#: The longest line of a target's label: longer names wrap at their dots (`_label`).
LABEL_WIDTH = 40
#: The widest backend text in an annotation before it is abbreviated (`compact_backend`).
NOTE_BACKEND_WIDTH = 32

_INSTALL_HINT = "TuningReport.plot() needs matplotlib: pip install matplotlib (or aitune-hf[notebooks])"


@dataclass
class _Row:
    name: str
    state: str
    backend: str
    eager_ms: float
    tuned_ms: float
    speedup: float | None
    note: str


def plot_report(
    report: TuningReport,
    ax: Axes | Sequence[Axes] | None = None,
    *,
    title: str | None = None,
    figsize: tuple[float, float] | None = None,
    log_scale: bool | None = None,
) -> Figure:
    """Draw the before/after latencies of `report` and return the matplotlib Figure.

    Args:
        report: a `TuningReport` (``registration.report()``, ``pipe.aitune.report()`` or ``from_dict``).
        ax: None (a new Figure with both panels), a pair ``(targets_ax, end_to_end_ax)`` to draw into, or one
            Axes (the per-target panel only).
        title: the figure's title; by default, on a new Figure, the report's summary (targets, states, tuning
            seconds); a figure passed in through `ax` gets a title only when one is given.
        figsize: size of a new Figure in inches; by default it grows with the number of targets.
        log_scale: log x-axis for the per-target bars; by default on when block latencies span more than
            ``LOG_SCALE_RATIO``x.

    Targets whose eager or tuned latency is unknown (None: not tuned yet, or no timing) are left out; the
    panel's x-label counts them.
    """
    try:
        figure_class = _report_figure_class()
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise MissingExtraError(_INSTALL_HINT) from error

    rows, skipped = _rows(report)
    if ax is None:
        lines = sum(_label(row.name).count("\n") + 1 for row in rows)
        height = max(3.2, 0.25 * len(rows) + 0.27 * lines + 1.8)
        fig = figure_class(figsize=figsize or (12.0, height), layout="constrained")
        targets_ax, e2e_ax = fig.subplots(1, 2, width_ratios=[3.2, 1])
    elif _is_axes(ax):
        targets_ax, e2e_ax = ax, None
        fig = targets_ax.figure
    else:
        axes = list(ax)
        if len(axes) != 2 or not all(_is_axes(a) for a in axes):
            raise InputTypeError("ax must be None, one matplotlib Axes, or a pair (targets_ax, end_to_end_ax)")
        targets_ax, e2e_ax = axes
        fig = targets_ax.figure

    _draw_targets(targets_ax, rows, skipped, log_scale)
    descended = list(getattr(report, "descended", None) or {})  # targets replaced by the blocks inside them
    if descended:
        names = ", ".join(descended)
        targets_ax.set_xlabel(f"{targets_ax.get_xlabel()}\ndescended into the blocks of: {names}", fontsize=9)
    if e2e_ax is not None:
        _draw_end_to_end(e2e_ax, report.end_to_end)
    if title is not None or ax is None:  # a figure of the caller's keeps its own title unless one is given
        fig.suptitle(title if title is not None else _default_title(report), fontsize=12)
    if rows:
        _fit_notes(targets_ax, targets_ax.get_xscale() == "log")
    return fig


def _label(name: str) -> str:
    """A target's tick label: as it is up to `LABEL_WIDTH` characters, else wrapped at the dots of its path (each line
    but the last ends in its dot) with the input signature (after " · ") on a line of its own; never cut."""
    if len(name) <= LABEL_WIDTH:
        return name
    path, sep, signature = name.partition(" · ")
    lines, line = [], ""
    for part in path.split("."):
        joined = f"{line}.{part}" if line else part
        if line and len(joined) + 1 > LABEL_WIDTH:  # + the dot that ends a broken line
            lines.append(f"{line}.")
            line = part
        else:
            line = joined
    lines.append(line)
    if sep:
        lines.append(f"· {signature}")
    return "\n".join(lines)


def _fit_notes(ax: Axes, log_scale: bool) -> None:
    """Widen the x-axis of the per-target panel until every annotation ends inside it. The annotations are out of the
    layout (`in_layout=False`), so the figure is laid out first and their widths measured in pixels: a note that
    starts at x and is w pixels wide ends inside an axes W pixels wide when the axis spans (x - left) * W / (W - w)."""
    ax.figure.draw_without_rendering()
    width = ax.get_window_extent().width
    left, right = ax.get_xlim()
    scale = math.log10 if log_scale else float
    span = scale(right) - scale(left)
    for note in ax.texts:
        room = width - note.get_window_extent().width - 4.0  # a few pixels from the frame
        if room > 0:
            span = max(span, (scale(note.get_position()[0]) - scale(left)) * width / room)
    ax.set_xlim(left, 10 ** (math.log10(left) + span) if log_scale else left + span)


@functools.cache
def _report_figure_class() -> type[Figure]:
    """A plain Figure that also renders itself as PNG in Jupyter, where no pyplot integration is active.

    A bare Figure made without pyplot shows only as ``<Figure size ...>`` unless ``%matplotlib inline`` (or an
    import of pyplot in the kernel) registered IPython's figure formatter; ``_repr_png_`` covers that case.
    Where the formatter is registered, IPython uses it instead, so a figure is never shown twice.
    """
    from matplotlib.figure import Figure

    class ReportFigure(Figure):
        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", dpi=100)  # Agg renders it: no display, no backend switch
            return buffer.getvalue()

    ReportFigure.__module__ = __name__
    return ReportFigure


def _is_axes(obj: Any) -> bool:
    from matplotlib.axes import Axes

    return isinstance(obj, Axes)


def _rows(report: TuningReport) -> tuple[list[_Row], int]:
    rows, skipped = [], 0
    for module in report.modules.values():
        if len(module.signatures) > 1:  # one pair of bars per input signature: each has its own story
            for signature in module.signatures:
                row = _signature_row(module.name, signature)
                if row is None:
                    skipped += 1
                else:
                    rows.append(row)
            continue
        eager, tuned = module.eager_latency_s, module.tuned_latency_s
        if eager is None or tuned is None or not (math.isfinite(eager) and math.isfinite(tuned)):
            skipped += 1
            continue
        rows.append(
            _Row(
                name=module.name,
                state=str(module.state),
                backend=module.backend,
                eager_ms=eager * 1e3,
                tuned_ms=tuned * 1e3,
                speedup=module.speedup,
                note=_note(module),
            )
        )
    return rows, skipped


def _signature_row(name: str, signature: SignatureReport) -> _Row | None:
    eager, tuned = signature.eager_latency_s, signature.chosen_latency_s
    if eager is None or tuned is None or not (math.isfinite(eager) and math.isfinite(tuned)):
        return None
    shape = signature.signature.split(", ")[0].split(" | ")[0]  # the leading tensor: batch and length, resolution
    state = "tuned" if signature.chosen != "eager" else "eager"
    return _Row(
        name=f"{name} · {shape}",
        state=state,
        backend=signature.chosen,
        eager_ms=eager * 1e3,
        tuned_ms=tuned * 1e3,
        speedup=signature.speedup,
        note=_text(state, signature.speedup, signature.chosen, signature.reason),
    )


def _note(module: ModuleReport) -> str:
    """The annotation after a target's bars: speed-up and backend, or that eager was kept."""
    return _text(str(module.state), module.speedup, module.backend, module.reason)


def _text(state: str, ratio: float | None, backend: str, why: str | None) -> str:
    speedup = f"{ratio:.2f}x" if ratio is not None else "-"
    if state == "tuned":
        return f"{speedup}  {compact_backend(backend, NOTE_BACKEND_WIDTH)}"
    if state == "eager":
        reason = (why or "").split(";")[0].strip()
        if len(reason) > 48:
            reason = reason[:47] + "…"
        return f"EAGER kept: {reason}" if reason else "EAGER kept"
    return f"{speedup}  ({state})"


def _draw_targets(ax: Axes, rows: list[_Row], skipped: int, log_scale: bool | None) -> None:
    unit = "block latency per target, ms per call (median; over input signatures, weighted by their calls)"
    if not rows:
        ax.text(0.5, 0.5, "no target has timings yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
        ax.set_xlabel(_skipped_label(unit, skipped))
        return

    values = [v for row in rows for v in (row.eager_ms, row.tuned_ms) if v > 0]
    smallest, largest = (min(values), max(values)) if values else (1.0, 1.0)
    if log_scale is None:
        log_scale = largest / smallest > LOG_SCALE_RATIO
    height = 0.38
    positions = list(range(len(rows)))
    kept = [row.state != "tuned" for row in rows]
    ax.barh(
        [p - height / 2 for p in positions],
        [row.eager_ms for row in rows],
        height=height,
        color=EAGER_COLOR,
        label="eager",
    )
    ax.barh(
        [p + height / 2 for p in positions],
        [row.tuned_ms for row in rows],
        height=height,
        color=[KEPT_COLOR if k else TUNED_COLOR for k in kept],
        hatch=["//" if k else "" for k in kept],
        edgecolor=["#7a7a7a" if k else TUNED_COLOR for k in kept],
        linewidth=0.6,
        label="tuned",
    )
    ax.set_yticks(positions, [_label(row.name) for row in rows], fontsize=9)
    ax.invert_yaxis()  # report order, top to bottom
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)

    if log_scale:
        ax.set_xscale("log")
        left = 10 ** math.floor(math.log10(smallest * 0.8))
        ax.set_xlim(left, largest * 8)
        unit += ", log scale"
    else:
        ax.set_xlim(0, largest * 1.35)
    for position, row in zip(positions, rows, strict=True):
        end = max(row.eager_ms, row.tuned_ms)
        x = end * 1.12 if log_scale else end + largest * 0.015
        color = "#1d5a8a" if row.state == "tuned" else "#555555"
        weight = "bold" if row.state == "tuned" else "normal"
        note = ax.text(x, position, row.note, va="center", ha="left", fontsize=8.5, color=color, fontweight=weight)
        note.set_in_layout(False)  # placed by `_fit_notes`, not by squeezing the panel

    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=EAGER_COLOR, label="eager"),
        Patch(facecolor=TUNED_COLOR, label="tuned (chosen backend)"),
    ]
    if any(kept):
        handles.append(Patch(facecolor=KEPT_COLOR, edgecolor="#7a7a7a", hatch="//", label="EAGER kept"))
    # Above the panel, where no bar or annotation is.
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, fontsize=9, frameon=False)
    ax.set_xlabel(_skipped_label(unit, skipped), fontsize=9)


def _skipped_label(unit: str, skipped: int) -> str:
    if not skipped:
        return unit
    return f"{unit}\n{skipped} target(s) without timings not shown"


def _draw_end_to_end(ax: Axes, end_to_end: dict[str, Any] | None) -> None:
    eager_s = (end_to_end or {}).get("eager_s")
    tuned_s = (end_to_end or {}).get("tuned_s")
    if eager_s is None or tuned_s is None:
        ax.set_title("end to end", fontsize=11)
        ax.text(
            0.5,
            0.5,
            "end to end:\nnot measured\n\n(obj.measure_aitune(<args of a\ntypical call>) times the call\n"
            "used last: __call__, encode(),\ngenerate() or decode())",
            ha="center",
            va="center",
            fontsize=10,
            color="#555555",
            transform=ax.transAxes,
        )
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_color("#cccccc")
        return

    eager_ms, tuned_ms = eager_s * 1e3, tuned_s * 1e3
    speedup = end_to_end.get("speedup") if end_to_end else None
    if speedup is None and tuned_ms:
        speedup = eager_ms / tuned_ms
    bars = ax.bar(
        ["eager", "tuned"], [eager_ms, tuned_ms], color=[EAGER_COLOR, E2E_TUNED_COLOR], width=0.6, label="end to end"
    )
    ax.bar_label(bars, labels=[f"{eager_ms:.1f} ms", f"{tuned_ms:.1f} ms"], padding=3, fontsize=9)
    ax.set_ylim(0, max(eager_ms, tuned_ms) * 1.22)
    ax.set_ylabel("whole call, ms (median)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(f"end to end: {speedup:.2f}x" if speedup is not None else "end to end", fontsize=11, fontweight="bold")
    method = (end_to_end or {}).get("method")
    if method:
        ax.set_xlabel("\n".join(textwrap.wrap(str(method), 30)), fontsize=8, color="#555555")


def _default_title(report: TuningReport) -> str:
    counts: dict[str, int] = {}
    for module in report.modules.values():
        counts[str(module.state)] = counts.get(str(module.state), 0) + 1
    states = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return f"aitune_hf: {len(report.modules)} targets ({states}); tuning {report.tuning_seconds:.1f} s"


register_plotter(plot_report)
