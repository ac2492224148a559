"""torch.compile with the Inductor backend, one compiled callable per signature.

Dynamo caches compiled graphs per code object, with a recompile limit (8) per code object after which it runs
the frame eager without a word. Transformers 5 gives every decoder layer class one shared forward code object,
so the compiles of every layer of every model would share one limit. Each build therefore compiles a private
copy of the forward's code, one per (function, input layout): identical sibling blocks called alike still
share one graph (parameters are graph inputs), and no build spends another's limit. A build that Dynamo ran
eager anyway (a frame it gave up on) fails with that reason instead of passing as "inductor".

Shapes: `dynamic=False` where the inputs pin every shape. Inputs that hold objects (a KV cache) carry shapes
the signature cannot see (the cache grows every decode step): those builds use automatic dynamic shapes, so
a growing cache costs one more graph, not one per step. `freezing=True` folds the weights into the graph as
constants, which is faster on CPU but bakes the weights (a private code object per module instance).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aitune_hf.backends.base import PLAIN_VALUES, Backend, BuiltBackend, Call, register_backend


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
        self._private: dict[tuple[Any, ...], Callable[..., Any]] = {}  # (function, instance, layout) -> copy
        self._lock = threading.Lock()

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
        objects = any(_holds_objects(call) for call in samples)
        # Frozen graphs hold one module's weights as constants: a private code object per instance, so Dynamo
        # never serves one instance's constants to a sibling.
        key = (_function_of(forward), id(module) if self.freezing else None, _layout(samples[0]) if samples else ())
        with self._lock:
            if key not in self._private:
                self._private[key] = _private_copy(forward)
            private = self._private[key]
        compiled = torch.compile(
            _rebind(private, forward),
            backend="inductor",
            dynamic=None if objects else False,
            fullgraph=self.fullgraph,
            mode=self.mode,
            options=self.options or None,
        )
        before = _frames()
        for args, kwargs in samples:  # compile now, so that build time is compile time
            compiled(*args, **kwargs)
        total, ok = (now - then for now, then in zip(_frames(), before, strict=True))
        if total > ok:
            raise RuntimeError(
                f"Dynamo ran {total - ok} of {total} frame(s) of this forward eager (its recompile limit of "
                f"{torch._dynamo.config.recompile_limit} reached, or code it cannot compile); "
                f"TORCH_LOGS=recompiles,graph_breaks shows which"
            )
        return BuiltBackend(fn=compiled, bakes_weights=self.freezing)


def _frames() -> tuple[int, int]:
    """Dynamo's process-wide counts of frames it tried to compile and of those it compiled."""
    frames = torch._dynamo.utils.counters["frames"]
    return frames["total"], frames["ok"]


def _holds_objects(call: Call) -> bool:
    """True when an input is neither a tensor nor a plain value (an object such as a KV cache)."""
    from torch.utils import _pytree as pytree

    return not all(isinstance(leaf, (torch.Tensor, *PLAIN_VALUES)) for leaf in pytree.tree_leaves(call))


def _layout(call: Call) -> tuple[Any, ...]:
    """The input layout one compiled graph serves: tensor shapes, dtypes and strides; other leaves' types."""
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten(call)
    described = [
        (tuple(leaf.shape), leaf.dtype, leaf.stride(), leaf.device.type)
        if isinstance(leaf, torch.Tensor)
        else type(leaf).__qualname__
        for leaf in leaves
    ]
    return (str(spec), *described)


def _function_of(forward: Callable[..., Any]) -> Any:
    return getattr(forward, "__func__", forward)


def _rebind(private: Callable[..., Any], forward: Callable[..., Any]) -> Callable[..., Any]:
    """`private` (a copy of `forward`'s function) bound to `forward`'s own module."""
    import types

    func, owner = getattr(private, "__func__", None), getattr(forward, "__self__", None)
    return types.MethodType(func, owner) if func is not None and owner is not None else private


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
