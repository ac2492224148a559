"""OpenVINO through the whole user flow: a tiny SD pipeline with a real peft LoRA adapter, every block tuned with
OpenVINO (fp32: f32 even on a CPU whose OpenVINO default is bf16), then an adapter weight change: every served call
equals an eager call in the same state, and the changed stages are served by OpenVINO again on their own; and a per-call
LoRA scale alternating the state of a stage served by OpenVINO, whose calls start before their guard is checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aitune_hf import TargetState
from tests.hf.conftest import call_kwargs
from tests.hf.test_guards_diffusers import (  # noqa: F401
    ATOL,
    MID,
    STEPS,
    assert_changed,
    check,
    finish,
    lora_folders,
    sd,
)
from tests.quick import QUICK

pytest.importorskip("openvino")

from aitune_hf.backends import OpenVinoBackend

#: One door (the ONNX export's): these tests are about what a served block follows, not about the door (both doors'
#: builds are tests/backends/test_openvino.py's).
OV = "openvino(door=onnx)"
OPENVINO = {**QUICK, "backends": [OpenVinoBackend(door="onnx")], "min_speedup": 0, "shapes": "exact"}


def openvino_calls(pipe) -> dict[str, int]:
    return {name: pipe.aitune.reports[name].calls.get(OV, 0) for name in pipe.aitune.targets}


def test_every_sd_block_served_by_openvino_follows_a_lora_change(sd) -> None:  # noqa: F811 (the fixture)
    pipe = sd("a")
    registration = pipe.enable_aitune("blocks", **OPENVINO)
    for _ in range(2):  # records, then tunes inside the second call
        pipe(**call_kwargs("sd"), generator=torch.Generator().manual_seed(0))
    assert registration.all_tuned, registration.report()
    tuned_here = [name for name, target in registration.targets.items() if target.state is TargetState.TUNED]
    assert {name for name in registration.targets if name.startswith(("unet.", "text_encoder."))} <= set(tuned_here)
    assert {registration.reports[name].backend for name in tuned_here} == {OV}, registration.report()
    before = openvino_calls(pipe)
    reference = check(pipe, "tuning with OpenVINO")
    served = openvino_calls(pipe)
    unet = [name for name in served if name.startswith("unet.")]
    assert all(served[name] - before[name] == STEPS for name in unet), (before, served)

    pipe.set_adapters("a", 0.5)
    changed = check(pipe, "set_adapters('a', 0.5)")  # the guard sends the stale blocks to eager at once
    assert_changed(reference, changed, "set_adapters('a', 0.5)")
    for _ in range(4):  # the changed stages tune again for the new state, on their own
        before = openvino_calls(pipe)
        tuned = check(pipe, "set_adapters('a', 0.5), re-tuned")
        if all(openvino_calls(pipe)[name] - before[name] == STEPS for name in unet):
            break
    else:
        raise AssertionError(f"not served by OpenVINO again:\n{pipe.aitune.report()}")
    assert all(registration.targets[name].state is TargetState.TUNED for name in unet)
    np.testing.assert_allclose(tuned, changed, atol=ATOL)
    finish(pipe)


def test_a_per_call_lora_scale_served_by_openvino_is_right_on_every_call(sd) -> None:  # noqa: F811 (the fixture)
    """peft's per-call scale changes a UNet stage's state call by call. A call served by OpenVINO starts before the
    guard is checked (the route of the state that changed last) and is cancelled where the other state's route holds:
    every call equals eager in its state, and once both states have routes, both are served by OpenVINO."""
    pipe = sd("a")
    full = {"cross_attention_kwargs": {"scale": 1.0}}
    low = {"cross_attention_kwargs": {"scale": 0.3}}
    registration = pipe.enable_aitune(MID, **OPENVINO)
    for _ in range(2):  # records, then tunes inside the second call
        pipe(**call_kwargs("sd"), **full, generator=torch.Generator().manual_seed(0))
    assert registration.targets[MID[0]].state is TargetState.TUNED, registration.report()
    reference = check(pipe, "tuning", **full)
    for cycle in range(4):
        assert_changed(reference, check(pipe, f"scale 0.3 (cycle {cycle})", **low), "scale 0.3")
        np.testing.assert_allclose(check(pipe, f"scale 1.0 (cycle {cycle})", **full), reference, atol=1e-6)
    for extra in (low, full, low, full):  # both states routed: every UNet call served by OpenVINO
        before = openvino_calls(pipe)[MID[0]]
        check(pipe, "both states routed", **extra)
        assert openvino_calls(pipe)[MID[0]] - before == STEPS, pipe.aitune.report()
    assert registration.reports[MID[0]].routes == 2, pipe.aitune.report()
    assert "raised" not in str(pipe.aitune.report())
    finish(pipe)
