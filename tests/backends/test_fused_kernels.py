"""ONNX Runtime's fused kernels (issue 19): `OnnxRuntimeBackend(kernels="fused")` rewrites the fp32 export with
onnxscript's ONNX Runtime fusions (attention into `com.microsoft` MultiHeadAttention, SkipLayerNormalization, BiasGelu)
before the session is made; it equals eager within fp32 tolerances, reuses the fp32 export of the same tuning, runs in
the build process too, is unavailable (no session) where nothing fuses, and `precision="auto"` offers it. Real torch,
Transformers, Diffusers and ONNX Runtime: tiny configs, a few exact shapes."""

from __future__ import annotations

import importlib

import pytest
import torch
from diffusers.models import Transformer2DModel  # imported here: importing them adds warnings filters
from diffusers.models.attention import BasicTransformerBlock
from torch import nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from aitune_hf import TuningConfig, register
from aitune_hf.backends import OnnxRuntimeBackend
from aitune_hf.backends.base import build_context, build_process_pid
from aitune_hf.backends.onnxruntime import _FUSION_STEPS, NOTHING_TO_FUSE
from aitune_hf.core.precision import with_precisions
from aitune_hf.errors import CandidateUnavailable, ConfigError
from tests.backends.test_onnxruntime import ConvNet
from tests.quick import ORT, QUICK

CPU = frozenset({torch.device("cpu")})
FP32 = {"atol": 1e-5, "rtol": 1e-4}  # fp32 tolerances: the fused kernels sum in another order than eager


class BertBlock(nn.Module):
    """One tiny BertLayer (SDPA attention) called as the encoder calls it: hidden states and an additive mask."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = BertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, attn_implementation="sdpa")
        self.layer = BertLayer(config)
        self.eval()

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden, attention_mask=mask)[0]


class BooleanMaskAttention(nn.Module):
    """Attention with a boolean mask, as BERT's padding and CLIP's causal mask reach `scaled_dot_product_attention`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)
        self.eval()

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = hidden.shape
        q, k, v = self.qkv(hidden).view(batch, tokens, 3, 2, 16).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(attended.transpose(1, 2).reshape(batch, tokens, 32))


def _masked_call(batch: int, tokens: int, masked_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones(batch, 1, tokens, tokens, dtype=torch.bool)
    mask[0, ..., tokens - 2 :] = False  # the first sequence's last two tokens are padding
    if masked_row:
        mask[-1, :, 1, :] = False  # a query that sees no key: torch gives zeros there
    return torch.randn(batch, tokens, 32), mask


def _bert_call(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.zeros(batch, 1, 1, length)
    mask[0, ..., length - 1 :] = torch.finfo(torch.float32).min  # the first row's last token is padding
    return torch.randn(batch, length, 32), mask


def _build(module: nn.Module, calls: list[tuple], dynamic: bool = False, **options: str):
    backend = OnnxRuntimeBackend(intra_op_num_threads=1, **options)
    with torch.no_grad():
        samples = [(call, {}) for call in calls]
        if dynamic:
            return backend.build(module, module.forward, samples, dynamic=True)
        return backend.build(module, module.forward, samples)


def test_the_upstream_fusion_steps_are_where_the_backend_finds_them() -> None:
    """`_fuse` uses a private onnxscript module (`ort_fusions._core`): this fails when it moves."""
    for module, attribute in _FUSION_STEPS:
        assert hasattr(importlib.import_module(module), attribute), f"{module}.{attribute} is gone"


def test_kernels_option_is_checked_named_and_carried_to_variants() -> None:
    with pytest.raises(ConfigError, match=r"kernels='flash' is not valid; valid values: 'default', 'fused'"):
        OnnxRuntimeBackend(kernels="flash")
    fused = OnnxRuntimeBackend(kernels="fused")
    assert fused.describe() == "onnxruntime(kernels=fused)" and OnnxRuntimeBackend().describe() == "onnxruntime"
    assert fused.with_precision("int8").describe() == "onnxruntime(precision=int8, kernels=fused)"
    assert [b.describe() for b in OnnxRuntimeBackend(arena="off").kernel_variants()] == [
        "onnxruntime(arena=off, kernels=fused)"
    ]
    assert fused.kernel_variants() == []
    assert "onnxscript" in OnnxRuntimeBackend.versions()  # the rewrite's package is part of every cache key


def test_a_bert_layer_fuses_into_multi_head_attention_and_equals_eager_over_a_shape_family() -> None:
    module = BertBlock()
    torch.manual_seed(1)
    built = _build(module, [_bert_call(2, 8), _bert_call(3, 12)], dynamic=True, kernels="fused")
    kernels = built.fn.kernels
    assert kernels["MultiHeadAttention"] == 1 and kernels["SkipLayerNormalization"] >= 1, kernels
    assert built.dynamic_dims is not None and {0, 1} <= built.dynamic_dims[0]
    with torch.no_grad():
        for batch, length in [(2, 8), (3, 12), (1, 5), (4, 16), (2, 31)]:  # shapes of the family never built for
            hidden, mask = _bert_call(batch, length)
            torch.testing.assert_close(built.fn(hidden, mask), module(hidden, mask), **FP32)


@pytest.mark.parametrize("kernels", ["default", "fused"])
def test_a_query_that_sees_no_key_gets_zeros_as_in_torch_and_the_attention_still_fuses(kernels: str) -> None:
    """The exporter's boolean-mask attention adds the dtype's lowest value, not -inf, so its NaN guard never fired and
    a query that sees no key (a left-padded causal batch's pad positions) came out as about the mean of the values
    (0.21 off) in every runtime reading the export. The export corrects it (`zero_rows_that_see_no_key`): that row is
    zeros before the output projection, as in torch, over a shape family; the fused build still fuses the attention."""
    module = BooleanMaskAttention()
    built = _build(module, [_masked_call(2, 8, False), _masked_call(3, 13, True)], dynamic=True, kernels=kernels)
    if kernels == "fused":
        assert built.fn.kernels["MultiHeadAttention"] == 1, built.fn.kernels
    for batch, tokens, masked_row in [(3, 13, True), (2, 40, True), (4, 5, False)]:
        call = _masked_call(batch, tokens, masked_row)
        with torch.no_grad():
            got, expected = built.fn(*call), module(*call)
        torch.testing.assert_close(got, expected, **FP32)
        if masked_row:  # zeros attended: the output projection's bias alone
            torch.testing.assert_close(got[-1, 1], module.out.bias, **FP32)


def test_the_fused_variant_reuses_the_fp32_export_of_the_same_tuning_and_leaves_it_as_it_was() -> None:
    module = BertBlock()
    torch.manual_seed(1)
    call = _bert_call(2, 8)
    shared: dict[object, object] = {}
    with build_context(shared=shared):
        plain = _build(module, [call])
        (export,) = (value for key, value in shared.items() if key[0] == "onnx_export")  # beside it: its trace
        before = export.SerializeToString()
        fused = _build(module, [call], kernels="fused")
    assert plain.fn.source == "export" and plain.fn.kernels is None
    assert fused.fn.source != "export" and fused.fn.kernels["MultiHeadAttention"] == 1  # no second export
    assert export.SerializeToString() == before  # the rewrite works on its own copy
    with torch.no_grad():
        torch.testing.assert_close(fused.fn(*call), module(*call), **FP32)


def test_a_warm_cache_serves_the_fused_model_it_wrote(tmp_path) -> None:
    """A decision for the fused variant read back from the cache loads the fused model the first tuning wrote."""
    call = _bert_call(2, 8)
    config = {**ORT, "backends": [OnnxRuntimeBackend(kernels="fused")], "cache_dir": str(tmp_path)}
    for expected_source in ("export", "cache"):
        module = BertBlock()
        registration = register({"block": module}, config)
        with torch.no_grad():
            reference = module(*call)
            registration.tune()
            module(*call)
            served = module(*call)
        target = registration.targets["block"]
        assert target.report().backend == "onnxruntime(kernels=fused)", registration.report()
        assert target.calls_served["onnxruntime(kernels=fused)"] >= 1
        assert (target.report().signatures[0].from_cache is not None) == (expected_source == "cache")
        torch.testing.assert_close(served, reference, **FP32)
        registration.detach()


def test_where_nothing_fuses_the_variant_is_unavailable_before_any_session() -> None:
    torch.manual_seed(0)
    with pytest.raises(CandidateUnavailable, match=NOTHING_TO_FUSE):
        _build(ConvNet().eval(), [(torch.randn(1, 3, 8, 8),)], kernels="fused")


def test_a_diffusers_transformer_block_fuses_and_equals_eager() -> None:
    """Diffusers' BasicTransformerBlock (self- and cross-attention, GEGLU feed-forward), as the SD UNet holds it."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.block = BasicTransformerBlock(16, 2, 8, cross_attention_dim=24).eval()

        def forward(self, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
            return self.block(hidden, encoder_hidden_states=context)

    module = Block().eval()
    torch.manual_seed(1)
    call = (torch.randn(2, 16, 16), torch.randn(2, 7, 24))
    built = _build(module, [call], kernels="fused")
    assert built.fn.kernels["MultiHeadAttention"] == 2, built.fn.kernels  # self- and cross-attention
    with torch.no_grad():
        for hidden, context in [call, (torch.randn(2, 16, 16), torch.randn(2, 7, 24))]:
            torch.testing.assert_close(built.fn(hidden, context), module(hidden, context), **FP32)


def test_a_unet_attention_block_with_group_norm_fuses_and_runs_on_cpu() -> None:
    """Diffusers' Transformer2DModel (GroupNorm, then transformer blocks), as the SD UNet holds it: onnxscript's full
    ORT rewrite would turn its GroupNorm into `com.microsoft` GroupNorm, which ONNX Runtime runs on CUDA only; the
    fused variant leaves it out, so the CPU session is made."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.block = Transformer2DModel(2, 4, in_channels=8, norm_num_groups=4, cross_attention_dim=16)

        def forward(self, sample: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
            return self.block(sample, encoder_hidden_states=context, return_dict=False)[0]

    module = Block().eval()
    torch.manual_seed(1)
    call = (torch.randn(2, 8, 8, 8), torch.randn(2, 7, 16))
    built = _build(module, [call], kernels="fused")
    assert built.fn.kernels["MultiHeadAttention"] == 2 and "GroupNorm" not in built.fn.kernels, built.fn.kernels
    with torch.no_grad():
        torch.testing.assert_close(built.fn(*call), module(*call), **FP32)


def test_fused_then_int8_quantizes_the_remaining_matmuls() -> None:
    module = BertBlock()
    torch.manual_seed(1)
    call = _bert_call(2, 8)
    built = _build(module, [call], kernels="fused", precision="int8")
    assert built.fn.kernels["MultiHeadAttention"] == 1
    with torch.no_grad():
        expected, got = module(*call), built.fn(*call)
    assert (got - expected).norm() / expected.norm() < 0.1  # int8's per-block budget


def test_the_build_process_fuses_too_and_reports_a_block_where_nothing_fuses() -> None:
    module = BertBlock()
    torch.manual_seed(1)
    call = _bert_call(2, 8)
    with build_context(private_only=True, shared={}):
        built = _build(module, [call], kernels="fused")
        worker = build_process_pid()
        assert worker is not None and built.fn.built_in == worker
        assert built.fn.kernels["MultiHeadAttention"] == 1
        with pytest.raises(CandidateUnavailable, match=NOTHING_TO_FUSE):
            _build(ConvNet().eval(), [(torch.randn(1, 3, 8, 8),)], kernels="fused")
    with torch.no_grad():
        torch.testing.assert_close(built.fn(*call), module(*call), **FP32)


def test_auto_offers_the_fused_variant_beside_plain_fp32_and_a_list_of_precisions_does_not() -> None:
    auto = TuningConfig(backends=["onnxruntime"], precision="auto")
    offered = [b.describe() for b in with_precisions(auto.resolve_backends(), auto, CPU)[0]]
    assert offered[:2] == ["onnxruntime", "onnxruntime(kernels=fused)"]
    listed = TuningConfig(backends=["onnxruntime"], precision=["fp32", "int8"])
    assert "onnxruntime(kernels=fused)" not in [b.describe() for b in with_precisions(listed.resolve_backends(),
                                                                                      listed, CPU)[0]]  # fmt: skip
    given = TuningConfig(backends=["onnxruntime", OnnxRuntimeBackend(kernels="fused")], precision="auto")
    offered = [b.describe() for b in with_precisions(given.resolve_backends(), given, CPU)[0]]
    assert offered.count("onnxruntime(kernels=fused)") == 1  # given and offered: tried once


def test_auto_times_the_fused_variant_side_by_side_and_skips_it_where_nothing_fuses() -> None:
    attention, conv = BertBlock(), ConvNet().eval()
    torch.manual_seed(1)
    call, image = _bert_call(2, 8), torch.randn(1, 3, 8, 8)
    registration = register({"attention": attention, "conv": conv}, {**ORT, "precision": "auto"})
    with torch.no_grad():
        attention(*call), conv(image)
        registration.tune()
        attention(*call), conv(image)
    rows = {name: t.report().signatures[0] for name, t in registration.targets.items()}
    candidates = {c.backend: c for c in rows["attention"].candidates}
    fused = candidates["onnxruntime(kernels=fused)"]
    assert fused.error is None and fused.precision == "fp32" and fused.latency_s is not None, registration.report()
    assert fused.max_abs_error < 1e-4 and candidates["onnxruntime"].latency_s is not None  # timed side by side
    skipped = {c.backend: c for c in rows["conv"].candidates}["onnxruntime(kernels=fused)"]
    assert skipped.skipped_for == "unavailable" and skipped.error == f"unavailable: {NOTHING_TO_FUSE}"
    registration.detach()


def test_the_default_precision_offers_no_fused_variant() -> None:
    config = TuningConfig(**{k: v for k, v in QUICK.items()}, backends=["onnxruntime"])
    assert [b.describe() for b in with_precisions(config.resolve_backends(), config, CPU)[0]] == ["onnxruntime"]
