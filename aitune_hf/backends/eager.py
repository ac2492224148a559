"""The baseline: the module's own forward, unchanged."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from aitune_hf.backends.base import Backend, BuiltBackend, Call, register_backend


@register_backend
class EagerBackend(Backend):
    """Runs the forward as PyTorch would without aitune_hf."""

    name = "eager"
    supports_autograd = True
    accepts_objects = True
    builds_privately = True  # builds nothing

    def build(self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        return BuiltBackend(fn=forward)
