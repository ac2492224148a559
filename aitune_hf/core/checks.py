"""Output comparison: same structure, finite values, and values within dtype-aware tolerances of eager."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from aitune_hf.core.signature import state_tensors


@dataclass
class CheckResult:
    """Whether a candidate's output may stand in for eager's, and by how far it differs."""

    ok: bool
    max_abs_error: float
    reason: str | None = None
    #: The largest relative L2 error of a floating output leaf, ||candidate - eager|| / ||eager||.
    rel_error: float = 0.0


def compare_outputs(
    reference: Any,
    candidate: Any,
    tolerance: Callable[[torch.dtype], tuple[float, float]],
    relative: float | None = None,
) -> CheckResult:
    """Compare one candidate output with the eager reference output of the same call: within `tolerance`'s (atol,
    rtol) elementwise, or, with `relative` (reduced precision, `core/precision.py`), within that relative L2 error
    per floating leaf. Structure, dtypes, shapes, finiteness and non-floating leaves must match either way."""
    ref_leaves, ref_spec = pytree.tree_flatten(reference)
    cand_leaves, cand_spec = pytree.tree_flatten(candidate)
    if ref_spec != cand_spec:
        return CheckResult(
            False, float("nan"), f"output structure differs: expected {_describe(ref_spec)}, got {_describe(cand_spec)}"
        )
    worst = worst_rel = 0.0
    for index, (ref, cand) in enumerate(zip(ref_leaves, cand_leaves, strict=True)):
        if not isinstance(ref, torch.Tensor):
            if isinstance(cand, torch.Tensor) or type(ref) is not type(cand):
                return CheckResult(False, float("nan"), f"output leaf {index} differs: {ref!r:.80} vs {cand!r:.80}")
            if isinstance(ref, _PLAIN):
                if not _plain_equal(ref, cand):
                    return CheckResult(False, float("nan"), f"output leaf {index} differs: {ref!r} vs {cand!r}")
                continue
            # An object (a KV cache the call returns): each replay has its own copy, so compare what it holds.
            inner = compare_outputs(state_tensors(ref), state_tensors(cand), tolerance, relative)
            if not inner.ok:
                return CheckResult(
                    False, inner.max_abs_error, f"output leaf {index} ({type(ref).__name__}): {inner.reason}"
                )
            worst, worst_rel = max(worst, inner.max_abs_error), max(worst_rel, inner.rel_error)
            continue
        if not isinstance(cand, torch.Tensor):
            return CheckResult(False, float("nan"), f"output leaf {index} is {type(cand).__name__}, not a tensor")
        if cand.shape != ref.shape or cand.dtype != ref.dtype:
            return CheckResult(
                False,
                float("nan"),
                f"output leaf {index} is {cand.dtype}{list(cand.shape)}, expected {ref.dtype}{list(ref.shape)}",
            )
        cand = cand.to(ref.device)
        if ref.is_floating_point() or ref.is_complex():
            if not bool(torch.isfinite(cand).all()) and bool(torch.isfinite(ref).all()):
                return CheckResult(False, float("nan"), f"output leaf {index} has non-finite values")
            diff = (cand.double() - ref.double()).abs()
            diff = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))
            error = float(diff.max()) if diff.numel() else 0.0
            worst = max(worst, error)
            scale = float(torch.linalg.vector_norm(torch.nan_to_num(ref.double()))) if ref.numel() else 0.0
            rel = float(torch.linalg.vector_norm(diff)) / scale if scale > 0 else (0.0 if error == 0 else math.inf)
            worst_rel = max(worst_rel, rel)
            if relative is not None:
                if rel > relative:
                    return CheckResult(
                        False,
                        worst,
                        f"output leaf {index} is {rel:.3g} off eager (relative L2; budget {relative:g})",
                        rel,
                    )
                continue
            atol, rtol = tolerance(ref.dtype)
            if not torch.allclose(cand, ref, atol=atol, rtol=rtol, equal_nan=True):
                return CheckResult(
                    False,
                    worst,
                    f"output leaf {index} differs from eager by up to {error:.3g} "
                    f"(atol={atol:g}, rtol={rtol:g} for {ref.dtype})",
                )
        elif not torch.equal(cand, ref):
            return CheckResult(False, float("nan"), f"output leaf {index} ({ref.dtype}) differs from eager")
    return CheckResult(True, worst, rel_error=worst_rel)


#: Output leaves compared by value; any other object is compared by the tensors it holds.
_PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _plain_equal(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # objects whose == is not a plain bool cannot be vouched for
        return False


def _describe(spec: pytree.TreeSpec) -> str:
    text = str(spec).replace("\n", " ")
    return " ".join(text.split())[:160]
