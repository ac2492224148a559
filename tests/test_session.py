"""aitune_hf.session: one tuning session on the real all-MiniLM-L6-v2 weights (ONNX Runtime only, few repeats)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# Imported at collection: its first import (scipy, through Transformers' losses) adds warnings filters, which a
# test that loads the first model would otherwise be blamed for.
pytest.importorskip("transformers.modeling_utils")
pytest.importorskip("onnxruntime")

from aitune_hf import AITuneModel, TuningReport, testing  # noqa: E402
from aitune_hf.session import SessionResult, compare, format_counts, run_session  # noqa: E402

QUICK = {"backends": ["onnxruntime"], "progress": False, "warmup": 1, "repeats": 3, "anytime": False}


def _minilm():
    """The model and one whole call of it on a fixed batch (random token ids), returning a numpy array."""
    model = AITuneModel.from_pretrained(testing.minilm_path(), local_files_only=True).eval()
    generator = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(1000, 29000, (2, 16), generator=generator),
        "attention_mask": torch.ones(2, 16, dtype=torch.long),
    }

    def run() -> np.ndarray:
        with torch.inference_mode():
            return model(**batch).last_hidden_state.numpy()

    return model, batch, run


@pytest.fixture(scope="module")
def session() -> tuple[SessionResult, list[str]]:
    """One whole session with a measurement; the tests only read it."""
    model, batch, run = _minilm()
    lines: list[str] = []
    result = run_session(model, run, "blocks", say=lines.append, rounds=2, call_kwargs=batch, **QUICK)
    yield result, lines
    model.disable_aitune()


def test_tuned_output_equals_eager_within_atol(session) -> None:
    result, _ = session
    assert result.passed
    assert result.atol == 1e-3  # float32
    assert result.eager_output.shape == result.tuned_output.shape == (2, 16, 384)
    diff = float(np.abs(result.tuned_output.astype(np.float64) - result.eager_output).max())
    assert result.max_abs_diff == diff <= result.atol


def test_fields_are_consistent(session) -> None:
    result, _ = session
    assert result.registration.all_tuned
    assert result.registration.state_counts.get("tuned", 0) + result.registration.state_counts.get("eager", 0) == 6
    assert result.registration.config.backends == ("onnxruntime",)
    assert 1 <= result.tuning_calls <= 3
    assert result.eager_call_seconds is not None and result.eager_call_seconds > 0
    parts = (result.enable_seconds, result.recording_call_seconds, result.tuning_call_seconds)
    assert all(seconds > 0 for seconds in parts)
    assert result.prepare_seconds >= sum(parts)
    assert result.prepare_seconds >= result.tuning_call_seconds
    assert result.tuned_call_seconds > 0
    assert isinstance(result.report, TuningReport) and set(result.report.modules) == set(result.registration.targets)
    assert result.end_to_end is not None and result.end_to_end["speedup"] > 0
    assert result.report.end_to_end is not None  # the report was taken after the measurement
    facts = json.loads(json.dumps(result.facts()))
    assert facts["prepare_seconds"] == result.prepare_seconds and facts["passed"] is True
    assert facts["targets"] == "blocks" and facts["tuning_calls"] == result.tuning_calls


def test_progress_lines(session) -> None:
    result, lines = session
    text = "\n".join(lines)
    assert lines[0].startswith("eager call (fixed inputs): ")
    assert "enable_aitune(targets='blocks', backends=['onnxruntime']): 6 target(s)" in text
    assert "  encoder.layer.0 (BertLayer)" in lines
    assert "recording call: " in text and "tuning call: " in text and "tuned call (fixed inputs): " in text
    assert f"states: {format_counts(result.registration.state_counts)}" in text
    assert "measuring: measure_aitune(rounds=2)" in text


def test_reference_skips_the_eager_call_and_manual_arming_tunes(tmp_path) -> None:
    model, _, run = _minilm()
    reference = run()
    calls = []

    def counted() -> np.ndarray:
        calls.append(1)
        return run()

    try:
        result = run_session(
            model,
            counted,
            ["encoder.layer.0"],
            reference=reference,
            tune_after_calls=None,
            cache_dir=str(tmp_path / "cache"),
            **QUICK,
        )
        assert result.registration.all_tuned  # the session armed it (tune()), as tune_after_calls=None asks
    finally:
        model.disable_aitune()
    assert result.eager_call_seconds is None and result.eager_output is reference
    assert len(calls) == 1 + result.tuning_calls + 1  # recording, tuning, tuned: no eager call
    assert result.passed
    assert str(result.registration.config.cache_dir) == str(tmp_path / "cache")
    assert result.end_to_end is None  # no rounds asked


def test_compare() -> None:
    a = np.zeros((2, 3), dtype=np.float32)
    assert compare(a, a + 5e-4) == (pytest.approx(5e-4), 1e-3, True)
    assert compare(a, a + 2e-3)[2] is False
    assert compare(a, np.zeros((3, 2), dtype=np.float32)) == (float("inf"), 0.0, False)
    assert compare(a.astype(np.float64), a.astype(np.float64) + 1e-5)[1:] == (1e-6, False)
    assert compare(np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.float32)) == (0.0, 1e-3, True)
