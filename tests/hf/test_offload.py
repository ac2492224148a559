"""Wrapping under real offload and placement hooks, on CPU: model CPU offload (hooks re-applied after each
call), sequential (leaf) offload, group offload at block level, and an Accelerate device_map dispatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from accelerate.hooks import remove_hook_from_module
from diffusers.hooks import HookRegistry

from aitune_hf import AITuneModel, AITunePipeline, TargetState
from aitune_hf.testing import minilm_path
from tests.hf.conftest import run, unpatched
from tests.quick import ORT

CPU = torch.device("cpu")
#: The tiny SD UNet's stages: what model CPU offload moves around each call (the UNet as a whole).
UNET_STAGES = ["unet.down_blocks.0", "unet.down_blocks.1", "unet.mid_block", "unet.up_blocks.0", "unet.up_blocks.1"]


def _load(folder):
    pipe = AITunePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _router_of(target):
    return target._router


def test_model_cpu_offload_blocks(pipeline_folders) -> None:
    pipe = _load(pipeline_folders["sd"])
    expected = run(pipe, "sd")
    pipe.enable_model_cpu_offload(device="cpu")
    registration = pipe.enable_aitune(UNET_STAGES, **ORT)
    outputs = [run(pipe, "sd") for _ in range(3)]  # record, tune, tuned; hooks are re-applied after each
    assert hasattr(pipe.unet, "_hf_hook")  # the offload hooks are live
    unet_blocks = list(registration.targets.values())
    assert all(t.state is TargetState.TUNED for t in unet_blocks), registration.report()
    assert all(t.calls_served.get("onnxruntime", 0) >= 2 for t in unet_blocks)  # served after re-application
    for out in outputs:
        np.testing.assert_allclose(out, expected, atol=2e-3)
    sample = next(iter(registration.targets["unet.mid_block"].samples.values()), None)
    assert sample is None  # tuned: samples were released
    pipe.disable_aitune()
    np.testing.assert_array_equal(run(pipe, "sd"), expected)
    assert hasattr(pipe.unet, "_hf_hook")


def test_model_cpu_offload_components_go_beneath_the_hook(pipeline_folders) -> None:
    pipe = _load(pipeline_folders["sd"])
    expected = run(pipe, "sd")
    pipe.enable_model_cpu_offload(device="cpu")
    registration = pipe.enable_aitune(["text_encoder", "unet.mid_block"], **ORT)
    encoder = registration.targets["text_encoder"]
    assert "Accelerate" in encoder.slot_description
    assert pipe.text_encoder.__dict__["_old_forward"] is _router_of(encoder)
    recorded = run(pipe, "sd")  # the offload hooks are removed and re-applied around this call
    assert pipe.text_encoder.__dict__["_old_forward"] is _router_of(encoder)  # the wrapper went along
    recorded_devices = {spec.device for sig in encoder.samples for spec in sig.tensor_specs}
    assert recorded_devices == {CPU}  # inputs recorded where the hook put them: the execution device
    outputs = [recorded, run(pipe, "sd"), run(pipe, "sd")]
    assert registration.state_counts == {"tuned": 2}, registration.report()
    assert encoder.calls_served["onnxruntime"] >= 2
    for out in outputs:
        np.testing.assert_allclose(out, expected, atol=2e-3)
    remove_hook_from_module(pipe.text_encoder)  # the hook goes: the wrapper becomes the forward
    assert pipe.text_encoder.__dict__["forward"] is _router_of(encoder)
    pipe.enable_model_cpu_offload(device="cpu")  # and comes back: the wrapper is beneath it again
    assert pipe.text_encoder.__dict__["_old_forward"] is _router_of(encoder)
    pipe.disable_aitune()
    assert pipe.text_encoder.__dict__["_old_forward"] is not _router_of(encoder)
    np.testing.assert_array_equal(run(pipe, "sd"), expected)  # the hooks still work


def test_sequential_offload_keeps_blocks_eager_with_the_reason(pipeline_folders) -> None:
    # enable_sequential_cpu_offload() is accelerate's cpu_offload() on each component; applied here to the
    # UNet (with transformers 5.24 + accelerate 1.15 the CLIP text encoder fails under it even without aitune).
    pipe = _load(pipeline_folders["sd"])
    expected = run(pipe, "sd")
    cpu_offload(pipe.unet, execution_device=CPU)
    assert any(hasattr(m, "_hf_hook") for m in pipe.unet.down_blocks[0].modules())
    registration = pipe.enable_aitune([f"unet.{p}" for p in ("down_blocks.0", "mid_block", "up_blocks.1")], **ORT)
    outputs = [run(pipe, "sd") for _ in range(2)]
    for target in registration.targets.values():
        assert target.state is TargetState.EAGER
        assert "weights move per call inside this block" in target.reason
    for out in outputs:
        np.testing.assert_allclose(out, expected, atol=1e-5)
    pipe.disable_aitune()
    assert unpatched(pipe.unet.modules())
    np.testing.assert_allclose(run(pipe, "sd"), expected, atol=1e-5)  # the leaf hooks still work
    assert any(hasattr(m, "_hf_hook") for m in pipe.unet.down_blocks[0].modules())


def test_group_offload_block_level(pipeline_folders) -> None:
    pipe = _load(pipeline_folders["pixart"])
    expected = run(pipe, "pixart")
    pipe.transformer.enable_group_offload(
        onload_device=CPU, offload_device=CPU, offload_type="block_level", num_blocks_per_group=1
    )
    block = pipe.transformer.transformer_blocks[0]
    assert "group_offloading" in block._diffusers_hook.hooks
    # The transformer's blocks, the ones under the group-offload hooks (the text encoder's and the VAE's blocks,
    # which no hook reaches, would only add an Inductor compile and an export each).
    registration = pipe.enable_aitune(
        lambda p: {f"transformer.transformer_blocks.{i}": b for i, b in enumerate(p.transformer.transformer_blocks)},
        backends=["onnxruntime", "inductor"],
        min_speedup=0,
        progress=False,
        warmup=1,
        repeats=2,
        shapes="exact",
    )
    name = "transformer.transformer_blocks.0"
    target = registration.targets[name]
    assert "Diffusers" in target.slot_description
    outputs = [run(pipe, "pixart") for _ in range(3)]
    assert target.state is TargetState.TUNED and target.report().backend == "inductor"
    onnx = next(c for c in target.report().signatures[0].candidates if c.backend == "onnxruntime")
    assert "group_offloading" in onnx.error and "bakes weights" in onnx.error
    for out in outputs:
        np.testing.assert_allclose(out, expected, atol=2e-3)
    HookRegistry.check_if_exists_or_initialize(pipe.transformer).remove_hook("group_offloading", recurse=True)
    assert block.__dict__["forward"] is _router_of(target)  # hooks removed: the wrapper is the forward
    np.testing.assert_allclose(run(pipe, "pixart"), expected, atol=2e-3)
    served = target.calls_served["inductor"]
    pipe.transformer.enable_group_offload(
        onload_device=CPU, offload_device=CPU, offload_type="block_level", num_blocks_per_group=1
    )
    np.testing.assert_allclose(run(pipe, "pixart"), expected, atol=2e-3)
    assert target.calls_served["inductor"] > served  # re-applied hooks call down into the wrapper
    pipe.disable_aitune()
    assert unpatched(pipe.transformer.modules())
    np.testing.assert_allclose(run(pipe, "pixart"), expected, atol=1e-5)


@pytest.fixture(scope="module")
def minilm_batch():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    return dict(tokenizer(["a cat sat on the mat", "hello world"], padding=True, return_tensors="pt"))


def test_device_map_dispatch_hooks_each_block(minilm_batch) -> None:
    model = AITuneModel.from_pretrained(minilm_path(), local_files_only=True).eval()
    with torch.no_grad():
        expected = model(**minilm_batch).last_hidden_state
    device_map = {"embeddings": "cpu", "pooler": "cpu"} | {f"encoder.layer.{i}": "cpu" for i in range(6)}
    dispatch_model(model, device_map=device_map, force_hooks=True)
    assert all(hasattr(layer, "_hf_hook") for layer in model.encoder.layer)
    registration = model.enable_aitune("blocks", **ORT)
    assert all("Accelerate" in t.slot_description for t in registration.targets.values())
    with torch.no_grad():
        outputs = [model(**minilm_batch).last_hidden_state for _ in range(3)]
    assert registration.state_counts == {"tuned": 6}
    for out in outputs:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    remove_hook_from_module(model, recurse=True)
    target = registration.targets["encoder.layer.0"]
    assert model.encoder.layer[0].__dict__["forward"] is _router_of(target)
    dispatch_model(model, device_map=device_map, force_hooks=True)
    assert model.encoder.layer[0].__dict__["_old_forward"] is _router_of(target)
    with torch.no_grad():
        torch.testing.assert_close(model(**minilm_batch).last_hidden_state, expected, atol=1e-4, rtol=1e-4)
    assert target.calls_served["onnxruntime"] >= 3
    model.disable_aitune()
    assert all(hasattr(layer, "_hf_hook") for layer in model.encoder.layer)
    with torch.no_grad():
        torch.testing.assert_close(model(**minilm_batch).last_hidden_state, expected, atol=1e-6, rtol=1e-6)
