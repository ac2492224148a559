"""What a call looked like: `InputSignature` groups calls, `Sample` keeps a call's inputs for tuning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

# Leaves whose value (not just type) is part of the signature: a backend may bake them into its graph.
_SCALAR_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and device of one tensor leaf."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape) or "scalar"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}[{dims}]@{self.device}"


@dataclass(frozen=True)
class InputSignature:
    """The structure of a call's (args, kwargs), each tensor's spec, each scalar's value, and grad mode.

    Two calls with equal signatures can be served by the same compiled artifact.
    """

    treespec: pytree.TreeSpec
    leaves: tuple[Any, ...]  # TensorSpec for tensors, the value for scalars, the type name otherwise
    grad_enabled: bool
    inference_mode: bool

    @property
    def tensor_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, TensorSpec))

    @property
    def devices(self) -> frozenset[torch.device]:
        return frozenset(spec.device for spec in self.tensor_specs)

    @property
    def has_opaque_leaves(self) -> bool:
        """True when a leaf is neither a tensor nor a plain scalar (backends cannot export those)."""
        return any(isinstance(leaf, _OpaqueLeaf) for leaf in self.leaves)

    def short(self) -> str:
        """A compact, human-readable description (used in reports)."""
        parts = [str(leaf) for leaf in self.leaves if isinstance(leaf, TensorSpec)]
        scalars = [repr(leaf) for leaf in self.leaves if not isinstance(leaf, TensorSpec | type(None))]
        text = ", ".join(parts)
        if scalars:
            text += f" | {', '.join(scalars)}"
        if self.grad_enabled:
            text += " | grad"
        return text

    def __str__(self) -> str:
        return self.short()


@dataclass(frozen=True)
class _OpaqueLeaf:
    """A leaf that is neither a tensor nor a plain scalar, identified by its type only."""

    type_name: str

    def __repr__(self) -> str:
        return f"<{self.type_name}>"


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return TensorSpec(tuple(leaf.shape), leaf.dtype, leaf.device)
    if isinstance(leaf, _SCALAR_TYPES):
        return leaf
    return _OpaqueLeaf(type(leaf).__qualname__)


def signature_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> InputSignature:
    """Compute the signature of one call."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return InputSignature(
        treespec=spec,
        leaves=tuple(_leaf_key(leaf) for leaf in leaves),
        grad_enabled=torch.is_grad_enabled(),
        inference_mode=torch.is_inference_mode_enabled(),
    )


def _tensor_bytes(leaves: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _clone_leaf(leaf: Any) -> Any:
    return leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf


@dataclass
class Sample:
    """A captured call: detached copies of its tensors, plain values as they were."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    nbytes: int

    @staticmethod
    def nbytes_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Bytes that capturing this call would copy."""
        return _tensor_bytes(pytree.tree_leaves((args, kwargs)))

    @classmethod
    def capture(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sample:
        """Detached copies of the call's tensors (so later in-place edits by the caller cannot alter them)."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        nbytes = _tensor_bytes(leaves)
        with torch.no_grad():
            cloned_args, cloned_kwargs = pytree.tree_unflatten([_clone_leaf(x) for x in leaves], spec)
        return cls(tuple(cloned_args), dict(cloned_kwargs), nbytes)

    def as_call(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The plain `(args, kwargs)` pair that backends receive."""
        return self.args, self.kwargs
