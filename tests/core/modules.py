"""Tiny modules and test backends shared by the core tests (real torch, nothing mocked)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from aitune_hf.backends.base import Backend, BuiltBackend, Call


class MLPBlock(nn.Module):
    """A residual MLP block: the shape of a transformer layer's feed-forward half."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) * scale


class ManyOpsBlock(nn.Module):
    """Many tiny elementwise ops on a small tensor: eager pays per-op dispatch, ONNX Runtime does not."""

    def __init__(self, width: int = 16, depth: int = 60) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(depth, width) * 0.1 + 1.0)
        self.bias = nn.Parameter(torch.randn(depth, width) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.weight.shape[0]):
            x = torch.tanh(x * self.weight[i] + self.bias[i])
        return x


class PytreeBlock(nn.Module):
    """Takes nested args, kwargs, None and scalars; returns a tuple holding a dict and a None."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(
        self,
        x: torch.Tensor,
        pair: tuple[torch.Tensor, torch.Tensor],
        *,
        mask: torch.Tensor | None = None,
        extras: dict[str, torch.Tensor] | None = None,
        gain: float = 1.0,
    ) -> tuple[Any, ...]:
        h = self.proj(x) * gain + pair[0] - pair[1]
        if mask is not None:
            h = h * mask
        if extras:
            h = h + extras["shift"]
        return {"hidden": h, "double": 2 * h}, None


def pytree_call(width: int = 8, batch: int = 2, seed: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=g)
    pair = (torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
    kwargs = {"mask": torch.ones(batch, width), "extras": {"shift": torch.full((batch, width), 0.5)}, "gain": 2.0}
    return (x, pair), kwargs


class RaisingBackend(Backend):
    """A backend whose build fails."""

    name = "raising"

    def build(self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        raise RuntimeError("this backend always fails to build")


class _Transform(Backend):
    """A backend that runs eager and transforms the output."""

    transform: Callable[[Any], Any] = staticmethod(lambda out: out)

    def build(self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        return BuiltBackend(fn=lambda *a, **k: self.transform(forward(*a, **k)))


class NaNBackend(_Transform):
    name = "nan"
    transform = staticmethod(lambda out: out * float("nan"))


class InfBackend(_Transform):
    name = "inf"
    transform = staticmethod(lambda out: out + float("inf"))


class WrongValuesBackend(_Transform):
    name = "wrong_values"
    transform = staticmethod(lambda out: out + 0.5)


class WrongStructureBackend(_Transform):
    name = "wrong_structure"
    transform = staticmethod(lambda out: (out, out))


class CudaOnlyBackend(Backend):
    """Stands for TensorRT and the like: unavailable without a CUDA device."""

    name = "cuda_only"

    def unavailable_reason(self, devices: frozenset[torch.device]) -> str | None:
        if all(d.type == "cuda" for d in devices):
            return None
        return "needs a CUDA device"

    def build(self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        return BuiltBackend(fn=forward)


class InterruptingBackend(Backend):
    """A build that is interrupted as if by Ctrl-C."""

    name = "interrupting"

    def build(self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        raise KeyboardInterrupt


class FailsWhenServingBackend(Backend):
    """Correct while tuning (its first `ok_calls` calls), then raises."""

    name = "fails_when_serving"

    def __init__(self, ok_calls: int = 100) -> None:
        self.ok_calls = ok_calls

    def build(self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        calls = {"n": 0}

        def fn(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] > self.ok_calls:
                raise RuntimeError(f"engine lost (call {calls['n']})")
            return forward(*args, **kwargs)

        return BuiltBackend(fn=fn)


class WrongAtBatchThree(Backend):
    """A polymorphic backend that claims every size but is wrong at batch 3 (a shape it was never built on)."""

    name = "wrong_at_batch_three"
    polymorphic = True

    def build(
        self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call], dynamic: bool = False
    ) -> BuiltBackend:
        def fn(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            return out + 1.0 if out.shape[0] == 3 else out

        tensors = [leaf for leaf in samples[0][0] if isinstance(leaf, torch.Tensor)]
        dims = tuple(frozenset(range(t.dim())) for t in tensors) if dynamic else None
        return BuiltBackend(fn=fn, dynamic_dims=dims)


class ReducedPrecisionStandIn(Backend):
    """Runs eager and adds a fixed perturbation of relative size `module.reduced_error` (default 0.01; at some batch
    sizes `module.reduced_error_at[rows]`) along a seeded direction: what a reduced-precision kernel does to a block's
    output, with an error the test chooses. Declares precision "int8", so the core checks it by relative error and
    holds it for the end-to-end gate."""

    name = "reduced_stand_in"
    precision = "int8"
    polymorphic = True  # with dynamic=True, one build serves every batch size (dimension 0 of each tensor)
    #: The module attribute holding the error (a subclass of another precision reads its own), and the seed of the
    #: perturbation's direction.
    error_attribute, seed = "reduced_error", 5

    def build(
        self, module: nn.Module, forward: Callable[..., Any], samples: Sequence[Call], dynamic: bool = False
    ) -> BuiltBackend:
        def fn(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            error = float(getattr(module, self.error_attribute, 0.01))
            error = getattr(module, "reduced_error_at", {}).get(out.shape[0], error)  # {rows: error} for some shapes
            direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(self.seed))
            return out + error * out.norm() * direction / direction.norm()

        leaves = torch.utils._pytree.tree_leaves(samples[0])
        dims = tuple(frozenset({0}) for leaf in leaves if isinstance(leaf, torch.Tensor)) if dynamic else None
        return BuiltBackend(fn=fn, dynamic_dims=dims)


class Block(nn.Module):
    """A residual linear block, found by discovery through `TwoBlocks._repeated_blocks` (its class name)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class TwoBlocks(nn.Module):
    """Two `Block`s in a row: the smallest model whose blocks `enable_aitune("blocks")` finds."""

    _repeated_blocks = ["Block"]  # what discovery reads to find the blocks of a model

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
