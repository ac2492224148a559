"""What a call looked like: `InputSignature` groups calls, `Sample` keeps a call's inputs for tuning; and the rules on
the modes a call runs under: the thread's (`CallContext`, grad and inference mode in the signature) and the module's
training mode (`training_reason`: such a call runs eager, unrecorded)."""

from __future__ import annotations

import copy
import enum
import functools
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from aitune_hf.backends.base import PLAIN_VALUES

# Leaves whose value (not just type) is part of the signature: a backend may bake them into its graph.
_SCALAR_TYPES = PLAIN_VALUES


class TensorSpec(NamedTuple):
    """Shape, dtype and device of one tensor leaf (a tuple: made on every routed call, cheaply)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def __str__(self) -> str:
        return _spec_text(self.shape, self.dtype, self.device)


def _spec_text(dims: Sequence[Any], dtype: torch.dtype, device: torch.device) -> str:
    """`float32[2x8x384]@cpu`: a tensor spec as reports show it (a dim may be a range such as "8..121", or `*`: left
    out of the signature, `register_object_sized`)."""
    text = "x".join("*" if d == FREE else str(d) for d in dims) or "scalar"
    return f"{str(dtype).removeprefix('torch.')}[{text}]@{device}"


#: A size left out of a signature (`register_object_sized`): it reads `*` in reports.
FREE = -1
#: Keyword arguments whose size in one dimension follows an object the call holds, by the layer that knows them
#: (`register_object_sized`, from `aitune_hf.hf`): name -> dimension.
_OBJECT_SIZED: dict[str, int] = {}


def register_object_sized(name: str, dim: int) -> None:
    """In a call that holds an object (a leaf neither a tensor nor a plain value: a KV cache), leave dimension `dim` of
    the keyword argument `name` out of the signature. An object's own sizes are not in a signature (only its type is);
    a tensor sized by it (Transformers' 2D `attention_mask`, as long as the cache plus this call's tokens) would
    otherwise make every step of a `generate()` over a padded batch a signature of its own. Only backends that accept
    objects serve such calls (`Backend.accepts_objects`): each takes any size (Dynamo's guards recompile, OpenVINO's
    shapes are dynamic), as it takes any length of the cache itself. Registered at import by the layer that knows the
    framework, before any call is routed."""
    _OBJECT_SIZED[name] = dim


#: Autocast device types a call may run under (`torch.is_autocast_enabled(device_type)`).
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


class CallContext(NamedTuple):
    """The process- and thread-wide modes a forward may compute differently under, read on every routed call (about
    1 us): autocast (per device type: its dtype, when on), the default dtype (tensors a forward creates without one),
    deterministic algorithms, and the scaled-dot-product-attention backends allowed (flash, memory-efficient, math,
    cuDNN; `torch.nn.attention.sdpa_kernel` sets them, on CPU too). Grad and inference mode are fields of
    `InputSignature` itself; training mode is module state (`training_reason`).

    A call is served only by a route built under an equal context, and a signature is tuned only in a call made under
    its own context (its replays then see the modes its calls saw)."""

    autocast: tuple[tuple[str, torch.dtype], ...]
    default_dtype: torch.dtype
    deterministic: bool
    sdpa: tuple[bool, bool, bool, bool]

    def describe(self) -> str:
        """What differs from the defaults ("" when nothing does): "autocast cpu bfloat16, deterministic"."""
        parts = [f"autocast {device} {str(dtype).removeprefix('torch.')}" for device, dtype in self.autocast]
        if self.default_dtype != torch.float32:
            parts.append(f"default dtype {str(self.default_dtype).removeprefix('torch.')}")
        if self.deterministic:
            parts.append("deterministic")
        if not all(self.sdpa):
            allowed = [name for name, on in zip(("flash", "efficient", "math", "cudnn"), self.sdpa, strict=True) if on]
            parts.append(f"sdpa {'+'.join(allowed) or 'none'}")
        return ", ".join(parts)


def autocast_modes() -> tuple[tuple[str, torch.dtype], ...]:
    """(device type, dtype) of each autocast on in this thread."""
    if not torch._C._is_any_autocast_enabled():
        return ()
    found = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                found.append((device, torch.get_autocast_dtype(device)))
        except RuntimeError:  # a device type this build of torch does not know
            continue
    return tuple(found)


def call_context() -> CallContext:
    """The modes of the current call (see `CallContext`)."""
    c = torch._C
    return CallContext(
        autocast_modes(),
        torch.get_default_dtype(),
        c._get_deterministic_algorithms(),
        (
            c._get_flash_sdp_enabled(),
            c._get_mem_efficient_sdp_enabled(),
            c._get_math_sdp_enabled(),
            c._get_cudnn_sdp_enabled(),
        ),
    )


def training_reason(module: torch.nn.Module) -> str | None:
    """Why calls of `module` are training-mode calls now, or None: the module itself is in training mode
    (`module.train()`: dropout and every `self.training` branch are live), or a dropout (p > 0) or batch/instance
    norm inside it is (its output is random, or it updates running statistics). Such calls run eager and are never
    recorded or tuned: nothing they return can be checked against eager.

    Submodules whose training flag changes nothing are ignored: peft leaves its LoRA layers in training mode after
    `load_lora_weights` (their dropout is an Identity at the default p=0), under a model in eval mode.
    """
    if module.training:
        return f"{type(module).__name__} is in training mode (module.train())"
    for name, sub in module.named_modules():
        if not sub.training:
            continue
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            return f"{name} ({type(sub).__name__}, p={sub.p:g}) is in training mode: its output is random"
        if isinstance(sub, torch.nn.modules.batchnorm._NormBase):
            return f"{name} ({type(sub).__name__}) is in training mode: it normalises by batch statistics"
    return None


@dataclass(frozen=True)
class InputSignature:
    """The structure of a call's (args, kwargs), each tensor's spec, each scalar's value, grad mode, and the modes it
    ran under (`CallContext`).

    Two calls with equal signatures can be served by the same compiled artifact.
    """

    structure: Any  # the containers around the leaves: nested (type, children) tuples, or a pytree spec
    leaves: tuple[Any, ...]  # TensorSpec for tensors, the value for scalars, the type name otherwise
    grad_enabled: bool
    inference_mode: bool
    context: CallContext

    @property
    def tensor_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, TensorSpec))

    @property
    def devices(self) -> frozenset[torch.device]:
        return frozenset(spec.device for spec in self.tensor_specs)

    @property
    def opaque_leaves(self) -> tuple[Any, ...]:
        """The leaves that are objects, not tensors or plain values (shown by type name)."""
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, _OpaqueLeaf))

    @property
    def has_opaque_leaves(self) -> bool:
        """True when a leaf is neither a tensor nor a plain scalar (backends cannot export those)."""
        return any(isinstance(leaf, _OpaqueLeaf) for leaf in self.leaves)

    @functools.cached_property
    def family(self) -> ShapeFamily:
        """What this signature shares with every call that differs from it only in tensor sizes."""
        return ShapeFamily(
            self.structure,
            tuple(_rank_of(leaf) if isinstance(leaf, TensorSpec) else leaf for leaf in self.leaves),
            self.grad_enabled,
            self.inference_mode,
            self.context,
        )

    def short(self) -> str:
        """A compact, human-readable description (used in reports)."""
        parts = [str(leaf) for leaf in self.leaves if isinstance(leaf, TensorSpec)]
        scalars = [repr(leaf) for leaf in self.leaves if not isinstance(leaf, TensorSpec | type(None))]
        text = ", ".join(parts)
        if scalars:
            text += f" | {', '.join(scalars)}"
        if self.grad_enabled:
            text += " | grad"
        context = self.context.describe()
        if context:
            text += f" | {context}"
        return text

    def __str__(self) -> str:
        return self.short()


class _Rank(NamedTuple):
    """A tensor leaf of a shape family: its rank, dtype and device; its sizes may vary."""

    rank: int
    dtype: torch.dtype
    device: torch.device


def _rank_of(spec: TensorSpec) -> _Rank:
    return _Rank(len(spec.shape), spec.dtype, spec.device)


class ShapeFamily(NamedTuple):
    """Signatures equal in everything but the sizes of tensor dimensions: one polymorphic build may serve them."""

    structure: Any
    leaves: tuple[Any, ...]
    grad_enabled: bool
    inference_mode: bool
    context: CallContext


def describe_family(signatures: Sequence[InputSignature]) -> str:
    """Like `InputSignature.short`, with each size that differs across `signatures` as its range ("6..130")."""
    first = signatures[0]
    if len(signatures) == 1:
        return first.short()
    specs = [signature.tensor_specs for signature in signatures]
    parts = []
    for index, spec in enumerate(first.tensor_specs):
        dims = []
        for dim in range(len(spec.shape)):
            sizes = {other[index].shape[dim] for other in specs}
            dims.append(spec.shape[dim] if len(sizes) == 1 else f"{min(sizes)}..{max(sizes)}")
        parts.append(_spec_text(dims, spec.dtype, spec.device))
    text = ", ".join(parts)
    rest = first.short().partition(" | ")[2]
    return f"{text} | {rest} ({len(signatures)} shapes)" if rest else f"{text} ({len(signatures)} shapes)"


def covers(reference: InputSignature, dynamic_dims: Sequence[frozenset[int]], signature: InputSignature) -> bool:
    """True when `signature` (of `reference`'s family) differs from `reference` only in dimensions that
    `dynamic_dims` (per tensor leaf) leaves free."""
    for ref, spec, free in zip(reference.tensor_specs, signature.tensor_specs, dynamic_dims, strict=True):
        for dim, (a, b) in enumerate(zip(ref.shape, spec.shape, strict=True)):
            if a != b and dim not in free:
                return False
    return True


def same_unit_dims(reference: InputSignature, signature: InputSignature) -> bool:
    """True when `signature` (of `reference`'s family) has size 1 in exactly the dimensions where `reference` has: a
    batch of one and a batch of 32 are not alike here (what serves one best may not serve the other), a batch of 32 and
    one of 8 are, as a polymorphic export sees them (it keeps sizes 0 and 1 fixed)."""
    for ref, spec in zip(reference.tensor_specs, signature.tensor_specs, strict=True):
        if [size <= 1 for size in ref.shape] != [size <= 1 for size in spec.shape]:
            return False
    return True


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
    """Compute the signature of one call (every routed call does: this is on the hot path)."""
    leaves: list[Any] = []
    structure = (_structure(args, leaves), _structure(kwargs, leaves))
    keys = [_leaf_key(leaf) for leaf in leaves]
    if _OBJECT_SIZED and not _OBJECT_SIZED.keys().isdisjoint(kwargs) and any(type(k) is _OpaqueLeaf for k in keys):
        _free_object_sized(kwargs, leaves, keys)
    return InputSignature(
        structure=structure,
        leaves=tuple(keys),
        grad_enabled=torch.is_grad_enabled(),
        inference_mode=torch.is_inference_mode_enabled(),
        context=call_context(),
    )


def _free_object_sized(kwargs: dict[str, Any], leaves: list[Any], keys: list[Any]) -> None:
    """`register_object_sized`: each registered keyword argument that is a tensor leaf of this call has its registered
    dimension set to `FREE` in its spec (`keys`, in place)."""
    for name, dim in _OBJECT_SIZED.items():
        value = kwargs.get(name)
        if not isinstance(value, torch.Tensor) or not -value.dim() <= dim < value.dim():
            continue
        index = next((i for i, leaf in enumerate(leaves) if leaf is value), None)
        if index is not None:
            spec = keys[index]
            shape = list(spec.shape)
            shape[dim] = FREE
            keys[index] = TensorSpec(tuple(shape), spec.dtype, spec.device)


def _structure(value: Any, leaves: list[Any]) -> Any:
    """The containers around `value`'s leaves (appended to `leaves` in pytree order), as a hashable description.

    Plain tuples, lists and dicts, the containers of nearly every call, are walked here, several times faster than
    `pytree.tree_flatten`; any other registered pytree node (a namedtuple, a `ModelOutput`) gets pytree's own spec.
    """
    kind = type(value)
    if kind is tuple or kind is list:
        return (kind, tuple([_structure(item, leaves) for item in value]))
    if kind is dict:
        return (dict, tuple([(key, _structure(item, leaves)) for key, item in value.items()]))
    if kind in pytree.SUPPORTED_NODES:
        inner, spec = pytree.tree_flatten(value)
        leaves.extend(inner)
        return spec
    leaves.append(value)
    return None


def _tensor_bytes(leaves: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


#: What a faithful snapshot may hold: deepcopy copies tensors and containers exactly, and keeps these by reference.
_SHARED_IN_COPIES = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, enum.Enum)
_MAX_NODES = 100_000
#: Leaves copied as values (tensors cloned); every other leaf is an object input.
_VALUE_LEAVES = (torch.Tensor, *_SCALAR_TYPES)


def unreplayable_reason(obj: Any) -> str | None:
    """Why `obj` (an input that is not a tensor or a plain value) cannot be snapshotted faithfully, or None.

    A faithful snapshot is a `copy.deepcopy` that shares nothing mutable with the user's object: the object
    graph may hold tensors, plain values, containers, generators and plain objects (a Transformers `Cache`),
    but no `nn.Module` (a copy would duplicate weights and drop hooks) and nothing deepcopy cannot copy.
    """
    stack, seen = [obj], set()
    while stack:
        value = stack.pop()
        if id(value) in seen or isinstance(value, (*_SCALAR_TYPES, *_SHARED_IN_COPIES, torch.Tensor, torch.Generator)):
            continue
        seen.add(id(value))
        if len(seen) > _MAX_NODES:
            return f"{type(obj).__name__} is too large to snapshot"
        if isinstance(value, torch.nn.Module):
            return f"{type(obj).__name__} holds a module ({type(value).__name__}); it cannot be snapshotted"
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list | tuple | set | frozenset):
            stack.extend(value)
        elif hasattr(value, "__dict__") or hasattr(value, "__slots__"):
            state = dict(getattr(value, "__dict__", {}))
            for slot in getattr(type(value), "__slots__", ()):
                if hasattr(value, slot):
                    state[slot] = getattr(value, slot)
            stack.extend(state.values())
        else:
            return f"{type(obj).__name__} holds a {type(value).__name__}, which cannot be snapshotted"
    return None


def state_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors inside an object input, in a deterministic order: what a call's side effects changed."""
    found: list[torch.Tensor] = []
    stack, seen = [obj], set()
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
            continue
        if id(value) in seen or isinstance(value, (*_SCALAR_TYPES, *_SHARED_IN_COPIES, torch.Generator)):
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, list | tuple):
            stack.extend(reversed(value))
        elif hasattr(value, "__dict__"):
            stack.extend(reversed(list(vars(value).values())))
    return found


def _clone_leaf(leaf: Any) -> Any:
    """A copy of a tensor with its exact layout (strides, stride-0 broadcast dims), so that a backend built and
    timed on recorded calls sees the layout the real calls have (Inductor specialises on strides)."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    leaf = leaf.detach()
    if leaf.numel() == 0 or leaf.is_contiguous() or leaf.is_contiguous(memory_format=torch.channels_last):
        return leaf.clone(memory_format=torch.preserve_format)
    # Strided or broadcast: new storage just large enough for the same strides; copy only the stored elements
    # (a stride-0 dimension is stored once, so it is written through one index of it).
    extent = 1 + sum((size - 1) * stride for size, stride in zip(leaf.shape, leaf.stride(), strict=True))
    copy_ = torch.empty(extent, dtype=leaf.dtype, device=leaf.device).as_strided(leaf.shape, leaf.stride())
    source, target = leaf, copy_
    for dim, stride in enumerate(leaf.stride()):
        if stride == 0:
            source, target = source.narrow(dim, 0, 1), target.narrow(dim, 0, 1)
    target.copy_(source)
    return copy_


@dataclass
class Sample:
    """A captured call: detached copies of its tensors, plain values as they were, snapshots of objects.

    Object inputs (a Transformers `Cache`, a generator) are snapshotted when the call is captured, and every
    replay (`as_call`) gets a fresh copy of the snapshot: tuning never touches the object the user holds, and
    each replay starts from the state the real call saw. `unreplayable` says why a call cannot be replayed at
    all (it held an object that cannot be copied faithfully); such a sample is never run.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    nbytes: int
    stateful: bool = False
    unreplayable: str | None = None

    @classmethod
    def capture(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sample:
        """Copy the call's inputs so that later edits by the caller cannot alter them."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        objects = [leaf for leaf in leaves if not isinstance(leaf, _VALUE_LEAVES)]
        nbytes = _tensor_bytes(leaves) + sum(_tensor_bytes(state_tensors(obj)) for obj in objects)
        reason = next((r for r in map(unreplayable_reason, objects) if r is not None), None)
        if reason is not None:
            return cls((), {}, 0, stateful=True, unreplayable=reason)
        with torch.no_grad():
            memo: dict[int, Any] = {}  # one memo: an object passed twice stays one object in the snapshot
            copied = [
                _clone_leaf(leaf) if isinstance(leaf, torch.Tensor) else copy.deepcopy(leaf, memo) for leaf in leaves
            ]
            cloned_args, cloned_kwargs = pytree.tree_unflatten(copied, spec)
        return cls(tuple(cloned_args), dict(cloned_kwargs), nbytes, stateful=bool(objects))

    def as_call(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The plain `(args, kwargs)` pair that backends receive; object inputs are fresh copies each time."""
        if self.unreplayable is not None:
            raise RuntimeError(f"this call cannot be replayed: {self.unreplayable}")
        if not self.stateful:
            return self.args, self.kwargs
        leaves, spec = pytree.tree_flatten((self.args, self.kwargs))
        memo: dict[int, Any] = {}
        with torch.no_grad():
            fresh = [leaf if isinstance(leaf, _VALUE_LEAVES) else copy.deepcopy(leaf, memo) for leaf in leaves]
        args, kwargs = pytree.tree_unflatten(fresh, spec)
        return tuple(args), dict(kwargs)

    def objects_of(self, call: tuple[tuple[Any, ...], dict[str, Any]]) -> list[Any]:
        """The object inputs of a call made by `as_call` (whose side effects a check compares)."""
        if not self.stateful:
            return []
        return [leaf for leaf in pytree.tree_leaves(call) if not isinstance(leaf, _VALUE_LEAVES)]


def layout_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The memory layout of each tensor of a call, in pytree order: "c" (contiguous), "cl" (channels-last), "cl3d",
    or its strides. Not part of the signature (every backend takes any layout: ONNX Runtime copies to contiguous,
    Inductor specialises), but of the cache key: an export's or compile's outcome may depend on it."""
    kinds = []
    for leaf in pytree.tree_leaves((args, kwargs)):
        if not isinstance(leaf, torch.Tensor):
            continue
        if leaf.is_contiguous():
            kinds.append("c")
        elif leaf.dim() == 4 and leaf.is_contiguous(memory_format=torch.channels_last):
            kinds.append("cl")
        elif leaf.dim() == 5 and leaf.is_contiguous(memory_format=torch.channels_last_3d):
            kinds.append("cl3d")
        else:
            kinds.append("s" + "/".join(map(str, leaf.stride())))
    return ",".join(kinds)
