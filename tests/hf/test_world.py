"""A tuned pipeline leaves the world as it found it (issue 18), with real pipelines and models: channels-last weights
and activations tune; a user's torch.compile and Diffusers' compile_repeated_blocks() over tuned and over
eager-decided blocks give eager's output; train() runs eager with eager's random stream and eval() serves again; an
img2img pipeline tunes the VAE's encoder stages. Every output is compared with eager in the same state."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import StableDiffusionImg2ImgPipeline

from aitune_hf import AITuneModel, AITunePipeline, TargetState, enable_aitune
from aitune_hf.hf.targets import find_targets
from aitune_hf.testing import minilm_path
from tests.hf.conftest import call_kwargs, generator, run, unpatched
from tests.quick import ORT

STAGES = ["unet.down_blocks.0", "unet.mid_block", "unet.up_blocks.1"]


def _load(folder) -> AITunePipeline:
    pipe = AITunePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _eager(pipe) -> np.ndarray:
    with pipe.aitune.bypass():
        return run(pipe, "sd")


def test_a_channels_last_unet_tunes_and_matches_eager(pipeline_folders) -> None:
    """`unet.to(memory_format=torch.channels_last)`: its weights and its stages' activations are channels-last. The
    ONNX export takes row-major copies (the graph does not depend on the layout); the session is fed row-major
    copies of the inputs. The layout is part of the cache key."""
    pipe = _load(pipeline_folders["sd"])
    pipe.unet.to(memory_format=torch.channels_last)
    registration = pipe.enable_aitune(STAGES, **ORT)
    outputs = [run(pipe, "sd") for _ in range(3)]
    assert registration.state_counts == {"tuned": 3}, registration.report()
    for out in outputs:
        np.testing.assert_allclose(out, _eager(pipe), atol=2e-3)
    assert all(t.calls_served.get("onnxruntime", 0) >= 1 for t in registration.targets.values())
    assert pipe.unet.mid_block.resnets[0].conv1.weight.is_contiguous(memory_format=torch.channels_last)  # untouched
    pipe.disable_aitune()


def test_compile_over_the_unet_with_tuned_and_with_eager_blocks(pipeline_folders) -> None:
    """`pipe.unet.forward = torch.compile(pipe.unet.forward)` (the call that raised
    AsPythonConstantNotImplementedError over eager-decided blocks), and `torch.compile(pipe.unet)` called directly:
    the graph breaks at each target, the output is eager's."""
    for config in (ORT, {**ORT, "min_speedup": 1e6}):  # ONNX Runtime serves; eager kept, "nothing was faster"
        torch._dynamo.reset()
        pipe = _load(pipeline_folders["sd"])
        expected = run(pipe, "sd")
        registration = pipe.enable_aitune(STAGES, **config)
        for _ in range(2):
            run(pipe, "sd")
        assert registration.all_tuned, registration.report()
        plain = pipe.unet.forward
        pipe.unet.forward = torch.compile(plain, backend="eager")
        try:
            np.testing.assert_allclose(run(pipe, "sd"), expected, atol=2e-3)
        finally:
            pipe.unet.forward = plain
            del pipe.unet.__dict__["forward"]
        compiled = torch.compile(pipe.unet, backend="eager")
        latents = torch.randn(2, 4, 8, 8, generator=generator())
        text = torch.randn(2, 77, pipe.unet.config.cross_attention_dim, generator=generator())
        with torch.no_grad():
            got = compiled(latents, 10, encoder_hidden_states=text).sample
            with registration.bypass():
                want = pipe.unet(latents, 10, encoder_hidden_states=text).sample
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        pipe.disable_aitune()


def test_compile_repeated_blocks_after_enable_aitune(pipeline_folders) -> None:
    """Diffusers' regional compile of the transformer blocks inside tuned UNet stages: the compiled submodules are
    new state inside each stage (the guard sees it), so each call runs eager or re-tunes; never an error, always
    eager's output."""
    torch._dynamo.reset()
    pipe = _load(pipeline_folders["sd"])
    expected = run(pipe, "sd")
    registration = pipe.enable_aitune(STAGES, **ORT)
    for _ in range(2):
        run(pipe, "sd")
    assert registration.state_counts == {"tuned": 3}
    pipe.unet.compile_repeated_blocks(backend="eager")
    for _ in range(3):
        np.testing.assert_allclose(run(pipe, "sd"), expected, atol=2e-3)
    assert all(
        t.state in (TargetState.TUNED, TargetState.EAGER, TargetState.ARMED) for t in registration.targets.values()
    )
    pipe.disable_aitune()
    assert unpatched(pipe.unet.modules())


def test_train_runs_eager_with_eagers_random_stream_and_eval_serves_again() -> None:
    """Real MiniLM (dropout 0.1): after train(), a call with a fixed seed gives eager's output and leaves the random
    stream where eager's call does; nothing is recorded or tuned; after eval() the tuned layers serve again."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    batch = dict(tokenizer(["a cat sat on the mat", "dropout is live"], padding=True, return_tensors="pt"))
    model = AITuneModel.from_pretrained(minilm_path(), local_files_only=True).eval()
    registration = model.enable_aitune("blocks", **ORT)
    with torch.no_grad():
        model(**batch)
        model(**batch)
    assert registration.state_counts == {"tuned": 6}
    tuning = registration.report().tuning_seconds

    def seeded(bypass: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(11)
        with torch.no_grad():
            if bypass:
                with registration.bypass():
                    out = model(**batch).last_hidden_state
            else:
                out = model(**batch).last_hidden_state
        return out, torch.rand(4)

    model.train()
    for _ in range(2):
        (out, after), (ref, ref_after) = seeded(False), seeded(True)
        assert torch.equal(out, ref) and torch.equal(after, ref_after)
    assert registration.report().tuning_seconds == tuning
    assert all(not t.samples for t in registration.targets.values())
    model.eval()
    served = registration.targets["encoder.layer.0"].calls_served["onnxruntime"]
    (out, _), (ref, _) = seeded(False), seeded(True)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert registration.targets["encoder.layer.0"].calls_served["onnxruntime"] == served + 1
    model.disable_aitune()


def test_an_img2img_pipeline_tunes_the_vae_encoder_stages(pipeline_folders) -> None:
    pipe = StableDiffusionImg2ImgPipeline.from_pretrained(pipeline_folders["sd"])
    pipe.set_progress_bar_config(disable=True)
    names = [t.name for t in find_targets(pipe, "blocks") if t.name.startswith("vae.")]
    encoder = [n for n in names if n.startswith("vae.encoder.")]
    assert len(encoder) >= 2 and encoder[0] == "vae.encoder.down_blocks.0" and encoder[-1] == "vae.encoder.mid_block"
    image = torch.rand(1, 3, 64, 64, generator=generator())  # in [0, 1], as Diffusers takes image tensors
    kwargs = {**call_kwargs("sd"), "image": image, "strength": 0.75}
    kwargs.pop("height"), kwargs.pop("width")

    def img2img() -> np.ndarray:
        return pipe(**kwargs, generator=generator()).images

    expected = img2img()
    registration = enable_aitune(pipe, names, **ORT)  # the VAE's encoder and decoder stages
    outputs = [img2img() for _ in range(3)]
    assert registration.all_tuned and registration.state_counts == {"tuned": len(names)}, registration.report()
    for name in encoder:
        assert registration.targets[name].calls_served.get("onnxruntime", 0) >= 1, name
    for out in outputs:
        np.testing.assert_allclose(out, expected, atol=2e-3)
    pipe.disable_aitune()


def test_a_text_to_image_pipeline_leaves_the_encoder_stages_idle(pipeline_folders) -> None:
    pipe = _load(pipeline_folders["sd"])
    registration = pipe.enable_aitune(
        [t.name for t in find_targets(pipe, "blocks") if t.name.startswith("vae.")], **ORT
    )
    for _ in range(2):
        run(pipe, "sd")
    idle = [n for n, t in registration.targets.items() if t.idle]
    assert idle and all(n.startswith("vae.encoder.") for n in idle)
    assert registration.all_tuned, registration.report()  # the idle encoder stages are not waited for
    assert f"idle (never called, not waited for): {', '.join(idle)}" in str(registration.report())
    pipe.disable_aitune()
