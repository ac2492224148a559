"""Issue 9, item 6: one tiny model per family, tuned per block with ONNX Runtime through its whole calls.

For each of 17 families (Diffusers UNet, ControlNet, five DiTs / video transformers, the VAE alone; Transformers
encoders, decoder-only LMs, T5, Whisper) the model is built from a tiny config, saved, loaded back with its
class's real `from_pretrained` (`aitune_hf.testing.build_family` / `load_family`) and checked for:
- the targets are the family's repeated blocks (names written out here, not derived from the discovery code);
- three whole calls (`forward`, `vae.decode(z)` or `generate()`) each match eager: the first records and
  arms, the second tunes inside the call, the third is served;
- which targets are tuned and which stay eager, and that each eager one says why (the expected cause);
- `disable_aitune()` restores every module's forward, and the model then gives eager's output bit for bit.
One more test runs Llama's `generate()` with a static cache and Inductor: the decode steps are served compiled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from aitune_hf import TargetState, enable_aitune
from aitune_hf.testing import MODEL_FAMILIES, build_family, call_family, family_inputs, load_family
from tests.quick import ORT as QUICK_ORT

#: Exact shapes: each family's blocks exported at the shapes they are called with (a third of the time of a shape
#: family's dynamic export). The default path, shape families, is tested end to end on the SD pipeline (every block,
#: tests/hf/test_pipelines.py), on MiniLM and sentence-transformers (tests/hf/test_shapes.py) and in the core.
ORT: dict[str, Any] = {**QUICK_ORT, "repeats": 2}
TOL = {"atol": 1e-4, "rtol": 1e-4}  # fp32 tiny models: ONNX Runtime's kernels reorder sums, nothing more
CALLS = 3


def _n(pattern: str, n: int = 2) -> list[str]:
    return [pattern.format(i) for i in range(n)]


#: The targets of targets="blocks" per family, in order.
EXPECTED_TARGETS: dict[str, list[str]] = {
    "unet": ["down_blocks.0", "down_blocks.1", "mid_block", "up_blocks.0", "up_blocks.1"],
    "controlnet": ["down_blocks.0", "down_blocks.1", "mid_block"],  # no up_blocks: the UNet rule still applies
    "flux": _n("transformer_blocks.{}") + _n("single_transformer_blocks.{}"),
    "sd3": _n("transformer_blocks.{}"),
    "pixart": _n("transformer_blocks.{}"),  # PatchEmbed is in _no_split_modules too, but in no ModuleList
    "hunyuandit": _n("blocks.{}"),  # declares no blocks: the structural fallback
    "cogvideox": _n("transformer_blocks.{}"),
    "wan": _n("blocks.{}"),
    # encode() and decode() are its whole calls: the encoder's stages, then the decoder's (only decode() is called
    # here: the encoder stages stay idle)
    "vae": [*_n("encoder.down_blocks.{}"), "encoder.mid_block", "decoder.mid_block", *_n("decoder.up_blocks.{}")],
    "bert": _n("encoder.layer.{}"),
    "vit": _n("layers.{}"),  # Transformers 5's ViTModel holds its layers directly
    "clip_text": _n("encoder.layers.{}"),  # Transformers 5's CLIPTextModel has no text_model wrapper
    "llama": _n("model.layers.{}"),
    "qwen3": _n("model.layers.{}"),
    "gpt2": _n("transformer.h.{}"),
    "t5": _n("encoder.block.{}") + _n("decoder.block.{}"),
    "whisper": _n("model.encoder.layers.{}") + _n("model.decoder.layers.{}"),
}

#: Why the KV-cache blocks stay eager with ONNX Runtime: their calls carry a Cache object.
CACHE_REASON = "that this backend cannot take"

#: Targets that stay eager with ONNX Runtime, and a phrase their reason must contain; every other one is tuned.
EXPECTED_EAGER: dict[str, dict[str, str]] = {
    "llama": dict.fromkeys(_n("model.layers.{}"), CACHE_REASON),
    "qwen3": dict.fromkeys(_n("model.layers.{}"), CACHE_REASON),
    "gpt2": dict.fromkeys(_n("transformer.h.{}"), CACHE_REASON),
    "t5": dict.fromkeys(_n("decoder.block.{}"), CACHE_REASON),
    "whisper": dict.fromkeys(_n("model.decoder.layers.{}"), CACHE_REASON),
}


def test_every_family_has_its_expectations() -> None:
    assert len(MODEL_FAMILIES) >= 15
    assert set(EXPECTED_TARGETS) == set(MODEL_FAMILIES)
    with pytest.raises(ValueError, match="unknown model family 'mamba'"):
        family_inputs("mamba")


@pytest.fixture(scope="session")
def family_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family's folder, built once per session (before any test: the imports it makes add warnings
    filters, which a test must not do)."""
    return {name: build_family(name, tmp_path_factory.mktemp(f"family-{name}")) for name in MODEL_FAMILIES}


def instance_forwards(model: torch.nn.Module) -> dict[str, Any]:
    """Each module's instance-level `forward` (None where the class's is used)."""
    return {name: module.__dict__.get("forward") for name, module in model.named_modules()}


def assert_matches(name: str, out: Any, ref: Any, label: str) -> None:
    if MODEL_FAMILIES[name].call == "generate":
        (tokens, logits), (ref_tokens, ref_logits) = out, ref
        assert torch.equal(tokens, ref_tokens), f"{label}: tokens differ\n{tokens}\n{ref_tokens}"
        torch.testing.assert_close(logits, ref_logits, **TOL, msg=lambda m: f"{label}: logits: {m}")
    else:
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("name", list(MODEL_FAMILIES))
def test_family_blocks_tune_and_match_eager(name: str, family_folders) -> None:
    model = load_family(name, family_folders[name])
    eager = call_family(name, model, family_inputs(name))
    forwards = instance_forwards(model)
    reg = enable_aitune(model, "blocks", **ORT)
    try:
        assert list(reg.targets) == EXPECTED_TARGETS[name]
        for call in range(CALLS):
            out = call_family(name, model, family_inputs(name))
            assert_matches(name, out, eager, f"{name} call {call + 1}, states {reg.state_counts}")
            if call == 0:  # the first whole call records and arms; nothing is decided yet
                assert {t.state for t in reg.targets.values()} == {TargetState.ARMED}, reg.report()
        assert reg.all_tuned, reg.report()
        eager_expected = EXPECTED_EAGER.get(name, {})
        for target_name, target in reg.targets.items():
            label = f"{name}: {target_name}: {target.state.value}, reason {target.reason!r}"
            if name == "vae" and target_name.startswith("encoder."):
                assert target.idle, label  # never called: not waited for by all_tuned
            elif target_name in eager_expected:
                assert target.state is TargetState.EAGER, label
                assert target.reason and eager_expected[target_name] in target.reason, label
                assert "onnxruntime" not in target.calls_served, label
            else:
                assert target.state is TargetState.TUNED, f"{label}\n{reg.report()}"
                # the third call (at least) was served by the built engine
                assert target.calls_served.get("onnxruntime", 0) >= 1, f"{label}: {target.calls_served}"
    finally:
        model.disable_aitune()
    assert model.aitune.detached
    restored = instance_forwards(model)
    assert restored == forwards, [n for n in forwards if restored[n] is not forwards[n]]
    after = call_family(name, model, family_inputs(name))
    torch.testing.assert_close(after, eager, atol=0, rtol=0)  # eager again, bit for bit


@pytest.fixture
def fresh_dynamo() -> None:
    """Dynamo's cache as in a fresh process (see tests/hf/test_generate.py: Transformers 5's decoder layers share
    one code object, so earlier compiles could use up its recompile limit and leave these forwards uncompiled)."""
    torch._dynamo.reset()


def test_llama_static_cache_decode_steps_are_served_by_inductor(family_folders, fresh_dynamo) -> None:
    name = "llama"
    model = load_family(name, family_folders[name])
    inputs = {**family_inputs(name), "cache_implementation": "static"}
    eager = call_family(name, model, inputs)
    forwards = instance_forwards(model)
    frames = dict(counters["frames"])
    reg = enable_aitune(model, "blocks", **{**ORT, "backends": ["inductor"]})
    try:
        for call in range(CALLS):
            out = call_family(name, model, {**family_inputs(name), "cache_implementation": "static"})
            assert_matches(name, out, eager, f"{name} static cache, call {call + 1}, states {reg.state_counts}")
        assert reg.all_tuned, reg.report()
        for target_name, target in reg.targets.items():
            assert target.state is TargetState.TUNED, f"{target_name}: {target.reason}\n{reg.report()}"
            # the third generate(): one prefill and 3 decode steps per layer, all compiled
            assert target.calls_served.get("inductor", 0) >= len(eager[1]), (target_name, target.calls_served)
        # ... and compiled for real: every frame Dynamo saw was compiled (none fell back to eager at its recompile
        # limit, which the static cache's fixed shapes avoid; a DynamicCache grows each step and does hit it).
        seen = {key: counters["frames"][key] - frames.get(key, 0) for key in ("total", "ok")}
        assert seen["total"] >= 1 and seen["ok"] == seen["total"], seen
    finally:
        model.disable_aitune()
    assert instance_forwards(model) == forwards
