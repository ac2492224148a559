"""Output comparison rules: structure, finiteness, dtype-aware tolerances."""

from __future__ import annotations

import math

import torch

from aitune_hf.core.checks import compare_outputs
from aitune_hf.core.config import TuningConfig

tolerance = TuningConfig().tolerance


def test_equal_nested_structures_pass() -> None:
    x = torch.randn(3, 4)
    out = ({"a": x, "b": [x * 2, None]}, 3)
    result = compare_outputs(out, ({"a": x.clone(), "b": [x * 2, None]}, 3), tolerance)
    assert result.ok and result.max_abs_error == 0.0


def test_structure_mismatches_fail() -> None:
    x = torch.randn(3)
    assert "structure" in compare_outputs((x,), [x], tolerance).reason
    assert "structure" in compare_outputs({"a": x}, {"b": x}, tolerance).reason
    assert "leaf 0" in compare_outputs((x, None), (x * 0, None), tolerance).reason
    assert "not a tensor" in compare_outputs((x,), (1.0,), tolerance).reason
    assert "expected torch.float32[3]" in compare_outputs(x, x.half(), tolerance).reason
    assert "expected torch.float32[3]" in compare_outputs(x, x[:2], tolerance).reason


def test_non_finite_outputs_fail_unless_eager_had_them_too() -> None:
    x = torch.ones(4)
    nan = x.clone()
    nan[1] = float("nan")
    assert "non-finite" in compare_outputs(x, nan, tolerance).reason
    assert compare_outputs(nan, nan.clone(), tolerance).ok


def test_tolerances_depend_on_dtype() -> None:
    base = torch.ones(8)
    assert compare_outputs(base, base + 5e-4, tolerance).ok  # fp32: atol 1e-3
    assert not compare_outputs(base, base + 5e-3, tolerance).ok
    half = base.half()
    assert compare_outputs(half, half + 5e-3, tolerance).ok  # fp16: atol 1e-2
    result = compare_outputs(half, half + 0.1, tolerance)
    assert not result.ok and math.isclose(result.max_abs_error, 0.1, rel_tol=1e-2)
    ints = torch.arange(4)
    assert not compare_outputs(ints, ints + 1, tolerance).ok  # integers must match exactly


def test_model_output_like_dataclasses_are_compared_field_by_field() -> None:
    from collections import OrderedDict

    x = torch.randn(2)
    assert compare_outputs(OrderedDict(a=x), OrderedDict(a=x.clone()), tolerance).ok
    assert not compare_outputs(OrderedDict(a=x), OrderedDict(a=x + 1), tolerance).ok


def test_returned_objects_are_compared_by_the_tensors_they_hold() -> None:
    """A whole LM returns the KV cache it was given; each replay holds its own copy (never `==` to another)."""
    from transformers import DynamicCache

    def cache(scale: float) -> DynamicCache:
        filled = DynamicCache()
        filled.update(torch.ones(1, 2, 3, 4) * scale, torch.ones(1, 2, 3, 4), layer_idx=0)
        return filled

    x = torch.randn(2)
    assert compare_outputs((x, cache(1.0)), (x, cache(1.0)), tolerance).ok
    result = compare_outputs((x, cache(1.0)), (x, cache(2.0)), tolerance)
    assert not result.ok
    assert "output leaf 1 (DynamicCache): output leaf 0 differs from eager by up to 1" in result.reason
    assert "differs" in compare_outputs((x, cache(1.0)), (x, object()), tolerance).reason
