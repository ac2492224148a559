"""torch.compile with the Inductor backend, one compiled callable per signature.

The callable compiles the module's *class* forward, so identical sibling modules hit the same compiled
code (Dynamo caches per code object and, with `inline_inbuilt_nn_modules`, passes parameters as inputs):
a stack of identical blocks compiles one graph. `freezing=True` folds the weights into the graph as
constants, which is faster on CPU but bakes the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from aitune_hf.backends.base import Backend, BuiltBackend, Call, register_backend


@register_backend
class InductorBackend(Backend):
    """`torch.compile(forward, backend="inductor", dynamic=False)`; compiled while building."""

    name = "inductor"
    accepts_objects = True  # Dynamo traces object inputs and replays their mutations

    def __init__(
        self,
        mode: str | None = None,
        freezing: bool = False,
        fullgraph: bool = False,
        options: dict[str, Any] | None = None,
    ) -> None:
        if mode is not None and (options or freezing):
            raise ValueError(
                "InductorBackend: pass either `mode` or `options`/`freezing`, not both "
                "(torch.compile accepts one of them)"
            )
        self.mode = mode
        self.freezing = freezing
        self.fullgraph = fullgraph
        self.options = dict(options or {})
        if freezing:
            self.options["freezing"] = True

    @property
    def bakes_weights(self) -> bool:  # type: ignore[override]
        return self.freezing

    @property
    def supports_autograd(self) -> bool:  # type: ignore[override]
        return not self.freezing

    def describe(self) -> str:
        extras = [f"mode={self.mode}"] if self.mode else []
        extras += [f"{k}={v}" for k, v in sorted(self.options.items())]
        return f"{self.name}({', '.join(extras)})" if extras else self.name

    def build(self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        if self.freezing:
            # Frozen graphs hold one module's weights as constants: give every instance its own code
            # object so Dynamo never serves one instance's constants to a sibling.
            forward = _private_copy(forward)
        compiled = torch.compile(
            forward,
            backend="inductor",
            dynamic=False,
            fullgraph=self.fullgraph,
            mode=self.mode,
            options=self.options or None,
        )
        for args, kwargs in samples:  # compile now, so that build time is compile time
            compiled(*args, **kwargs)
        return BuiltBackend(fn=compiled, bakes_weights=self.freezing)


def _private_copy(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A bound forward whose function has a fresh code object (Dynamo caches per code object)."""
    func = getattr(forward, "__func__", None)
    owner = getattr(forward, "__self__", None)
    if func is None or owner is None:
        return forward
    import types

    code = func.__code__.replace()
    fresh = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    fresh.__kwdefaults__ = func.__kwdefaults__
    return types.MethodType(fresh, owner)
