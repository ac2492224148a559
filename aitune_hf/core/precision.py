"""Reduced precision, opt-in (`TuningConfig.precision`): which variants of the candidate backends this machine runs
natively, the per-block error filter each must pass, and how reduced a precision is.

The end-to-end gate (`Registration.gate`, run by the Hugging Face layer on the whole call that tuned) is the second
check: a reduced-precision decision serves only after the whole call's output stays within the `quality` budget
against fp32 eager (`core/quality.py`); otherwise the block with the largest error falls back to its best fp32
candidate, one at a time. docs/precision.md has the rules and the measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from aitune_hf import hardware
from aitune_hf.backends.base import Backend

if TYPE_CHECKING:
    from aitune_hf.core.config import TuningConfig

#: The per-block filter: the largest relative L2 error of a block's outputs against fp32 eager on the recorded calls
#: that a candidate of each precision may have (a loose, cheap filter; the end-to-end gate decides). Measured on this
#: project's blocks (docs/precision.md): bf16 autocast 0.2-1%, int8 dynamic quantization 1-4%.
BLOCK_BUDGET = {"bf16": 0.05, "fp16": 0.02, "int8": 0.10}


def native_reason(precision: str, devices: frozenset[torch.device]) -> str | None:
    """None when every device computes `precision` natively, else why not (the first device that does not)."""
    if precision == "fp32":
        return None
    for device in sorted(devices, key=str) or [torch.device("cpu")]:
        if device.type == "cuda":
            reason = hardware.cuda_reason(device, precision)
        elif device.type == "cpu":
            reason = {
                "bf16": hardware.cpu_bf16_reason,
                "int8": hardware.cpu_int8_reason,
                "fp16": hardware.cpu_fp16_reason,
            }[precision]()
        else:
            reason = f"{precision} is not offered on {device.type}"
        if reason is not None:
            return reason
    return None


def with_precisions(
    backends: Sequence[Backend], config: TuningConfig, devices: frozenset[torch.device]
) -> tuple[list[Backend], list[tuple[str, str]]]:
    """The candidates for `config.precision` on `devices`: each backend in each precision asked for that the machine
    computes natively and the backend has a variant for, least reduced first (fp32 first); and (precision, why it is
    skipped) for each precision asked for that this machine does not compute natively. With "fp32" (the default):
    `backends` as given.

    With "auto" each fp32 candidate also brings its other kernel choices (`Backend.kernel_variants`: ONNX Runtime's
    fused kernels), which compute in fp32 and are checked by fp32 tolerances; a list of precisions (["fp32", "int8"])
    names exactly what is tried and brings none (give `OnnxRuntimeBackend(kernels="fused")` in `backends` for it).
    Each backend's other forms (`Backend.variants`: OpenVINO's second door) are candidates of their own in every
    tuning, in each of these precisions. A candidate is offered once, by `describe()`."""
    backends = list({form.describe(): form for backend in backends for form in (backend, *backend.variants())}.values())
    if not config.reduced:
        return backends, []
    precisions = config.precisions
    skipped = [(p, reason) for p in precisions if p != "fp32" and (reason := native_reason(p, devices)) is not None]
    native = [p for p in precisions if p not in dict(skipped)]
    candidates: dict[str, Backend] = {}  # by `describe()`: a variant also given explicitly is tried once
    # Precision by precision, least reduced first (each backend in the order given): the first plan of an anytime
    # tuning is then the least reduced one that wins clearly, the likeliest to pass the end-to-end gate.
    for precision in sorted(native, key=lambda p: _REDUCTION[p]):
        for backend in backends:
            variant = backend.with_precision(precision)
            if variant is None:
                continue
            candidates.setdefault(variant.describe(), variant)
            if precision == "fp32" and config.precision == "auto":  # kernel choice is part of the "auto" tier
                for kernels in variant.kernel_variants():
                    candidates.setdefault(kernels.describe(), kernels)
    return list(candidates.values()), skipped


#: How reduced each precision is (fewer bits kept: more reduced), for the gate's steps down (`less_reduced`).
_REDUCTION = {"fp32": 0, "fp16": 1, "bf16": 2, "int8": 3}


def less_reduced(precision: str, than: str) -> bool:
    """True when `precision` keeps more than `than` (fp32 > fp16 > bf16 > int8): where the end-to-end gate fails
    `than`, a block may still pass in `precision`."""
    return _REDUCTION[precision] < _REDUCTION[than]


def block_budget(precision: str) -> float | None:
    """The per-block relative error a candidate of `precision` may have; None for fp32 (checked by tolerances)."""
    return BLOCK_BUDGET.get(precision)
