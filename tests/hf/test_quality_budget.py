"""A quality budget that cannot apply to what an object returns (PSNR on embeddings, cosine on images or logits) is a
`ConfigError` naming the output kind and the metrics that fit (issue 32): at `enable_aitune` where the object says
what it returns (`hf/outputs.py`), else at its first whole call, before any tuning; either way nothing stays
patched. Real models built locally: all-MiniLM-L6-v2 under sentence-transformers, a tiny SD pipeline, tiny
Transformers models."""

from __future__ import annotations

import pytest
import torch
import transformers

from aitune_hf import AITunePipeline, enable_aitune
from aitune_hf.core.quality import QualityFigure, measure, output_kind
from aitune_hf.errors import ConfigError
from aitune_hf.hf.outputs import output_kinds
from aitune_hf.testing import build_family, family_inputs, load_family, minilm_path
from tests.hf.conftest import run, unpatched
from tests.quick import QUICK


def _forwards(model: torch.nn.Module) -> dict[str, object]:
    """Each module's forward as its instance holds it (None where the class's forward serves)."""
    return {name: module.__dict__.get("forward") for name, module in model.named_modules()}


def test_psnr_on_a_sentence_transformer_is_refused_at_enable_and_nothing_is_patched() -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu")
    cls, forwards = type(model), _forwards(model)
    expected = model.encode(["a short query"], convert_to_tensor=True)
    with pytest.raises(ConfigError) as caught:
        enable_aitune(model, precision="auto", quality={"psnr": 40})
    message = str(caught.value)
    assert message.startswith("quality={'psnr': 40.0} cannot apply: this SentenceTransformer returns embeddings")
    assert "'psnr' is for images" in message and "metrics that fit: 'cosine'" in message, message
    assert type(model) is cls and _forwards(model) == forwards and unpatched(model.modules())
    torch.testing.assert_close(model.encode(["a short query"], convert_to_tensor=True), expected, atol=0, rtol=0)
    enable_aitune(model, precision="auto", quality={"cosine": 0.995}).detach()  # the metric that fits is taken


def test_cosine_on_an_image_pipeline_is_refused_at_enable(pipeline_folders) -> None:
    pipe = AITunePipeline.from_pretrained(pipeline_folders["sd"])
    pipe.set_progress_bar_config(disable=True)
    modules = [m for c in pipe.components.values() if isinstance(c, torch.nn.Module) for m in c.modules()]
    expected = r"this StableDiffusionPipeline returns images, and 'cosine' is for embeddings; metrics that fit: 'psnr' "
    with pytest.raises(ConfigError, match=expected + r"\(PSNR against fp32 eager, dB, default 35\)"):
        pipe.enable_aitune("blocks", quality={"cosine": 0.99, "psnr": 40})
    assert pipe.aitune is None and unpatched(modules)
    run(pipe, "sd")  # plain calls still work


def test_a_generative_model_takes_logits_and_tokens_budgets_only(tmp_path) -> None:
    model = load_family("gpt2", build_family("gpt2", tmp_path))
    assert output_kinds(model) == {"logits", "tokens"}
    with pytest.raises(ConfigError, match=r"this GPT2LMHeadModel returns logits or tokens, and 'psnr' is for images"):
        enable_aitune(model, quality={"tokens": 1.0, "psnr": 40})
    assert unpatched(model.modules())


def test_where_the_object_does_not_say_the_first_call_is_checked_before_any_tuning() -> None:
    """A classifier head (a Transformers model with neither generate() nor hidden states out): its kind is known only
    from its first call's output (`logits`). The error comes out of that call, with every forward restored and nothing
    armed or tuned; later calls are plain."""
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    assert output_kinds(model) is None
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    forwards = _forwards(model)
    registration = enable_aitune(model, **QUICK, precision="auto", quality={"cosine": 0.99}, backends=["onnxruntime"])
    with pytest.raises(ConfigError) as caught, torch.inference_mode():
        model(input_ids=ids)
    message = str(caught.value)
    assert "the first __call__() of this BertForSequenceClassification returns logits, and 'cosine' is for " in message
    assert "metrics that fit: 'argmax'" in message
    assert message.endswith("aitune is disabled here, every forward restored")
    assert registration.detached and model.aitune is registration
    assert _forwards(model) == forwards and unpatched(model.modules())
    report = registration.report()
    assert report.tuning_seconds == 0 and not any(t.armed or t.decided for t in registration.targets.values())
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=0, rtol=0)


def test_the_first_call_of_a_fitting_budget_passes_and_is_not_checked_again() -> None:
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=3)  # fmt: skip
    model = transformers.BertForSequenceClassification(config).eval()
    registration = enable_aitune(model, **QUICK, quality={"argmax": 1.0}, tune_after_calls=None)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(input_ids=ids)
    assert model.__dict__["_aitune_state"].kinds == {"logits"} and not registration.detached
    model.disable_aitune()


@pytest.mark.parametrize("family", ["bert", "clip_text", "gpt2"])
def test_what_an_object_says_it_returns_is_what_its_calls_return(family, tmp_path) -> None:
    """`output_kinds` (before a call) agrees with `output_kind` (of a call's output) on real models."""
    model = load_family(family, build_family(family, tmp_path))
    inputs = family_inputs(family)
    kinds = output_kinds(model)
    with torch.inference_mode():
        outputs = [model(**inputs), *([model.generate(**inputs, max_new_tokens=2)] if family == "gpt2" else [])]
    assert {output_kind(out) for out in outputs} == kinds


def test_a_budget_measure_cannot_apply_still_fails_safe_and_says_why() -> None:
    """The safety net behind the checks: an output of another kind than the budget's (a later call of an object that
    did not say what it returns) fails the gate, and the figure names the kind and the metric that would apply."""
    embeddings = torch.ones(2, 4)
    figure = measure(embeddings, embeddings, {"psnr": 40})
    assert figure == QualityFigure("psnr", figure.value, 40.0, False, "embeddings")
    assert figure.text() == "PSNR n/a dB (>= 40): psnr does not apply to embeddings, measured by 'cosine'"
