"""Backends: one file per technology, reachable by name through the registry in `base`."""

from aitune_hf.backends.base import Backend, BuiltBackend, backend_names, get_backend, register_backend
from aitune_hf.backends.eager import EagerBackend
from aitune_hf.backends.inductor import InductorBackend
from aitune_hf.backends.onnx import forget_exports
from aitune_hf.backends.onnxruntime import OnnxRuntimeBackend, arena_cap
from aitune_hf.backends.openvino import OpenVinoBackend

__all__ = [
    "Backend",
    "BuiltBackend",
    "EagerBackend",
    "InductorBackend",
    "OnnxRuntimeBackend",
    "OpenVinoBackend",
    "arena_cap",
    "backend_names",
    "forget_exports",
    "get_backend",
    "register_backend",
]
