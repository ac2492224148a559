"""Issue 9 "Every model": the whole calls the mixin counts besides a pipeline's __call__.

A bare Transformers model's `generate()` is one whole call (each forward inside it is a step of it), so tuning
runs at the start of the next generate(), never between two steps of one; a VAE used alone tunes through
`decode()`; a VAE's forward (encode, then decode) is one call, not three; a Transformers pipeline's __call__ is
one call. Each test compares every call with eager made in the same state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from aitune_hf import AITuneModel, TargetState, enable_aitune
from aitune_hf.testing import LM_AUTO_CLASSES, build_lm

from .conftest import unpatched

QUICK: dict[str, Any] = {"min_speedup": 0, "progress": False, "warmup": 1, "repeats": 2, "anytime": False}
GREEDY: dict[str, Any] = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lm("llama", tmp_path_factory.mktemp("boundary-llama"))


def whole_calls(obj: Any) -> int:
    return obj.__dict__["_aitune_state"].calls


def test_generate_is_one_whole_call_and_tunes_prefill_and_decode_before_the_next(llama_folder) -> None:
    """With the static cache, the decode step has one signature and an Inductor build serves every step."""
    model = AITuneModel.from_pretrained(llama_folder, auto_class=LM_AUTO_CLASSES["llama"]).eval()
    registration = model.enable_aitune("blocks", backends=["inductor"], **QUICK)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    try:
        outputs = []
        for call in range(3):
            outputs.append(model.generate(input_ids=ids, cache_implementation="static", **GREEDY))
            assert whole_calls(model) == call + 1  # 5 forwards, 1 whole call
            if call == 0:  # recorded the prefill and the decode steps; nothing tuned inside the first call
                assert registration.state_counts == {"armed": 2}, registration.report()
        with registration.bypass():
            reference = model.generate(input_ids=ids, cache_implementation="static", **GREEDY)
        for out in outputs:
            assert torch.equal(out, reference)
        for name, target in registration.targets.items():
            assert target.state is TargetState.TUNED, (name, target.reason)
            signatures = target.report().signatures
            lengths = sorted(int(s.signature.split("x")[1]) for s in signatures)  # float32[1xSx32]: S tokens
            assert lengths == [1, 5], [s.signature for s in signatures]  # prefill and decode, both tuned
            assert all(s.chosen == "inductor" for s in signatures), registration.report()
            # The second and third calls: every forward (1 prefill + 4 decode steps) served by Inductor.
            assert target.calls_served.get("inductor", 0) == 2 * 5, target.calls_served
        assert registration.end_to_end is None  # only the first (cold) call ran before tuning: nothing to compare
        measured = model.measure_aitune(
            input_ids=ids, cache_implementation="static", method="generate", rounds=3, **GREEDY
        )
        assert measured["method"] == "interleaved generate() calls, 3 rounds, medians"
        assert whole_calls(model) == 3  # measuring makes plain calls, not whole calls to count
        with pytest.raises(ValueError, match=r"method must be one of __call__, generate, got 'decode'"):
            model.measure_aitune(input_ids=ids, method="decode")
    finally:
        model.disable_aitune()
    assert unpatched(model.modules())


@pytest.fixture(scope="module")
def vae_folder(pipeline_folders) -> Path:
    return pipeline_folders["sd"] / "vae"


def test_a_vae_alone_tunes_through_decode(vae_folder) -> None:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(vae_folder).eval()
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = vae.decode(latents).sample
    registration = enable_aitune(vae, "blocks", backends=["onnxruntime"], **QUICK)
    levels = len(vae.config.block_out_channels)
    encoder = [f"encoder.down_blocks.{i}" for i in range(levels)] + ["encoder.mid_block"]
    decoder = ["decoder.mid_block"] + [f"decoder.up_blocks.{i}" for i in range(levels)]
    assert list(registration.targets) == encoder + decoder
    try:
        with torch.no_grad():
            outputs = [vae.decode(latents).sample for _ in range(3)]  # records, tunes, served
        assert whole_calls(vae) == 3
        assert registration.all_tuned, registration.report()  # the encoder stages are idle: not waited for
        for name, target in registration.targets.items():
            if name in decoder:
                assert target.calls_served.get("onnxruntime", 0) >= 1, (name, target.calls_served)
            else:
                assert target.idle, (name, target.state, target.calls_served)
        for out in outputs:
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        # forward = encode + decode: one whole call, not three.
        image = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            vae(image, sample_posterior=False)
        assert whole_calls(vae) == 4
    finally:
        vae.disable_aitune()
    assert unpatched(vae.modules())
    assert isinstance(vae, AutoencoderKL) and vae.aitune.detached


def _word_tokenizer() -> Any:
    """A word-level tokenizer over the tiny LM's 128 ids (pad 0, eos 1, bos 2, words w3..w127)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2} | {f"w{i}": i for i in range(3, 128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def test_a_text_generation_pipeline_call_is_one_whole_call(llama_folder) -> None:
    import transformers

    model = getattr(transformers, LM_AUTO_CLASSES["llama"]).from_pretrained(llama_folder).eval()
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=_word_tokenizer())
    prompt = "w5 w17 w33 w4"
    expected = pipe(prompt, **GREEDY)
    registration = enable_aitune(pipe, "blocks", backends=["inductor"], **QUICK)
    assert list(registration.targets) == ["model.model.layers.0", "model.model.layers.1"]
    try:
        first = pipe(prompt, **GREEDY)
        assert whole_calls(pipe) == 1 and registration.state_counts == {"armed": 2}
        outputs = [first] + [pipe(prompt, **GREEDY) for _ in range(2)]
        assert registration.all_tuned, registration.report()
        assert all(t.calls_served.get("inductor", 0) >= 1 for t in registration.targets.values())
        for out in outputs:
            assert out == expected
    finally:
        pipe.disable_aitune()
    assert unpatched(model.modules())


def test_auto_tries_a_generative_model_whole_with_inductor(llama_folder) -> None:
    """Auto mode: a model that generates is tried whole with Inductor too (its calls hold the KV cache, which
    ONNX Runtime cannot take); the returned cache is checked by the tensors it holds."""
    model = AITuneModel.from_pretrained(llama_folder, auto_class=LM_AUTO_CLASSES["llama"]).eval()
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    static = {"cache_implementation": "static", **GREEDY}
    expected = model.generate(input_ids=ids, **static)
    registration = model.enable_aitune("auto", **QUICK)
    try:
        outputs = [model.generate(input_ids=ids, **static) for _ in range(3)]
        target = registration.targets["model"]
        assert target.state is TargetState.TUNED and not registration.descended, registration.report()
        assert target.report().backend == "inductor", registration.report()
        assert target.calls_served.get("inductor", 0) == 2 * GREEDY["max_new_tokens"], target.calls_served
        for out in outputs:
            assert torch.equal(out, expected)
    finally:
        model.disable_aitune()
    assert unpatched(model.modules())
