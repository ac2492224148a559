"""TuningConfig and enable_aitune check every value up front: a bad one is a ConfigError naming the field, the
value and what is valid, and it leaves nothing registered or patched."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch

import aitune_hf
from aitune_hf import TuningConfig
from aitune_hf.backends.base import Backend, BuiltBackend
from aitune_hf.errors import AITuneError, ConfigError, InputTypeError, UsageError, UserInputError
from tests.core.modules import TwoBlocks

NAN, INF = float("nan"), float("inf")


class NamedBackend(Backend):
    name = "named_for_config_tests"

    def build(self, module, forward, samples) -> BuiltBackend:  # pragma: no cover - never built here
        return BuiltBackend(forward)


# (field, bad value, text the message must show for the value)
INVALID: list[tuple[str, Any, str]] = [
    ("backends", 3, "3"),
    ("backends", {"inductor"}, "{'inductor'}"),  # no order, and the order is the order of trial
    ("backends", ["nosuch"], "'nosuch'"),
    ("backends", ["inductor", 3], "3"),
    ("backends", [NamedBackend], "NamedBackend"),  # the class, not an instance
    ("strategy", 3, "3"),
    ("strategy", None, "None"),
    ("strategy", "fastest", "'fastest'"),
    ("min_speedup", NAN, "nan"),
    ("min_speedup", INF, "inf"),
    ("min_speedup", -INF, "-inf"),
    ("min_speedup", -0.5, "-0.5"),
    ("min_speedup", True, "True"),
    ("min_speedup", "1.05", "'1.05'"),
    ("min_speedup", None, "None"),
    ("tolerances", [(1e-3, 1e-3)], "[(0.001, 0.001)]"),  # not a mapping
    ("tolerances", "tight", "'tight'"),
    ("tolerances", {"float32": (1e-3, 1e-3)}, "'float32'"),  # not a dtype key
    ("tolerances", {torch.float32: 1e-3}, "0.001"),
    ("tolerances", {torch.float32: (1e-3,)}, "(0.001,)"),  # wrong length
    ("tolerances", {torch.float32: (1e-3, 1e-3, 0.0)}, "(0.001, 0.001, 0.0)"),
    ("tolerances", {torch.float32: (-1e-3, 1e-3)}, "(-0.001, 0.001)"),  # negative atol
    ("tolerances", {torch.float32: (NAN, 1e-3)}, "(nan, 0.001)"),
    ("tolerances", {torch.float32: (1e-3, INF)}, "(0.001, inf)"),
    ("tolerances", {torch.float32: (True, 1e-3)}, "(True, 0.001)"),
    ("tolerances", {torch.float32: ("1e-3", 1e-3)}, "('1e-3', 0.001)"),
    ("warmup", -1, "-1"),
    ("warmup", True, "True"),
    ("warmup", 1.5, "1.5"),
    ("warmup", "2", "'2'"),
    ("warmup", NAN, "nan"),
    ("repeats", 0, "0"),
    ("repeats", True, "True"),
    ("repeats", 2.5, "2.5"),
    ("repeats", 15.0, "15.0"),
    ("repeats", INF, "inf"),
    ("repeats", None, "None"),
    ("max_samples_per_signature", 0, "0"),
    ("max_samples_per_signature", False, "False"),
    ("max_samples_per_signature", 1.5, "1.5"),
    ("max_sample_bytes", 0, "0"),
    ("max_sample_bytes", -1, "-1"),
    ("max_sample_bytes", 1.5e9, "1500000000.0"),
    ("max_sample_bytes", True, "True"),
    ("trigger", "sometimes", "'sometimes'"),
    ("trigger", "after_calls=0", "'after_calls=0'"),
    ("trigger", "after_calls=", "'after_calls='"),
    ("trigger", "manual\n", "'manual\\n'"),
    ("trigger", 1, "1"),
    ("trigger", None, "None"),
    ("share_identical", 1, "1"),
    ("share_identical", "yes", "'yes'"),
    ("progress", 0, "0"),
    ("progress", None, "None"),
    ("max_routes", 0, "0"),
    ("max_routes", -1, "-1"),
    ("max_routes", True, "True"),
    ("max_routes", 8.0, "8.0"),
    ("max_routes", NAN, "nan"),
    ("retune", 1, "1"),
    ("retune", "false", "'false'"),
    ("retune", None, "None"),
]


def _id(case: tuple[str, Any, str]) -> str:
    return f"{case[0]}={case[2]}"


@pytest.mark.parametrize(("name", "value", "shown"), INVALID, ids=[_id(c) for c in INVALID])
def test_every_invalid_value_is_a_config_error_naming_field_and_value(name: str, value: Any, shown: str) -> None:
    with pytest.raises(ConfigError) as caught:
        TuningConfig(**{name: value})
    message = str(caught.value)
    assert f"TuningConfig.{name}" in message, message
    assert shown in message, message
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, AITuneError)
    with pytest.raises(ConfigError):  # the dict form goes through the same checks
        TuningConfig.coerce({name: value})


def test_messages_say_what_is_valid() -> None:
    def message(**fields: Any) -> str:
        with pytest.raises(ConfigError) as caught:
            TuningConfig(**fields)
        return str(caught.value)

    assert message(min_speedup=NAN) == "TuningConfig.min_speedup must be a finite number >= 0, got nan"
    assert message(repeats=True) == "TuningConfig.repeats must be an int >= 1, got True"
    assert "valid names: eager, inductor, onnxruntime" in message(backends=["tensorrtt"])
    assert "'min_latency', 'first_wins'" in message(strategy="fastest")
    assert "(atol, rtol) pair of finite numbers >= 0" in message(tolerances={torch.float16: (0.1, -1)})
    assert "'manual' or 'after_calls=N' with N >= 1" in message(trigger="after_calls=0")


def test_unknown_keys_and_wrong_config_types() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown TuningConfig field\(s\) 'backend' \(did you mean 'backends'\?\), "
        r"'repeat' \(did you mean 'repeats'\?\); valid: backends, ",
    ):
        TuningConfig.coerce({"backend": ["inductor"], "repeat": 3})
    with pytest.raises(ConfigError, match="max_routes, shapes, retune"):
        TuningConfig.coerce({"retunes": False})
    with pytest.raises(InputTypeError, match="config must be a TuningConfig, a dict of its fields or None, got int"):
        TuningConfig.coerce(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # InputTypeError is a TypeError too
        TuningConfig.coerce(["repeats", 3])  # type: ignore[arg-type]


def test_a_field_assigned_after_construction_is_checked_by_coerce() -> None:
    config = TuningConfig()
    config.min_speedup = NAN
    with pytest.raises(ConfigError, match="min_speedup"):
        TuningConfig.coerce(config)


def test_defaults_and_valid_values_construct_and_are_normalised() -> None:
    config = TuningConfig()
    assert config.max_routes == 8 and config.retune is True
    # OpenVINO is a default candidate where its extra is installed, and only there.
    openvino = ("openvino",) if importlib.util.find_spec("openvino") is not None else ()
    assert config.backends == ("inductor", "onnxruntime", *openvino) and config.trigger == "manual"
    assert TuningConfig.coerce(None) == config and TuningConfig.coerce({}) == config
    backend = NamedBackend()
    config = TuningConfig(
        backends=["onnxruntime", backend],
        strategy="first_wins",
        min_speedup=0,
        tolerances={torch.float32: [0, 1e-4]},
        warmup=0,
        repeats=1,
        max_samples_per_signature=1,
        max_sample_bytes=1,
        trigger="after_calls=3",
        share_identical=False,
        progress=False,
        max_routes=1,
        retune=False,
    )
    assert config.backends == ("onnxruntime", backend)
    assert config.min_speedup == 0.0 and isinstance(config.min_speedup, float)
    assert config.tolerances == {torch.float32: (0.0, 1e-4)} and config.tolerance(torch.float64) == (0.0, 0.0)
    assert config.after_calls == 3 and config.max_routes == 1 and config.retune is False
    assert TuningConfig(backends="inductor").backends == ("inductor",)
    assert TuningConfig(backends=[]).backends == ()  # eager only
    numpy = pytest.importorskip("numpy")
    assert type(TuningConfig(warmup=numpy.int64(2)).warmup) is int
    assert math.isclose(TuningConfig(min_speedup=numpy.float32(1.5)).min_speedup, 1.5)


# -- enable_aitune: checked before anything is registered or patched ------------------------------------------


def _assert_unpatched(model: TwoBlocks) -> None:
    assert type(model) is TwoBlocks
    assert "_aitune_state" not in model.__dict__
    for module in model.modules():
        assert "forward" not in module.__dict__, f"{type(module).__name__} keeps a patched forward"


BAD_ENABLE = [
    ({"tune_after_calls": 0}, ConfigError, "tune_after_calls must be an int >= 1 or None, got 0"),
    ({"tune_after_calls": True}, ConfigError, "tune_after_calls must be an int >= 1 or None, got True"),
    ({"tune_after_calls": 1.5}, ConfigError, "got 1.5"),
    ({"tune_after_calls": "1"}, ConfigError, "got '1'"),
    ({"component_backends": ()}, ConfigError, "component_backends must be a non-empty list of backend names"),
    ({"component_backends": "nosuch"}, ConfigError, "got ('nosuch',)"),
    ({"component_backends": ["onnxruntime", 3]}, ConfigError, "got ['onnxruntime', 3]"),
    ({"component_backends": 3}, ConfigError, "got 3"),
    ({"targets": 3}, InputTypeError, "enable_aitune targets must be"),
    ({"targets": "everything"}, UserInputError, "unknown targets 'everything'"),
    ({"targets": ["layers.7"]}, UserInputError, "'layers.7' does not name a module"),
    ({"backends": ["nosuch"]}, ConfigError, "unknown backend 'nosuch'"),
    ({"strategy": "fastest"}, ConfigError, "unknown strategy 'fastest'"),
    ({"min_speedup": NAN}, ConfigError, "TuningConfig.min_speedup must be a finite number >= 0, got nan"),
    ({"repeats": True}, ConfigError, "TuningConfig.repeats must be an int >= 1, got True"),
    ({"tolerances": {torch.float32: (-1.0, 0.0)}}, ConfigError, "TuningConfig.tolerances[torch.float32]"),
    ({"max_routes": 0}, ConfigError, "TuningConfig.max_routes"),
    ({"retune": "no"}, ConfigError, "TuningConfig.retune"),
    ({"repeat": 3}, ConfigError, "unknown TuningConfig field(s) 'repeat' (did you mean 'repeats'?)"),
    ({"config": {"warmup": -1}}, ConfigError, "TuningConfig.warmup must be an int >= 0, got -1"),
    ({"config": 42}, InputTypeError, "config must be a TuningConfig"),
]


@pytest.mark.parametrize(("options", "error", "message"), BAD_ENABLE, ids=[repr(c[0]) for c in BAD_ENABLE])
def test_enable_aitune_with_a_bad_value_leaves_nothing_patched(options: dict, error: type, message: str) -> None:
    model = TwoBlocks().eval()
    x = torch.randn(2, 8)
    with torch.inference_mode():
        expected = model(x)
    options = {"backends": [], "progress": False, **options}
    with pytest.raises(error) as caught:
        aitune_hf.enable_aitune(model, **options)
    assert message in str(caught.value)
    _assert_unpatched(model)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_enable_aitune_with_valid_values_then_twice() -> None:
    model = TwoBlocks().eval()
    registration = aitune_hf.enable_aitune(
        model, "blocks", backends=[], progress=False, tune_after_calls=None, component_backends="onnxruntime"
    )
    assert list(registration.targets) == ["layers.0", "layers.1"]
    with pytest.raises(UsageError, match="already enabled") as caught:
        model.enable_aitune(repeats=True)
    assert isinstance(caught.value, RuntimeError)
    assert model.aitune is registration
    model.disable_aitune()
    assert model.aitune is registration and registration.detached  # kept for its report
    assert str(model.aitune.report())  # readable after disable_aitune()
    for module in model.modules():
        assert "forward" not in module.__dict__
