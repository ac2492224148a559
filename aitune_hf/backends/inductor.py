"""torch.compile with the Inductor backend, one compiled callable per signature.

Dynamo caches compiled graphs per code object, with a recompile limit (8) per code object after which it runs
the frame eager without a word. Transformers 5 gives every decoder layer class one shared forward code object,
so the compiles of every layer of every model would share one limit. Each build therefore compiles a private
copy of the forward's code, one per (function, input layout): identical sibling blocks called alike still
share one graph (parameters are graph inputs), and no build spends another's limit. A build that Dynamo ran
eager anyway (a frame it gave up on) fails with that reason instead of passing as "inductor".

Shapes: `dynamic=False` where the inputs pin every shape. A build for a shape family (`dynamic=True`), and
inputs that hold objects (a KV cache grows every decode step, unseen by the signature), use Dynamo's automatic
dynamic shapes: a graph for the first shape, then one graph with symbolic sizes for the dimensions that
changed, not one graph per shape. Dynamo's recompile limit still applies (a size 0 or 1 is specialised): a
frame it runs eager is counted (`BuiltBackend.fell_back`), so the tuning core rejects the shape that caused it.

`freezing=True` folds the weights into the graph as constants, which is faster on CPU but bakes the weights (a
private code object per module instance).

`precision="bf16"` / `"fp16"` (reduced precision, opt-in through `TuningConfig.precision`): the forward runs under
`torch.autocast` in that dtype inside the compiled graph, with freezing, so the weights are cast once, at compile time,
and folded in as constants; matmuls and convolutions compute in the low dtype, autocast keeps the ops it lists as
unsafe (softmax, norms, reductions) in fp32, and floating outputs come back in fp32. Measured on an AMD EPYC with
AVX512-BF16 (docs/precision.md): conv and linear 1.8x, attention 0.96x.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aitune_hf.backends.base import PLAIN_VALUES, Backend, BuiltBackend, Call, current_build, register_backend
from aitune_hf.errors import ConfigError


@register_backend
class InductorBackend(Backend):
    """`torch.compile(forward, backend="inductor", dynamic=False)`; compiled while building."""

    name = "inductor"
    build_cost = "slow"  # a compile of a small block takes 5-30 s here
    accepts_objects = True  # Dynamo traces object inputs and replays their mutations
    polymorphic = True  # dynamic=True: one graph with symbolic sizes serves a shape family

    def __init__(
        self,
        mode: str | None = None,
        freezing: bool = False,
        fullgraph: bool = False,
        options: dict[str, Any] | None = None,
        precision: str = "fp32",
    ) -> None:
        if precision not in _AUTOCAST_DTYPES and precision != "fp32":
            raise ConfigError(
                f"InductorBackend: precision={precision!r} is not valid; valid values: 'fp32', "
                f"{', '.join(map(repr, _AUTOCAST_DTYPES))}"
            )
        freezing = freezing or precision != "fp32"  # the weights are cast once, at compile time
        if mode is not None and (options or freezing):
            raise ConfigError(
                "InductorBackend: pass either `mode` or `options`/`freezing` (or a reduced precision), not both "
                "(torch.compile accepts one of them)"
            )
        self.mode = mode
        self.precision = precision
        self.freezing = freezing
        self.fullgraph = fullgraph
        self.options = dict(options or {})
        if freezing:
            self.options["freezing"] = True
        #: (function, instance, dynamic, layout) -> private function copy, held only by the builds that use it.
        self._private: weakref.WeakValueDictionary[tuple[Any, ...], types.FunctionType] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    @property
    def bakes_weights(self) -> bool:  # type: ignore[override]
        return self.freezing

    @property
    def supports_autograd(self) -> bool:  # type: ignore[override]
        return not self.freezing

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        return {"torch": torch.__version__}  # Inductor ships inside torch (its code generators and kernels)

    def describe(self) -> str:
        extras = [f"mode={self.mode}"] if self.mode else []
        extras += [f"{k}={v}" for k, v in sorted(self.options.items())]
        extras += [f"precision={self.precision}"] if self.precision != "fp32" else []
        return f"{self.name}({', '.join(extras)})" if extras else self.name

    def with_precision(self, precision: str) -> InductorBackend | None:
        if precision == self.precision:
            return self
        if precision not in _AUTOCAST_DTYPES or self.mode is not None:
            return None
        options = {k: v for k, v in self.options.items() if k != "freezing"}
        return InductorBackend(fullgraph=self.fullgraph, options=options, precision=precision)

    def build(
        self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call], dynamic: bool = False
    ) -> BuiltBackend:
        objects = any(_holds_objects(call) for call in samples)
        # Frozen graphs hold one module's weights as constants: a private code object per instance, so Dynamo
        # never serves one instance's constants to a sibling.
        layout = _layout(samples[0], sizes=not dynamic) if samples else ()
        key = (_function_of(forward), id(module) if self.freezing else None, dynamic, layout)
        private = _function_of(forward)
        if isinstance(private, types.FunctionType) and isinstance(getattr(forward, "__self__", None), torch.nn.Module):
            with self._lock:
                cached = self._private.get(key)
                if cached is None:
                    cached = self._private[key] = _private_copy(private)
            private = cached
        # The cache (core/cache.py): Inductor's own artifacts from an earlier process (its FX graph and autotuning
        # caches, `torch.compiler.load_cache_artifacts`) make this compile a cache hit; Dynamo still traces.
        place = current_build().place
        cached = place.load(self, self.freezing) if place is not None else None
        if cached is not None:
            torch.compiler.load_cache_artifacts((cached / _ARTIFACTS_FILE).read_bytes())
        target = _rebind(private, forward)
        if self.precision != "fp32":
            devices = {leaf.device.type for leaf in _leaves(samples[0]) if isinstance(leaf, torch.Tensor)} or {"cpu"}
            target = _under_autocast(target, _AUTOCAST_DTYPES[self.precision], devices.pop())
        options = dict(self.options)
        if objects and self.mode is None:
            # A call that holds an object (a KV cache: a decode step of generate()) runs a few milliseconds of kernels,
            # where the Python wrapper that launches them is a tenth of the time: a C++ one instead (measured on a
            # tiny Llama's decode steps, 1 thread, AMD EPYC: +10% tokens/s, the same compile time).
            options.setdefault("cpp_wrapper", True)
        compiled = torch.compile(
            target,
            backend="inductor",
            dynamic=None if dynamic or objects else False,
            fullgraph=self.fullgraph,
            mode=self.mode,
            options=options or None,
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
        dynamic_dims = None
        if dynamic and samples:  # automatic dynamic shapes: a size that varies becomes symbolic at its first change
            tensors = [leaf for leaf in _leaves(samples[0]) if isinstance(leaf, torch.Tensor)]
            dynamic_dims = tuple(frozenset(range(t.dim())) for t in tensors)
        artifacts = []
        if place is not None and cached is None:
            saved = torch.compiler.save_cache_artifacts()  # what this process compiled so far (this build included)
            if saved is not None:
                folder = place.save()
                (folder / _ARTIFACTS_FILE).write_bytes(saved[0])
                artifacts.append(folder)
        return BuiltBackend(
            fn=_Compiled(compiled, private),
            bakes_weights=self.freezing,
            artifacts=artifacts,
            dynamic_dims=dynamic_dims,
            fell_back=_eager_frames,
            loaded=cached is not None,
        )


#: The dtype each reduced precision computes in, under `torch.autocast`.
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _under_autocast(forward: Callable[..., Any], dtype: torch.dtype, device_type: str) -> Callable[..., Any]:
    """`forward` run under `torch.autocast(device_type, dtype)`, its floating outputs in that dtype brought back to
    fp32; a code object of its own per build (Dynamo keeps graphs and its recompile limit per code object)."""

    def low_precision(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype == dtype else t, out)

    return _private_copy(low_precision)


#: Inductor's cache artifacts (`torch.compiler.save_cache_artifacts`) inside an artifact folder. Loading them
#: unpickles: docs/cache.md says why the cache folder is trusted like code.
_ARTIFACTS_FILE = "inductor_artifacts.bin"


class _Compiled:
    """The compiled callable, holding the private code it runs: the code (and Dynamo's cache of graphs kept on
    it) lives exactly as long as a build that uses it; a candidate that lost releases its graphs."""

    __slots__ = ("_fn", "_private")

    def __init__(self, fn: Callable[..., Any], private: Callable[..., Any]) -> None:
        self._fn, self._private = fn, private

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


def _eager_frames() -> int:
    """Frames Dynamo has run eager in this process (its recompile limit, or code it cannot compile)."""
    total, ok = _frames()
    return total - ok


def _frames() -> tuple[int, int]:
    """Dynamo's process-wide counts of frames it tried to compile and of those it compiled."""
    frames = torch._dynamo.utils.counters["frames"]
    return frames["total"], frames["ok"]


def _holds_objects(call: Call) -> bool:
    """True when an input is neither a tensor nor a plain value (an object such as a KV cache)."""
    from torch.utils import _pytree as pytree

    return not all(isinstance(leaf, (torch.Tensor, *PLAIN_VALUES)) for leaf in pytree.tree_leaves(call))


def _leaves(call: Call) -> list[Any]:
    from torch.utils import _pytree as pytree

    return pytree.tree_leaves(call)


def _layout(call: Call, sizes: bool = True) -> tuple[Any, ...]:
    """The input layout one compiled graph serves: tensor shapes, dtypes and strides (for a graph with symbolic
    sizes, what it specialises on); other leaves' types."""
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten(call)
    described = [
        ((tuple(leaf.shape), leaf.stride()) if sizes else _layout_kind(leaf), leaf.dtype, leaf.device.type)
        if isinstance(leaf, torch.Tensor)
        else type(leaf).__qualname__
        for leaf in leaves
    ]
    return (str(spec), *described)


def _layout_kind(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a graph with symbolic sizes still specialises on: rank, broadcast (stride-0) dimensions, memory format,
    and sizes 0 and 1."""
    return (
        tensor.dim(),
        tuple(stride == 0 for stride in tensor.stride()),
        tuple(min(size, 2) for size in tensor.shape),
        tensor.is_contiguous(),
        tensor.is_contiguous(memory_format=torch.channels_last),
    )


def _function_of(forward: Callable[..., Any]) -> Any:
    return getattr(forward, "__func__", forward)


def _rebind(private: Callable[..., Any], forward: Callable[..., Any]) -> Callable[..., Any]:
    """`private` (a copy of `forward`'s function) bound to `forward`'s own module; `forward` when not a copy."""
    owner = getattr(forward, "__self__", None)
    if private is _function_of(forward) or owner is None:
        return forward
    return types.MethodType(private, owner)


def _private_copy(func: types.FunctionType) -> types.FunctionType:
    """`func` with a fresh code object (Dynamo caches graphs per code object)."""
    fresh = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    fresh.__kwdefaults__ = func.__kwdefaults__
    return fresh
