"""Transformers: real all-MiniLM-L6-v2 weights via AutoModel and via transformers.pipeline."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import AutoModel, AutoTokenizer, BertModel

from aitune_hf import AITuneModel, AITunePipeline, TargetState, enable_aitune
from aitune_hf.errors import ConfigError
from aitune_hf.testing import minilm_path
from aitune_hf.testing.families import build_family, family_inputs
from tests.hf.conftest import unpatched
from tests.quick import ORT


@pytest.fixture(scope="module")
def batch():
    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    return dict(tokenizer(["a cat sat on the mat", "aitune makes blocks faster"], padding=True, return_tensors="pt"))


@pytest.fixture(scope="module")
def tuned_minilm(batch):
    # Eager attention: SDPA returns no attention weights, and the attentions test needs them.
    model = AITuneModel.from_pretrained(minilm_path(), local_files_only=True, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = model(**batch, output_hidden_states=True, output_attentions=True)
    assert len(expected.attentions) == 6
    registration = model.enable_aitune("blocks", **ORT)
    with torch.no_grad():
        model(**batch)  # records
        model(**batch)  # tunes
    yield model, registration, expected
    model.disable_aitune()


def test_auto_model_is_the_concrete_class(tuned_minilm) -> None:
    model, registration, _ = tuned_minilm
    assert isinstance(model, BertModel) and type(model).__name__ == "BertModel"
    assert list(registration.modules) == [f"encoder.layer.{i}" for i in range(6)]
    assert registration.state_counts == {"tuned": 6}, registration.report()


def test_tuned_outputs_and_hidden_states_match_eager(tuned_minilm, batch) -> None:
    model, registration, expected = tuned_minilm
    layer = registration.targets["encoder.layer.3"]
    with torch.no_grad():
        plain = model(**batch)
        # Transformers passes output_hidden_states=True down to each layer: a new signature, served eager
        # and recorded, then covered by the next tune().
        first = model(**batch, output_hidden_states=True)
        registration.tune()
        model(**batch, output_hidden_states=True)
        served = layer.calls_served["onnxruntime"]
        tuned = model(**batch, output_hidden_states=True)
    assert layer.calls_served["onnxruntime"] == served + 1 and len(layer.report().signatures) == 2
    torch.testing.assert_close(plain.last_hidden_state, expected.last_hidden_state, atol=1e-4, rtol=1e-4)
    for out in (first, tuned):
        assert len(out.hidden_states) == len(expected.hidden_states) == 7
        for got, want in zip(out.hidden_states, expected.hidden_states, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_attentions_are_captured_by_running_blocks_eager(tuned_minilm, batch) -> None:
    model, registration, expected = tuned_minilm
    served = dict(registration.targets["encoder.layer.0"].calls_served)
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    assert len(out.attentions) == 6
    for got, want in zip(out.attentions, expected.attentions, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert registration.targets["encoder.layer.0"].calls_served == served  # bypassed, nothing recorded


def test_save_pretrained_reloads_with_plain_transformers(tuned_minilm, batch, tmp_path) -> None:
    model, _, expected = tuned_minilm
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["BertModel"]
    reloaded = AutoModel.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(reloaded) is BertModel
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).last_hidden_state, expected.last_hidden_state)


def test_aitune_pipeline_routes_a_transformers_folder_to_auto_model() -> None:
    model = AITunePipeline.from_pretrained(minilm_path(), local_files_only=True, aitune={"backends": []})
    assert isinstance(model, BertModel) and model.aitune is not None
    assert all(t.state is TargetState.RECORDING for t in model.aitune.targets.values())
    model.disable_aitune()
    with pytest.raises(ValueError, match="unknown Transformers auto class"):
        AITuneModel.from_pretrained(minilm_path(), auto_class="AutoModelForEverything")


def test_transformers_pipeline_object() -> None:
    path = str(minilm_path())
    pipe = transformers.pipeline("feature-extraction", model=path, tokenizer=path, framework="pt")
    sentences = ["the quick brown fox", "jumps over the lazy dog"]
    expected = pipe(sentences)
    registration = enable_aitune(pipe, "blocks", **ORT)
    assert list(registration.modules) == [f"model.encoder.layer.{i}" for i in range(6)]
    first, second, third = pipe(sentences), pipe(sentences), pipe(sentences)
    assert registration.all_tuned and registration.state_counts == {"tuned": 6}
    for out in (first, second, third):
        for got, want in zip(out, expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
    pipe.disable_aitune()
    assert unpatched(pipe.model.modules())


def test_compare_whole_measures_the_model_against_its_blocks_and_serves_the_blocks(tmp_path) -> None:
    """`targets="blocks", compare_whole=True`: the layers serve; the model is measured whole (ONNX Runtime, on the
    worker) against its layers as they serve, once they serve a call, and the report says which was faster. The whole
    never serves; every call equals eager. (A tiny BERT through its real from_pretrained: a whole MiniLM's export
    took 7 s of the suite.)"""
    model = AITuneModel.from_pretrained(build_family("bert", tmp_path / "bert")).eval()
    batch = family_inputs("bert")
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
    with pytest.raises(ConfigError, match="compare_whole=True measures components against their blocks"):
        model.enable_aitune("auto", compare_whole=True)
    assert unpatched(model.modules())
    registration = model.enable_aitune("blocks", compare_whole=True, **{**ORT, "min_speedup": 1.05})
    layers = [name for name in registration.targets if name != "model"]
    assert next(iter(registration.targets)) == "model" and layers
    assert all(name.startswith("encoder.layer.") for name in layers)
    outputs = []
    with torch.no_grad():
        for _ in range(4):  # records; the layers tune; they serve, the model records; the model is measured
            outputs.append(model(**batch).last_hidden_state)
        registration.wait()
        outputs.append(model(**batch).last_hidden_state)
    whole = registration.targets["model"]
    assert whole.decided and set(whole.calls_served) == {"eager"}, registration.report()
    assert all(registration.targets[name].calls_served.get("onnxruntime") for name in layers)
    [signature] = whole.report().signatures
    [candidate] = [c for c in signature.candidates if c.backend == "onnxruntime"]
    assert candidate.speedup is not None and candidate.rounds  # timed against the layers as they serve
    text = str(registration.report())
    line = "whole would be faster: model (BertModel)" if signature.measured_whole else "blocks are faster: model"
    assert line in text, text
    for out in outputs:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    model.disable_aitune()
    assert unpatched(model.modules())
