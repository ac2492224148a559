"""End-to-end quality budgets for reduced precision: how far a whole call's output may be from the fp32 eager output
of the same call, by what that output is.

| output | metric | default budget |
| --- | --- | --- |
| images (a pipeline's `.images`: arrays, tensors, PIL images) | PSNR against fp32 eager, in dB | >= 35 |
| embeddings, hidden states (any other floating output) | the smallest per-row cosine similarity | >= 0.99 |
| classifier logits (an output with `logits`) | the share of rows whose argmax is eager's | >= 1.0 (every row) |
| tokens (`generate()`: integer ids, or an output with `sequences`) | the share of tokens equal to eager's | >= 1.0 |

`quality=` in `enable_aitune` / `TuningConfig` overrides a budget by metric name: `quality={"psnr": 40}`. Names
that are no metric are refused by `TuningConfig` (`core/config.py`); a metric that fits none of the outputs an object
returns (PSNR on embeddings, tokens on images) is refused by `check_budget`, which the Hugging Face layer calls at
`enable_aitune` where it knows what the object returns, else at its first whole call. `measure` keeps a safety net
behind both: a budget with no metric for the output it is given fails the check (reduced precision is then not used),
and the figure names the output kind (a later call may return another kind than the first: a pipeline called with
`return_dict=False`).

The gate sees one call; the budget is for every call. So the gate asks the call it replays for half the error the
budget allows (`GATE_MARGIN`): 1 - cosine at most half of 1 - budget (0.995 for a budget of 0.99), PSNR 3 dB above
the budget (half the squared error). Measured on real MiniLM with int8 blocks: the call that tuned had min cosine
0.9930, single queries of lengths never seen 0.9866 at worst, 1.9x further off. Shares of equal argmax or tokens
are asked as they are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aitune_hf.errors import ConfigError, InputTypeError

#: metric -> (what it measures, default budget). Every figure is "higher is better" and passes at >= its budget.
METRICS: dict[str, tuple[str, float]] = {
    "psnr": ("PSNR against fp32 eager, dB", 35.0),
    "cosine": ("smallest per-row cosine similarity to fp32 eager", 0.99),
    "argmax": ("share of rows whose argmax is fp32 eager's", 1.0),
    "tokens": ("share of tokens equal to fp32 eager's", 1.0),
}
#: The metric each kind of output is measured by.
KIND_METRIC = {"images": "psnr", "embeddings": "cosine", "logits": "argmax", "tokens": "tokens"}
#: The share of the budget's error the end-to-end gate allows on the one call it replays (see the module docstring).
GATE_MARGIN = 0.5


def gate_threshold(metric: str, budget: float) -> float:
    """What the gate asks of the call it replays for `budget` to hold on calls it never saw (`GATE_MARGIN`)."""
    if metric == "cosine":
        return 1.0 - (1.0 - budget) * GATE_MARGIN
    if metric == "psnr":
        return budget - 10.0 * math.log10(GATE_MARGIN)  # half the squared error: +3 dB
    return budget


@dataclass(frozen=True)
class QualityFigure:
    """One end-to-end comparison: the metric, its value, the budget, whether it passed, and the output kind."""

    metric: str
    value: float
    budget: float
    passed: bool
    kind: str
    #: What this figure had to reach: the budget, or the gate's stricter threshold (`gate_threshold`). None: budget.
    threshold: float | None = None

    def verdict(self) -> str:
        """ "PSNR 31.2 dB (needs >= 35)" for a figure that failed, `text()` for one that passed."""
        return self.text() if self.passed else self.text().replace("(>=", "(needs >=")

    def text(self) -> str:
        """ "PSNR 41.2 dB (>= 35)", "min cosine 0.9981 (>= 0.99)"; at the gate "min cosine 0.9981 (>= 0.995, for
        0.99 on every call)"."""
        known = self.value is not None and not math.isnan(self.value)
        need = self.budget if self.threshold is None else self.threshold
        bound = f">= {need:g}" if need == self.budget else f">= {need:.4g}, for {self.budget:g} on every call"
        if self.metric == "psnr":
            value = "inf" if known and math.isinf(self.value) else f"{self.value:.1f}" if known else "n/a"
            return f"PSNR {value} dB ({bound})" + ("" if known else self._misfit())
        name = {"cosine": "min cosine", "argmax": "argmax agreement", "tokens": "tokens equal"}[self.metric]
        return f"{name} {self.value:.4f} ({bound})" if known else f"{name} n/a ({bound}){self._misfit()}"

    def _misfit(self) -> str:
        """Where the metric does not fit the output (`measure`'s safety net): what the output is measured by."""
        if self.kind not in KIND_METRIC or KIND_METRIC[self.kind] == self.metric:
            return ""
        return f": {self.metric} does not apply to {self.kind}, measured by {KIND_METRIC[self.kind]!r}"


def budget_for(kind: str, quality: Mapping[str, float] | None) -> tuple[str, float]:
    """The metric and budget for an output of `kind`: the default, or the one `quality` names for that metric."""
    metric = KIND_METRIC[kind]
    budget = METRICS[metric][1]
    if quality and metric in quality:
        budget = float(quality[metric])
    return metric, budget


def check_budget(quality: Mapping[str, float] | None, kinds: Collection[str], owner: str) -> None:
    """Refuse a budget that cannot apply: `ConfigError` when a metric of `quality` fits none of `kinds` (what `owner`,
    e.g. "this SentenceTransformer", returns: "images", "embeddings", "logits", "tokens"), naming the kinds and the
    metrics that fit them. Every metric must fit: a budget that would never be measured is a mistake, not a default.
    None (no budget: the defaults per kind) always applies. `quality` holds known metric names (`TuningConfig`)."""
    if not quality:
        return
    fitting = [KIND_METRIC[kind] for kind in KIND_METRIC if kind in kinds]
    unfit = [metric for metric in quality if metric not in fitting]
    if not unfit:
        return
    returns = " or ".join(kind for kind in KIND_METRIC if kind in kinds)
    fits = ", ".join(f"{metric!r} ({METRICS[metric][0]}, default {METRICS[metric][1]:g})" for metric in fitting)
    example = ", ".join(f"{metric!r}: {METRICS[metric][1]:g}" for metric in fitting)
    kind_of = {metric: kind for kind, metric in KIND_METRIC.items()}
    misfits = " and ".join(f"{metric!r} is for {kind_of[metric]}" for metric in unfit)
    raise ConfigError(
        f"quality={dict(quality)!r} cannot apply: {owner} returns {returns}, and {misfits}; metrics that fit: {fits}, "
        f"e.g. quality={{{example}}} (or no quality= for the defaults)"
    )


def output_kind(output: Any) -> str:
    """ "images", "tokens", "logits" or "embeddings" (see the module docstring)."""
    if _field(output, "images") is not None:
        return "images"
    if _field(output, "sequences") is not None:
        return "tokens"
    if _field(output, "logits") is not None:
        return "logits"
    leaf = _first_array(output)
    if leaf is not None and not np.issubdtype(leaf.dtype, np.floating):
        return "tokens"
    if _is_image_list(output):
        return "images"
    return "embeddings"


def measure(
    reference: Any, candidate: Any, quality: Mapping[str, float] | None = None, gate: bool = False
) -> QualityFigure:
    """Compare a whole call's output (`candidate`) with the fp32 eager output of the same call (`reference`). With
    `gate`, the figure passes at the gate's threshold (`gate_threshold`) rather than at the budget."""
    kind = output_kind(reference)
    metric, budget = budget_for(kind, quality)
    threshold = gate_threshold(metric, budget) if gate else budget
    if quality:
        foreign = sorted(set(quality) - {metric})
        if foreign and metric not in quality:
            # The caller set a budget for a metric this output is not measured by: fail safe, and say so.
            return QualityFigure(foreign[0], float("nan"), float(quality[foreign[0]]), False, kind)
    raw = _raw(reference, kind)
    ref, cand = _values(raw), _values(_raw(candidate, kind))
    if ref.shape != cand.shape:
        return QualityFigure(metric, float("-inf"), budget, False, kind, threshold if gate else None)
    if metric == "psnr":
        value = _psnr(ref, cand, _peak(raw))
    else:
        value = {"cosine": _min_cosine, "argmax": _argmax, "tokens": _tokens}[metric](ref, cand)
    return QualityFigure(metric, value, budget, bool(value >= threshold), kind, threshold if gate else None)


# -- reading outputs -------------------------------------------------------------------------------------------------


def _field(output: Any, name: str) -> Any:
    if isinstance(output, Mapping):
        return output.get(name)
    if dataclasses.is_dataclass(output) or hasattr(output, "__dict__"):
        return getattr(output, name, None)
    return None


def _is_image_list(output: Any) -> bool:
    items = output if isinstance(output, list | tuple) else [output]
    return bool(items) and all(type(item).__module__.startswith("PIL.") for item in items)


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu().numpy() if value.is_floating_point() else value.detach().cpu().numpy()
    elif isinstance(value, list | tuple) and value and type(value[0]).__module__.startswith("PIL."):
        value = np.stack([np.asarray(image) for image in value])
    return np.asarray(value)


def _first_array(output: Any) -> np.ndarray | None:
    if isinstance(output, torch.Tensor | np.ndarray):
        return _as_array(output)
    for name in ("last_hidden_state", "embeddings", "sentence_embedding", "sample"):
        value = _field(output, name)
        if value is not None:
            return _as_array(value)
    if isinstance(output, list | tuple) and output and isinstance(output[0], torch.Tensor | np.ndarray):
        return _as_array(output[0])
    return None


def _raw(output: Any, kind: str) -> np.ndarray:
    """The array a metric compares, as the output holds it."""
    if kind == "images":
        images = _field(output, "images")
        return _as_array(output if images is None else images)
    if kind == "tokens":
        sequences = _field(output, "sequences")
        return _as_array(output if sequences is None else sequences)
    if kind == "logits":
        return _as_array(_field(output, "logits"))
    value = _first_array(output)
    if value is None:
        raise InputTypeError(f"cannot read an embedding or hidden state from a {type(output).__name__}")
    return value


def _values(raw: np.ndarray) -> np.ndarray:
    return raw if not np.issubdtype(raw.dtype, np.floating) and raw.dtype != np.uint8 else raw.astype(np.float64)


def _peak(raw: np.ndarray) -> float:
    """The images' peak value: 255 for 8-bit images, 1 for images in [0, 1], else the reference's range (latents)."""
    if raw.dtype == np.uint8:
        return 255.0
    low, high = float(raw.min()), float(raw.max())
    return 1.0 if low >= 0.0 and high <= 1.0 else max(high - low, 1e-12)


# -- metrics ---------------------------------------------------------------------------------------------------------


def _psnr(ref: np.ndarray, cand: np.ndarray, peak: float) -> float:
    mse = float(np.mean((ref.astype(np.float64) - cand.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(peak**2 / mse)


def _rows(value: np.ndarray) -> np.ndarray:
    return value.reshape(-1, value.shape[-1]) if value.ndim > 1 else value.reshape(1, -1)


def _min_cosine(ref: np.ndarray, cand: np.ndarray) -> float:
    a, b = _rows(ref), _rows(cand)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = np.sum(a * b, axis=1)
    same = np.abs(a - b).max(axis=1) == 0 if a.size else np.ones(len(a), dtype=bool)
    cos = np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), np.where(same, 1.0, 0.0))
    return float(cos.min()) if cos.size else 1.0


def _argmax(ref: np.ndarray, cand: np.ndarray) -> float:
    a, b = _rows(ref), _rows(cand)
    return float(np.mean(a.argmax(axis=1) == b.argmax(axis=1))) if a.size else 1.0


def _tokens(ref: np.ndarray, cand: np.ndarray) -> float:
    return float(np.mean(ref == cand)) if ref.size else 1.0
