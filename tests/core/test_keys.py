"""What a cache key is made of (core/keys.py): each owner's part is in it, and a change of that part is another
key; names the framework layer registers as incidental stay out of it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from aitune_hf.backends import base
from aitune_hf.backends.base import Backend, BuiltBackend, Call, get_backend
from aitune_hf.core import keys
from aitune_hf.core.config import TuningConfig
from aitune_hf.core.signature import layout_of, signature_of
from tests.core.modules import MLPBlock


class _Versioned(Backend):
    """A backend whose builds depend on a package of its own."""

    name = "versioned_for_keys"
    release = "1.2.3"

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        return {"fancy-compiler": cls.release}

    def build(self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        return BuiltBackend(forward)


def _fields(module: torch.nn.Module, candidates: list[Backend]) -> dict[str, Any]:
    x = torch.randn(2, 32)
    signature = signature_of((x,), {})
    return keys.key_fields(module, [signature], False, TuningConfig(), candidates, "min_latency", layout_of((x,), {}))


def test_each_backend_puts_its_own_versions_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    module = MLPBlock(32).eval()
    # The shared export's corrections (`onnx.export.EXPORT_REVISION`) are in the key of each runtime reading it.
    assert set(get_backend("onnxruntime").versions()) == {"onnxruntime", "onnx", "onnxscript", "aitune-hf onnx export"}
    fields = _fields(module, [get_backend("onnxruntime")])
    assert {"python", "torch", "aitune-hf", "onnxruntime", "onnx", "onnxscript"} <= set(fields["versions"])
    assert _fields(module, [_Versioned()])["versions"]["fancy-compiler"] == "1.2.3"  # a candidate, not registered
    monkeypatch.setitem(base._REGISTRY, _Versioned.name, _Versioned)
    fields = _fields(module, [get_backend("onnxruntime")])  # registered: in every key
    assert fields["versions"]["fancy-compiler"] == "1.2.3"
    monkeypatch.setattr(_Versioned, "release", "2.0.0")
    upgraded = _fields(module, [get_backend("onnxruntime")])
    assert upgraded["versions"]["fancy-compiler"] == "2.0.0"
    assert keys.key_of(upgraded) != keys.key_of(fields)


def test_registered_incidental_names_stay_out_of_the_fingerprint() -> None:
    assert "_name_or_path" in keys.incidental()  # registered by aitune_hf.hf at import: the core names none
    first, second = MLPBlock(32).eval(), MLPBlock(32).eval()
    first.config = {"hidden": 32, "_name_or_path": "/models/a"}
    second.config = {"hidden": 32, "_name_or_path": "/mnt/replica/b"}
    first._name_or_path, second._name_or_path = "/models/a", "/mnt/replica/b"
    assert keys.state_fingerprint(first) == keys.state_fingerprint(second)
    second.config["hidden"] = 64  # what it computes: another fingerprint
    assert keys.state_fingerprint(first) != keys.state_fingerprint(second)
