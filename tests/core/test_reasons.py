"""Reasons a user can act on: a failing candidate's error summarised as its cause, the full text kept."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from aitune_hf import OneBackend, TuningConfig, TuningReport, register
from aitune_hf.backends.base import Backend, BuiltBackend, Call
from aitune_hf.cli import details as cli_details
from aitune_hf.core.reasons import MAX_SUMMARY, chain, details, summarize
from tests.core.modules import MLPBlock

try:  # imported here, not in the test: its imports add warnings filters, which a test must not leave changed
    from diffusers import Lumina2Transformer2DModel
except ImportError:  # diffusers is an extra
    Lumina2Transformer2DModel = None

QUICK = {"progress": False, "warmup": 1, "repeats": 1, "anytime": False}

# What torch.onnx (2.13) raises for a complex input, in miniature: advice first, in terminal colours, with the
# cause further down and in the chained exceptions.
ADVICE = (
    "Failed to convert the exported program to an ONNX model. \x1b[96mThis is step 3/3\x1b[0m of exporting the "
    "model to ONNX. Next steps:\n"
    "- If there is a missing ONNX function, implement it and register it to the registry.\n"
    "- If there is an internal error during ONNX conversion, debug the error and submit a PR to PyTorch.\n"
    "- Create an error report with `torch.onnx.export(..., report=True)`, and save the ExportedProgram as a pt2 "
    "file.\n\n## Exception summary\n\n"
    "<class 'torch.onnx._internal.exporter._errors.DispatchError'>: No ONNX function found for "
    "<OpOverload(op='aten.unsqueeze', overload='default')>. Failure message: No decompositions registered for "
    "the complex-valued input\n⬆️\n"
    "<class 'torch.onnx._internal.exporter._errors.ConversionError'>: Error when translating node %unsqueeze_1 : "
    "[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%tensors_1, 2), kwargs = {}). "
    "See the stack trace for more information.\n\n(Refer to the full stack trace above for more information.)"
)


class ConversionError(RuntimeError):
    pass


class DispatchError(RuntimeError):
    pass


def onnx_like_error() -> ConversionError:
    """Raised and chained as the exporter does: `raise ConversionError(...) from error`, twice."""
    try:
        try:
            try:
                raise DispatchError(
                    "No ONNX function found for <OpOverload(op='aten.unsqueeze', overload='default')>. "
                    "Failure message: No decompositions registered for the complex-valued input"
                )
            except DispatchError as error:
                raise ConversionError(
                    "Error when translating node %unsqueeze_1 : [num_users=1] = call_function[target=torch.ops."
                    "aten.unsqueeze.default](args = (%tensors_1, 2), kwargs = {}). See the stack trace for more "
                    "information."
                ) from error
        except ConversionError as error:
            raise ConversionError(ADVICE) from error
    except ConversionError as error:
        return error
    raise AssertionError("unreachable")


def raised(make: Callable[[], BaseException]) -> BaseException:
    try:
        raise make()
    except BaseException as error:
        return error


# ------------------------------------------------------------------------------------------------------------
# summarize / details on synthetic exceptions
# ------------------------------------------------------------------------------------------------------------


def test_an_exporter_error_is_summarised_as_its_cause() -> None:
    error = onnx_like_error()
    text = summarize(error)
    assert text == (
        "ConversionError (from DispatchError): No ONNX function found for aten.unsqueeze.default. "
        "Failure message: No decompositions registered for the complex-valued input"
    )
    assert "Next steps" not in text and "\x1b" not in text


def test_details_keep_every_line_of_every_chained_exception() -> None:
    error = onnx_like_error()
    text = details(error)
    assert text.startswith("ConversionError: Failed to convert the exported program")
    for line in ADVICE.replace("\x1b[96m", "").replace("\x1b[0m", "").splitlines():
        assert line.strip() in text
    assert "raised from ConversionError: Error when translating node %unsqueeze_1" in text
    assert "raised from DispatchError: No ONNX function found for <OpOverload(op='aten.unsqueeze'" in text
    assert "\x1b" not in text


def test_advice_lines_first_then_a_dtype() -> None:
    error = RuntimeError(
        "Compilation failed. Next steps:\n"
        "- If there is a bug, please report it.\n"
        "\n"
        "Expected all tensors to have dtype float16, but got float32 for argument #2 'mat2'\n"
        "(Refer to the full stack trace above for more information.)"
    )
    assert summarize(error) == (
        "RuntimeError: Expected all tensors to have dtype float16, but got float32 for argument #2 'mat2'"
    )


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)", "mat1 and mat2 shapes cannot be multiplied"),
        ("expected scalar type Float but found BFloat16", "expected scalar type Float but found BFloat16"),
        (
            "[ONNXRuntimeError] : 10 : INVALID_GRAPH : Type Error: Type 'tensor(int64)' of input parameter (x) of "
            "operator (Mul) in node (n0) is invalid.",
            "Type 'tensor(int64)' of input parameter (x) of operator (Mul)",
        ),
        ("while tracing\nunsupported operator aten::_fft_c2c\nsee above", "unsupported operator aten::_fft_c2c"),
        (
            "a generic first line\nThe size of tensor a (4) must match the size of tensor b (3) at dimension 1",
            "must match the size of tensor b (3) at dimension 1",
        ),
    ],
)
def test_the_line_that_names_an_operator_dtype_or_shape_wins(message: str, expected: str) -> None:
    text = summarize(RuntimeError(message))
    assert text.startswith("RuntimeError: ") and expected in text


def test_a_cause_chained_implicitly_is_read_too() -> None:
    def make() -> Exception:
        try:
            raise TypeError("unsupported dtype torch.complex128 for input 3")
        except TypeError:
            try:
                raise RuntimeError("export failed.\nSee the stack trace for more information.")
            except RuntimeError as error:
                return error
        raise AssertionError("unreachable")

    error = make()
    assert len(chain(error)) == 2
    assert summarize(error) == "RuntimeError (from TypeError): unsupported dtype torch.complex128 for input 3"
    assert "while handling TypeError: unsupported dtype torch.complex128" in details(error)


def test_a_context_raised_from_none_stays_hidden() -> None:
    def make() -> Exception:
        try:
            raise KeyError("dtype float16 lookup")
        except KeyError:
            try:
                raise ValueError("no such option: fast") from None
            except ValueError as error:
                return error
        raise AssertionError("unreachable")

    error = make()
    assert chain(error) == [error]
    assert summarize(error) == "ValueError: no such option: fast"
    assert details(error) == "ValueError: no such option: fast"


def test_no_named_cause_falls_back_to_the_first_line_that_is_not_advice() -> None:
    error = raised(lambda: RuntimeError("\n\n## Next steps:\n- If there is a fix, apply it.\nsomething broke\nmore"))
    assert summarize(error) == "RuntimeError: something broke"
    assert summarize(ValueError("")) == "ValueError"
    assert summarize(KeyError("weight")) == "KeyError: 'weight'"


def test_summaries_are_bounded() -> None:
    text = summarize(RuntimeError("unsupported dtype complex128 " + "x" * 1000))
    assert len(text) == MAX_SUMMARY and text.endswith("…")
    assert len(details(RuntimeError("y" * 1000))) > 1000  # the full text is not cut


def test_cycles_and_broken_messages_do_not_break_the_summary() -> None:
    first, second = RuntimeError("first"), RuntimeError("second, float16")
    first.__cause__, second.__cause__ = second, first
    assert chain(first) == [first, second]
    assert summarize(first) == "RuntimeError: second, float16"

    class Broken(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert summarize(Broken()).startswith("Broken")
    assert details(Broken()).startswith("Broken")


# ------------------------------------------------------------------------------------------------------------
# Through the core: reports, JSON and the CLI's --details
# ------------------------------------------------------------------------------------------------------------


class ExporterLikeBackend(Backend):
    """A backend whose build fails the way torch.onnx does."""

    name = "exporter_like"

    def build(self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        raise onnx_like_error()


def test_reports_carry_the_summary_and_the_details() -> None:
    block = MLPBlock(width=8).eval()
    x = torch.randn(2, 8)
    with register({"block": block}, TuningConfig(strategy=OneBackend(ExporterLikeBackend()), **QUICK)) as reg:
        with torch.no_grad():
            block(x)
            reg.tune()
            block(x)
        report = reg.report()
    candidate = report.modules["block"].signatures[0].candidates[0]
    assert candidate.error == summarize(onnx_like_error())
    assert "complex-valued" in report.modules["block"].reason
    assert candidate.details is not None and "Next steps" in candidate.details

    data = json.loads(report.to_json())
    saved = data["modules"]["block"]["signatures"][0]["candidates"][0]
    assert saved["error"] == candidate.error and saved["details"] == candidate.details
    rebuilt = TuningReport.from_dict(data)
    assert rebuilt.modules["block"].signatures[0].candidates[0].details == candidate.details

    printed = cli_details(data)
    assert f"    exporter_like: {candidate.error}" in printed
    assert "        raised from DispatchError: No ONNX function found" in printed
    assert "Next steps" in printed  # the full text, under the summary


def test_a_reason_from_an_exception_while_serving_is_summarised() -> None:
    class FailsWhenServing(Backend):
        name = "fails_when_serving"

        def build(self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
            def fn(*args: Any, **kwargs: Any) -> Any:
                if failing:  # the check and the timing pass; serving fails
                    raise onnx_like_error()
                return forward(*args, **kwargs)

            return BuiltBackend(fn=fn)

    failing = False
    block = MLPBlock(width=8).eval()
    x = torch.randn(2, 8)
    config = TuningConfig(strategy=OneBackend(FailsWhenServing()), **QUICK)
    with register({"block": block}, config) as reg, torch.no_grad():
        block(x)
        reg.tune()
        block(x)  # tunes, then serves
        assert reg.targets["block"].calls_served == {"eager": 1, "fails_when_serving": 1}
        failing = True
        torch.testing.assert_close(block(x), MLPBlock.forward(block, x))  # falls back to eager
        signature = reg.report().modules["block"].signatures[0]
    assert signature.reason is not None and signature.reason.startswith(
        "fails_when_serving raised while serving: ConversionError (from DispatchError): No ONNX function found"
    )
    assert signature.details is not None and "Next steps" in signature.details


# ------------------------------------------------------------------------------------------------------------
# A real one: Diffusers' Lumina2 blocks take a complex128 rotary input, which ONNX cannot take
# ------------------------------------------------------------------------------------------------------------


def test_lumina2_blocks_stay_eager_and_say_complex_is_why() -> None:
    if Lumina2Transformer2DModel is None:
        pytest.skip("needs diffusers")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = Lumina2Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=1,
        num_refiner_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),  # sums to the head dim, 32 / 2
        axes_lens=(16, 16, 16),
        cap_feat_dim=16,
    ).eval()
    inputs = {
        "hidden_states": torch.randn(1, 4, 8, 8),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": torch.randn(1, 5, 16),
        "encoder_attention_mask": torch.ones(1, 5, dtype=torch.bool),
    }
    blocks = {"noise_refiner": model.noise_refiner, "context_refiner": model.context_refiner, "layers": model.layers}
    config = {"backends": ["onnxruntime"], "min_speedup": 0, "trigger": "manual", **QUICK}
    with torch.no_grad():
        expected = model(**inputs).sample
        with register(blocks, config) as reg:
            model(**inputs)
            reg.tune()
            output = model(**inputs).sample
            report = reg.report()
    torch.testing.assert_close(output, expected, rtol=0, atol=0)  # eager serves: the same output
    assert set(report.modules) == {"noise_refiner.0", "context_refiner.0", "layers.0"}
    for name, module in report.modules.items():
        assert module.state == "eager", name
        assert "complex" in module.reason and "Next steps" not in module.reason, module.reason
        assert "complex128" in module.signatures[0].signature  # the rotary input, shown in the report
        candidate = module.signatures[0].candidates[0]
        assert candidate.backend == "onnxruntime" and "complex" in candidate.error
        assert candidate.details is not None and "Next steps" in candidate.details
