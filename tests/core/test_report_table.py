"""The report's table names every precision and kernel chosen (issue 32): the backend column is abbreviated where it
must be (`compact_backend`), never cut, so int8 and fused kernels stay apart in a target's row."""

from __future__ import annotations

import re

import pytest

from aitune_hf.backends.inductor import InductorBackend
from aitune_hf.backends.onnxruntime import OnnxRuntimeBackend
from aitune_hf.core.report import CandidateResult, ModuleReport, SignatureReport, TuningReport, compact_backend

BF16 = InductorBackend(freezing=True, precision="bf16")
INT8 = OnnxRuntimeBackend(precision="int8")
FUSED = OnnxRuntimeBackend(kernels="fused")


def _signature(text: str, backend, precision: str) -> SignatureReport:
    chosen = CandidateResult(backend.describe(), latency_s=0.001, max_abs_error=0.01, speedup=2.0, precision=precision)
    return SignatureReport(text, samples=1, chosen=chosen.backend, eager_latency_s=0.002, candidates=[chosen])


def _report() -> TuningReport:
    mixed = ModuleReport(
        "transformer.single_transformer_blocks.11",
        "FluxSingleTransformerBlock",
        "tuned",
        signatures=[
            _signature("(f32[1,64,32]) batch 1", BF16, "bf16"),
            _signature("(f32[8,64,32]) batch 8", INT8, "int8"),
            _signature("(f32[32,64,32]) batch 32", FUSED, "fp32"),
        ],
    )
    plain = ModuleReport("encoder.layer.0", "BertLayer", "tuned", signatures=[_signature("(f32[1,8])", INT8, "int8")])
    return TuningReport({mixed.name: mixed, plain.name: plain})


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


def test_a_target_row_names_every_precision_and_kernel_and_cuts_no_word() -> None:
    report = _report()
    full = report.modules["transformer.single_transformer_blocks.11"].backend
    assert len(full) > 60  # wider than a column: what used to be cut at 60 characters
    table = str(report).splitlines()
    row = next(line for line in table if line.startswith("transformer.single_transformer_blocks.11"))
    shown = compact_backend(full)
    assert shown == "inductor(freezing, bf16)+ort(fused)+ort(int8)" and f"  {shown}  " in row, row
    assert "bf16+fp32+int8" in row  # the precision column is whole too
    assert "…" not in row
    assert set(_words(shown)) <= set(_words(full)) | {"ort"}  # abbreviated, never a word cut in two
    for precision_or_kernel in ("bf16", "int8", "fused", "freezing"):
        assert precision_or_kernel in row
    # Each signature's row names its own decision, whole where it fits.
    assert any(f"  {BF16.describe()}  " in line for line in table)
    assert any(f"  {FUSED.describe()}  " in line for line in table)
    # A short backend text is left as it is, and the columns still line up under the header.
    plain = next(line for line in table if line.startswith("encoder.layer.0"))
    assert f"  {INT8.describe()}" in plain
    header = next(line for line in table if line.startswith("target "))
    assert header.index("precision") == row.index("bf16+fp32+int8") == plain.rindex("int8")


def test_compact_backend_keeps_every_option() -> None:
    assert compact_backend("eager") == "eager"
    assert compact_backend(INT8.describe()) == "onnxruntime(precision=int8)"  # fits: unchanged
    live, autotune = OnnxRuntimeBackend(weights="live", kernels="fused"), InductorBackend(mode="max-autotune")
    wide = f"{live.describe()}+{autotune.describe()}"
    assert compact_backend(wide, width=20) == "ort(weights=live, fused)+inductor(mode=max-autotune)"


def test_a_row_whose_calls_ran_eager_mostly_says_both_states_and_why() -> None:
    """Issue 46: a target tuned for one shape family whose calls ran eager most of the time (its other shapes) reads
    "tuned/eager" with the count, not "tuned"."""
    mostly_eager = ModuleReport("encoder.layer.0", "BertLayer", "tuned", signatures=[_signature("(f32[1,8])", INT8,
                                "int8")], calls={"eager": 70, INT8.describe(): 30})  # fmt: skip
    mostly_served = ModuleReport("encoder.layer.1", "BertLayer", "tuned", signatures=[_signature("(f32[1,8])", INT8,
                                 "int8")], calls={"eager": 3, INT8.describe(): 97})  # fmt: skip
    table = str(TuningReport({m.name: m for m in (mostly_eager, mostly_served)})).splitlines()
    first = next(line for line in table if line.startswith("encoder.layer.0"))
    second = next(line for line in table if line.startswith("encoder.layer.1"))
    assert "tuned/eager" in first and "eager served 70 of its 100 calls" in first, first
    assert "tuned/eager" not in second and "eager served" not in second, second


def test_a_target_row_weighs_each_signature_by_its_calls() -> None:
    # A generate(): one prefill (eager 2.6 ms, tuned 2.0 ms) and 31 decode steps (eager 1.6 ms, tuned 1.0 ms).
    def tuned(text: str, eager_s: float, tuned_s: float, calls: int) -> SignatureReport:
        chosen = CandidateResult("inductor", latency_s=tuned_s, speedup=eager_s / tuned_s)
        return SignatureReport(text, 1, "inductor", eager_latency_s=eager_s, candidates=[chosen], calls=calls)

    row = ModuleReport("model", "LlamaForCausalLM", "tuned", signatures=[
        tuned("prefill", 0.0026, 0.0020, 1), tuned("decode", 0.0016, 0.0010, 31)])  # fmt: skip
    assert row.eager_latency_s == pytest.approx((0.0026 + 31 * 0.0016) / 32)
    assert row.tuned_latency_s == pytest.approx((0.0020 + 31 * 0.0010) / 32)
    assert row.speedup == pytest.approx((0.0026 + 31 * 0.0016) / (0.0020 + 31 * 0.0010))  # 1.58x, near the steps'
    saved = TuningReport.from_dict(TuningReport({"model": row}).to_dict())  # the calls survive a saved report
    assert saved.modules["model"].speedup == pytest.approx(row.speedup)
    unknown = ModuleReport("model", "LlamaForCausalLM", "tuned", signatures=[
        tuned("prefill", 0.0026, 0.0020, 0), tuned("decode", 0.0016, 0.0010, 0)])  # fmt: skip
    assert unknown.speedup == pytest.approx(0.0042 / 0.0030)  # calls unknown (an old report): one each
