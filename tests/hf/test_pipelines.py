"""Diffusers pipelines end to end: load, enable, record, tune inside the flow, match eager, report, disable."""

from __future__ import annotations

import json

import numpy as np
import pytest
from diffusers import DiffusionPipeline, StableDiffusionPipeline, UNet2DConditionModel

from aitune_hf import AITunePipeline, TargetState, enable_aitune
from aitune_hf.hf.mixin import AITuneMixin
from tests.hf.conftest import call_kwargs, generator, run, unpatched
from tests.quick import ORT, ORT_FAMILY

DENOISER = {"sd": "unet.", "flux": "transformer.", "pixart": "transformer."}


def _load(folder):
    pipe = AITunePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module", params=["sd", "flux", "pixart"])
def tuned(request, pipeline_folders):
    """Each family: eager output, then enable + record + tune + tuned calls (shared by the tests below)."""
    family = request.param
    pipe = _load(pipeline_folders[family])
    expected = run(pipe, family)
    # SD on the default path (shape families: its second resolution is served by the polymorphic builds below);
    # Flux and PixArt with exact shapes, a third of the export time.
    registration = pipe.enable_aitune("blocks", **(ORT_FAMILY if family == "sd" else ORT))
    recorded = run(pipe, family)
    after_recording = {name: t.state for name, t in registration.targets.items()}
    armed = all(t.armed for t in registration.targets.values())
    tuning = run(pipe, family)
    again = run(pipe, family)
    yield {
        "family": family, "pipe": pipe, "registration": registration, "expected": expected, "recorded": recorded,
        "after_recording": after_recording, "armed": armed, "tuning": tuning, "again": again,
    }  # fmt: skip
    pipe.disable_aitune()


def test_loaded_as_the_concrete_class(tuned) -> None:
    pipe = tuned["pipe"]
    concrete = type(pipe).__mro__[1]
    assert isinstance(pipe, AITuneMixin) and isinstance(pipe, concrete)
    assert type(pipe).__name__ == concrete.__name__ and type(pipe).__module__ == concrete.__module__


def test_first_call_records_eagerly_and_arms(tuned) -> None:
    np.testing.assert_array_equal(tuned["recorded"], tuned["expected"])
    assert set(tuned["after_recording"].values()) == {TargetState.ARMED}  # recorded, armed for the next call
    assert tuned["armed"]


def test_second_call_tunes_and_output_matches_eager(tuned) -> None:
    registration = tuned["registration"]
    assert registration.all_tuned
    np.testing.assert_allclose(tuned["tuning"], tuned["expected"], atol=2e-3)
    np.testing.assert_allclose(tuned["again"], tuned["expected"], atol=2e-3)
    denoiser = [t for name, t in registration.targets.items() if name.startswith(DENOISER[tuned["family"]])]
    assert denoiser and all(t.state is TargetState.TUNED for t in denoiser), registration.report()
    for target in registration.targets.values():
        # eager always says why; the VAE's encoder stages are idle (a text-to-image call never encodes)
        assert target.state is TargetState.TUNED or target.reason or target.idle


def test_per_block_state_is_readable_from_the_pipeline(tuned) -> None:
    pipe = tuned["pipe"]
    name = next(n for n in pipe.aitune.targets if n.startswith(DENOISER[tuned["family"]]))
    report = pipe.aitune.reports[name]
    assert report.backend == "onnxruntime" and report.signatures and report.calls["onnxruntime"] >= 1
    text = str(pipe.aitune.report())
    # One eager call (the first, cold) was seen before tuning: never compared with warm tuned calls.
    assert not text.startswith("end to end") and pipe.aitune.end_to_end is None and name in text
    assert sum(pipe.aitune.state_counts.values()) == len(pipe.aitune.targets)
    data = json.loads(pipe.aitune.report().to_json())
    assert data["end_to_end"] is None and name in data["modules"]


def test_the_end_to_end_line_compares_warm_eager_calls_with_tuned_ones(pipeline_folders) -> None:
    pipe = _load(pipeline_folders["sd"])
    registration = pipe.enable_aitune(["unet.mid_block"], tune_after_calls=2, **ORT)
    for _ in range(4):  # cold eager (left out), warm eager (recording), tuning, tuned
        run(pipe, "sd")
    line = str(registration.report()).splitlines()[0]
    assert line.startswith("end to end: eager") and "(measured)" in line
    method = "whole calls of the same inputs: 1 warm before tuning (recording), 1 after; medians"
    assert registration.end_to_end["method"] == method
    pipe.disable_aitune()


def test_disable_restores_every_forward(pipeline_folders) -> None:
    pipe = _load(pipeline_folders["sd"])
    expected = run(pipe, "sd")
    registration = pipe.enable_aitune(["unet.mid_block", "vae.decoder.up_blocks.1"], **ORT)
    modules = list(registration.modules.values())
    run(pipe, "sd")
    run(pipe, "sd")
    assert registration.state_counts == {"tuned": 2}
    pipe.disable_aitune()
    assert pipe.aitune.detached and unpatched(modules) and all("forward" not in m.__dict__ for m in modules)
    np.testing.assert_array_equal(run(pipe, "sd"), expected)


def test_from_pretrained_hook_manual_arming_and_measure(pipeline_folders) -> None:
    pipe = AITunePipeline.from_pretrained(
        pipeline_folders["sd"], aitune={"targets": ["unet.down_blocks.1"], "tune_after_calls": None, **ORT}
    )
    pipe.set_progress_bar_config(disable=True)
    assert list(pipe.aitune.modules) == ["unet.down_blocks.1"]
    run(pipe, "sd")
    run(pipe, "sd")
    assert pipe.aitune.state_counts == {"recording": 1}
    with pytest.raises(RuntimeError, match=r"until aitune\.all_tuned"):
        pipe.measure_aitune(prompt="a horse", height=64, width=64, num_inference_steps=2)
    pipe.aitune.tune()
    run(pipe, "sd")
    assert pipe.aitune.all_tuned
    measured = pipe.measure_aitune(prompt="a horse", height=64, width=64, num_inference_steps=2, rounds=2)
    assert measured["method"].startswith("interleaved") and measured["eager_s"] > 0 and measured["tuned_s"] > 0
    assert pipe.aitune.report().end_to_end == measured
    pipe.disable_aitune()


def test_enable_aitune_on_an_object_built_elsewhere(pipeline_folders) -> None:
    pipe = DiffusionPipeline.from_pretrained(pipeline_folders["sd"])
    assert type(pipe) is StableDiffusionPipeline
    registration = enable_aitune(pipe, targets="components", backends=[], progress=False)
    assert isinstance(pipe, StableDiffusionPipeline) and pipe.aitune is registration
    assert list(registration.modules) == ["vae.encoder", "vae.decoder", "text_encoder", "unet"]
    assert all(target.whole for target in registration.targets.values())  # whole models: quick builds first
    with pytest.raises(RuntimeError, match="already enabled"):
        pipe.enable_aitune()
    pipe.disable_aitune()
    with pytest.raises(ValueError, match="unknown targets 'everything'"):
        pipe.enable_aitune("everything")
    assert pipe.aitune.detached and "forward" not in pipe.unet.__dict__  # the last one, detached


def test_save_pretrained_writes_the_real_class_and_plain_diffusers_reloads(pipeline_folders, tmp_path) -> None:
    pipe = _load(pipeline_folders["sd"])
    pipe.enable_aitune("blocks", backends=[], progress=False)
    assert not any(target.whole for target in pipe.aitune.targets.values())  # blocks, no whole model
    run(pipe, "sd")
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"
    reloaded = DiffusionPipeline.from_pretrained(tmp_path)
    assert type(reloaded) is StableDiffusionPipeline
    reloaded.set_progress_bar_config(disable=True)
    pipe.disable_aitune()
    np.testing.assert_array_equal(run(reloaded, "sd"), run(pipe, "sd"))


def test_replacing_a_component_registers_the_new_one(pipeline_folders) -> None:
    pipe = _load(pipeline_folders["sd"])
    old_unet = pipe.unet
    pipe.enable_aitune("blocks", backends=[], progress=False)
    new_unet = UNet2DConditionModel.from_pretrained(pipeline_folders["sd"] / "unet").eval()
    pipe.unet = new_unet
    assert pipe.aitune.modules["unet.mid_block"] is new_unet.mid_block
    assert unpatched(old_unet.modules())
    run(pipe, "sd")
    steps = call_kwargs("sd")["num_inference_steps"]
    assert pipe.aitune.targets["unet.mid_block"].calls_recorded == steps  # one UNet call per step
    pipe.disable_aitune()
    assert unpatched(new_unet.modules())


def test_auto_tunes_components_then_descends_into_those_that_stay_eager(pipeline_folders) -> None:
    pipe = _load(pipeline_folders["sd"])
    expected = run(pipe, "sd")
    registration = pipe.enable_aitune("auto", **ORT)
    assert list(registration.targets) == ["vae.encoder", "vae.decoder", "text_encoder", "unet"]
    # Whatever keeps a component eager (a failed export, nothing faster, a hook): its stages replace it.
    registration.targets["unet"].pin_eager("kept eager as a whole by this test")
    outputs = [run(pipe, "sd") for _ in range(2)]  # record, tune the components
    assert "unet" in registration.descended and "unet" not in registration.targets
    assert [n for n in registration.targets if n.startswith("unet.")] == [
        "unet.down_blocks.0", "unet.down_blocks.1", "unet.mid_block", "unet.up_blocks.0", "unet.up_blocks.1",
    ]  # fmt: skip
    outputs += [run(pipe, "sd") for _ in range(2)]  # record the stages; eager while the worker tunes them
    assert registration.wait(timeout=300), registration.report()  # no call tunes inside itself after all_tuned
    outputs.append(run(pipe, "sd"))  # tuned
    assert registration.all_tuned, registration.report()
    assert registration.targets["unet.mid_block"].state is TargetState.TUNED
    assert registration.targets["text_encoder"].report().backend == "onnxruntime"
    assert registration.descended["unet"].reason == "kept eager as a whole by this test"
    for out in outputs:
        np.testing.assert_allclose(out, expected, atol=2e-3)
    assert "descended into unet" in str(registration.report())
    pipe.disable_aitune()
    assert unpatched(pipe.unet.modules()) and unpatched(pipe.vae.modules())


def test_auto_serves_the_whole_unet_from_one_onnxruntime_session(pipeline_folders) -> None:
    """The UNet's forward takes a 0-d timestep tensor; ONNX Runtime's runner keeps it 0-d (it once became (1,),
    and the session failed at run time with a broadcast error), so auto mode keeps the UNet whole."""
    pipe = _load(pipeline_folders["sd"])
    expected = run(pipe, "sd")
    registration = pipe.enable_aitune("auto", **ORT)
    outputs = [run(pipe, "sd") for _ in range(3)]
    assert registration.all_tuned and not registration.descended, registration.report()
    unet = registration.targets["unet"]
    assert unet.report().backend == "onnxruntime" and unet.calls_served.get("onnxruntime", 0) >= 1
    assert any("[scalar]" in s.signature for s in unet.report().signatures)  # the 0-d timestep
    for out in outputs:
        np.testing.assert_allclose(out, expected, atol=2e-3)
    pipe.disable_aitune()
    assert unpatched(pipe.unet.modules())


def test_a_second_resolution_is_served_by_the_polymorphic_build_after_one_check(tuned) -> None:
    """Tuned at 64x64: a 96x64 call checks each block's build once against eager (and returns eager's image),
    the next 96x64 call is served by the same builds, equal to eager at that resolution."""
    if tuned["family"] != "sd":
        pytest.skip("one family shows it (the SD UNet and VAE stages, conv and attention)")
    pipe, registration = tuned["pipe"], tuned["registration"]
    kwargs = {**call_kwargs("sd"), "height": 96, "width": 64}
    with registration.bypass():
        expected = pipe(**kwargs, generator=generator()).images
    routes = {name: t.report().routes for name, t in registration.targets.items()}
    checks = {name: sum(s.shape_checks for s in t.report().signatures) for name, t in registration.targets.items()}
    checking = pipe(**kwargs, generator=generator()).images  # text encoder layers: same shapes, served
    np.testing.assert_allclose(checking, expected, atol=2e-3)
    before = {name: dict(t.calls_served) for name, t in registration.targets.items()}
    served = pipe(**kwargs, generator=generator()).images
    np.testing.assert_allclose(served, expected, atol=2e-3)
    for name, target in registration.targets.items():
        if target.state is not TargetState.TUNED:
            continue
        report = target.report()
        assert report.routes == routes[name]  # no new build: the polymorphic one serves the new shape
        if name.startswith(("unet.", "vae.")):  # their shapes follow the resolution: each checked once
            assert sum(s.shape_checks for s in report.signatures) > checks[name], name
        calls = {k: v - before[name].get(k, 0) for k, v in target.calls_served.items()}
        assert calls.get("eager", 0) == 0 and calls["onnxruntime"] > 0, (name, calls)
