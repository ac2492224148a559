"""Reduced precision end to end (issue 19) on real models: `precision="auto"` tunes what this machine computes
natively, and the whole call that tuned, replayed, must pass its quality budget against fp32 eager before a
reduced-precision block serves; a budget nothing meets leaves fp32. Skipped, with the reason, on a host that computes
no reduced precision natively (an AVX2-only CPU): there "auto" offers nothing but fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aitune_hf import AITunePipeline, TargetState, enable_aitune, hardware
from aitune_hf.core.quality import measure
from aitune_hf.session import run_session
from aitune_hf.testing import build_family, call_family, family_inputs, load_family
from tests.hf.conftest import call_kwargs, generator, run
from tests.quick import QUICK

NATIVE = [p for p, reason in (("bf16", hardware.cpu_bf16_reason()), ("int8", hardware.cpu_int8_reason())) if not reason]
needs_reduced = pytest.mark.skipif(
    not NATIVE, reason=f"this CPU computes no reduced precision natively: {hardware.cpu_int8_reason()}"
)
needs_int8 = pytest.mark.skipif(hardware.cpu_int8_reason() is not None, reason=str(hardware.cpu_int8_reason()))


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory: pytest.TempPathFactory):
    """Built before any test of the module (the imports it makes add warnings filters, which a test must not do)."""
    return build_family("bert", tmp_path_factory.mktemp("bert"))


@needs_reduced
def test_auto_tries_what_this_machine_computes_and_gates_what_wins(bert_folder) -> None:
    """`precision="auto"`: the native reduced-precision variants are candidates beside fp32; whichever wins, every
    call's output is within the cosine budget, and a reduced-precision winner served only after the gate."""
    model = load_family("bert", bert_folder)
    inputs = family_inputs("bert")
    eager = call_family("bert", model, inputs)
    registration = enable_aitune(model, "blocks", **QUICK, precision="auto", backends=["onnxruntime", "inductor"])
    outputs = [call_family("bert", model, inputs) for _ in range(3)]  # records, tunes (and gates), served
    assert registration.all_tuned, registration.report()
    tried = {c.precision for s in registration.targets["encoder.layer.0"].report().signatures for c in s.candidates}
    assert set(NATIVE) <= tried, registration.report()
    reduced = [t for t in registration.targets.values() if t.report().precision != "fp32"]
    if reduced:  # a reduced-precision block serves only after the gate passed
        assert registration.quality is not None and registration.quality["passed"], registration.report()
    for out in outputs:
        assert measure(eager, out).passed  # min per-row cosine >= 0.99 against fp32 eager
    model.disable_aitune()


@needs_reduced
def test_a_reduced_precision_winner_serves_only_after_the_gate(bert_folder) -> None:
    """Only the reduced precision as candidate (so it wins): the call that tunes is served by eager for those blocks,
    the gate replays it, and then the block serves in that precision, or goes back to eager with the figure."""
    precision = NATIVE[0]  # bf16 where native, else int8
    model = load_family("bert", bert_folder)
    inputs = family_inputs("bert")
    eager = call_family("bert", model, inputs)
    backend = "inductor" if precision == "bf16" else "onnxruntime"
    registration = enable_aitune(model, "blocks", **QUICK, precision=[precision], backends=[backend], min_speedup=0)
    call_family("bert", model, inputs)  # records
    tuning = call_family("bert", model, inputs)  # tunes: reduced decisions wait, eager serves them, then the gate
    torch.testing.assert_close(tuning, eager, atol=0, rtol=0)  # nothing reduced served the call that tuned
    assert registration.quality is not None and registration.quality["replays"] >= 1, registration.report()
    served = call_family("bert", model, inputs)
    passed = registration.quality["passed"]
    for target in registration.targets.values():
        report = target.report()
        assert report.precision == (precision if passed else "fp32"), registration.report()
    if passed:
        assert measure(eager, served).passed and "quality: min cosine" in str(registration.report())
    else:
        torch.testing.assert_close(served, eager, atol=0, rtol=0)
    model.disable_aitune()


@needs_int8
def test_a_budget_no_reduced_candidate_meets_leaves_fp32_and_the_report_says_why(bert_folder) -> None:
    model = load_family("bert", bert_folder)
    inputs = family_inputs("bert")
    eager = call_family("bert", model, inputs)
    registration = enable_aitune(
        model, "blocks", **QUICK, precision=["int8"], backends=["onnxruntime"], quality={"cosine": 1.0}, min_speedup=0
    )  # only int8 candidates: it is chosen, and nothing reduced is ever exactly eager
    outputs = [call_family("bert", model, inputs) for _ in range(2)]  # records, tunes + gate
    # The call that tuned ends with every block decided: those the gate sent back tuned in fp32 in its replays (none
    # left armed for a later request to tune: docs/serving.md's warm-up asserts all_tuned).
    assert registration.all_tuned and set(registration.state_counts) == {"eager"}, registration.state_counts
    outputs += [call_family("bert", model, inputs) for _ in range(2)]
    assert registration.quality is not None and not registration.quality["passed"], registration.report()
    assert sorted(registration.quality["demoted"]) == sorted(registration.targets)
    for target in registration.targets.values():  # fp32 decisions: no fp32 candidate was asked for, so eager
        assert target.state is TargetState.EAGER and target.report().precision == "fp32", registration.report()
    for out in outputs:
        torch.testing.assert_close(out, eager, atol=0, rtol=0)  # nothing reduced ever served
    text = str(registration.report())
    assert "(needs >= 1)" in text and "sent back to fp32 by the end-to-end quality gate" in text
    model.disable_aitune()


@needs_int8
def test_an_sd_pipeline_gates_int8_stages_on_the_psnr_of_its_images(pipeline_folders) -> None:
    pipe = AITunePipeline.from_pretrained(pipeline_folders["sd"])
    pipe.set_progress_bar_config(disable=True)
    expected = run(pipe, "sd")
    stages = ["unet.mid_block", "unet.up_blocks.1"]
    # Through the session the CLI and the notebooks run: its figure for a pipeline's images is a PSNR too.
    session = run_session(pipe, lambda: run(pipe, "sd"), stages, **QUICK, precision=["int8"], rounds=0,
                          backends=["onnxruntime"], shapes="exact", min_speedup=0)  # fmt: skip
    registration = session.registration
    assert session.quality.startswith("PSNR") and session.passed, session.quality
    outputs = [session.tuned_output, *(run(pipe, "sd") for _ in range(2))]
    assert registration.all_tuned and registration.quality is not None, registration.report()
    assert registration.quality["metric"] == "psnr" and registration.quality["kind"] == "images"
    for out in outputs:
        psnr = measure(type("Out", (), {"images": expected})(), type("Out", (), {"images": out})())
        assert psnr.passed, psnr.text()  # every call, the tuning one included, is within the budget
    kwargs = {**call_kwargs("sd"), "generator": generator()}
    with registration.bypass():
        np.testing.assert_array_equal(pipe(**kwargs).images, expected)  # bypass is eager, untouched
    pipe.disable_aitune()
