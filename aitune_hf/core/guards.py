"""Guards: what a built backend depends on besides its inputs, checked cheaply on every call it serves.

Modelled on Dynamo's guards (``torch/_dynamo/guards.py``), which check, before running compiled code, that
every Python value the trace read is as it was (``ID_MATCH`` / ``EQUALS_MATCH`` on module attributes,
``TENSOR_MATCH`` on tensors). Dynamo guards only what its trace read; we do not trace, so a guard covers
everything the forward *could* read:

- **Module state.** The ``__dict__`` of every submodule of the target: plain values (numbers, strings,
  bools, None, enums, dtypes, devices, and containers of these) by value, any other object by identity.
  Containers are copied when the guard is made, so an in-place edit (peft's ``scaling[adapter] *= s``)
  is seen. Objects that are not modules (an attention processor, a config) are guarded by identity *and*
  by their own ``__dict__``, two levels deep.
- **Structure.** ``_modules``, ``_parameters`` and ``_buffers`` sit in each submodule's ``__dict__`` and are
  copied like any container: a child added, removed or replaced, or a Parameter re-assigned, is seen.
- **Weight values,** only for a backend that baked them (``BuiltBackend.bakes_weights``): one guard holds a
  weight-value check of `core/weights.py` (sampled, or every tensor's L2 norm with ``weight_check="full"``).
  A backend that keeps the weights live (Inductor without freezing, ONNX Runtime with weights as inputs)
  needs no value check: it reads the current tensors on every call.

One walk of the module state builds the guard list (`ModuleGuard.guards`), by kind (`GuardKind`: structure, state,
hook, weights), each guard with its own fail reason, as Dynamo's guard builder does. The per-call check, the
explanation of a failure (`ModuleGuard.failed`) and the state fingerprint of the cache key (`ModuleGuard.text`, read
by `core.keys.state_fingerprint`) all read that list. The per-call check is one C-level comparison of a tuple of
live dicts with a tuple of their snapshots (what the list's structure, state and hook guards compare, all at once);
the slow path, which names the first failing guard, runs only when that comparison fails.

The core names no framework: the hook attributes a framework keeps on a module (Accelerate's, Diffusers') are
registered by the layer that knows them (`register_hook_attributes`, called from `aitune_hf.hf`).

Blind spots (documented in docs/guarantees.md): state outside the target's submodules (globals, class
attributes), objects more than two levels below a module attribute, mutation of a plain tensor attribute
that is neither a parameter nor a buffer, and the weight-value checks' own (`core/weights.py`).
"""

from __future__ import annotations

import abc
import copy
import enum
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from aitune_hf.core.weights import WeightCheck, make_check

#: Leaves compared by value.
_PLAIN = (bool, int, float, complex, str, bytes, type(None), enum.Enum, torch.dtype, torch.device, torch.layout)
#: Containers copied (element-wise frozen) so that in-place edits are seen; larger ones are guarded by identity.
_MAX_CONTAINER = 4096
#: How deep below a module attribute non-module objects are guarded by their own state.
_OBJECT_DEPTH = 2
#: Objects guarded by identity only: code, types, tensors, modules (guarded through `modules()`), locks.
_OPAQUE = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    type,
    torch.Tensor,
    torch.nn.Module,
    torch.Generator,
    weakref.ref,
    type(threading.Lock()),
)


#: Attributes of the target module itself that are call plumbing *around* its forward, not state it reads: the
#: forward slot (where the router sits) and torch's module hooks, which run outside the router; and the hooks that
#: frameworks keep on a module, registered by the layer that knows them (`register_hook_attributes`): offload hooks
#: re-applied between calls change them every call. Inside the target they are guarded like everything else (a
#: backend traced through them).
_TORCH_PLUMBING = frozenset(
    {
        "forward",
        "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
        "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
        "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook",
        "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
    }
)  # fmt: skip
#: Hook attributes a framework keeps on a module (`register_hook_attributes`), besides `forward`.
_FRAMEWORK_HOOKS: set[str] = set()


def register_hook_attributes(*names: str) -> None:
    """Treat module attributes called `names` as hook plumbing (a framework's per-module hook, the forward it saved):
    left out on the target itself, compared by type inside it, and out of the state fingerprint. Registered at import
    by the layer that knows the framework (`aitune_hf.hf`), before any guard is made."""
    _FRAMEWORK_HOOKS.update(names)


def root_plumbing() -> frozenset[str]:
    """Attributes of the target module that are plumbing around its forward (not guarded there)."""
    return _TORCH_PLUMBING | _FRAMEWORK_HOOKS


def hook_keys() -> frozenset[str]:
    """Hook attributes inside the target: re-dispatching replaces each hook by an equal one, so they are compared by
    type, not identity (Accelerate's per-module hooks under a `device_map`, Diffusers' registries)."""
    return frozenset({"forward"}) | _FRAMEWORK_HOOKS


class _Without:
    """A live dict seen without some keys: compares equal to a snapshot taken without them."""

    __slots__ = ("keys", "live")

    def __init__(self, live: dict[str, Any], keys: frozenset[str]) -> None:
        self.live, self.keys = live, keys

    def view(self) -> dict[str, Any]:
        return {k: v for k, v in self.live.items() if k not in self.keys}

    def __eq__(self, other: object) -> bool:
        return other == self.view()  # the snapshot on the left: its own __eq__ (tensor slots) decides

    __hash__ = None  # type: ignore[assignment]


def _is_opaque(value: Any) -> bool:
    return isinstance(value, _OPAQUE) or getattr(type(value), "_aitune_guard_opaque", False)


class _TensorSlot:
    """The snapshot of a parameter or buffer in its module's table: shape, dtype and device type, not identity.

    Model CPU offload moves weights (`.to()`) on every call, which re-assigns buffers and `.data` with equal
    values; that must not fail the guard. Values are the weight check's job (baked backends), and a backend
    with live weights reads whatever tensor is there.
    """

    __slots__ = ("device_type", "dtype", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype, self.device_type = tensor.shape, tensor.dtype, tensor.device.type

    def __eq__(self, other: object) -> bool:
        if other is None:
            return False
        return (
            isinstance(other, torch.Tensor)
            and other.shape == self.shape
            and other.dtype == self.dtype
            and other.device.type == self.device_type
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}@{self.device_type}"


class _SameType:
    """The snapshot of a hook attribute: any value of the same type compares equal."""

    __slots__ = ("kind",)

    def __init__(self, value: Any) -> None:
        self.kind = type(value)

    def __eq__(self, other: object) -> bool:
        return type(other) is self.kind

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"a {self.kind.__name__}"


_TABLES = ("_parameters", "_buffers")


def _matches(slot: _TensorSlot | None, value: Any) -> bool:
    """Whether a table entry still fits its slot (None stays None)."""
    return value is None if slot is None else slot == value


def _freeze_state(state: dict[str, Any], hooks: frozenset[str]) -> dict[str, Any]:
    """The snapshot of an object's `__dict__`; a module's hook attributes (`hooks`) keep their types. Its parameter and
    buffer tables keep the tensors themselves (compared by identity on the fast path; `ModuleGuard` accepts
    a re-assigned tensor of the same shape, dtype and device type, and then takes it as the new snapshot)."""
    frozen = _freeze(state)
    if "_parameters" in state:  # a module
        for key in hooks & state.keys():
            frozen[key] = _SameType(state[key])
    return frozen


def _freeze(value: Any) -> Any:
    """A snapshot of `value` that compares equal to it while it is unchanged (plain by value, objects by id)."""
    if isinstance(value, _PLAIN):
        return value
    kind = type(value)
    if kind in (list, tuple, set, frozenset) and len(value) <= _MAX_CONTAINER:
        return kind(_freeze(item) for item in value)
    if isinstance(value, dict) and len(value) <= _MAX_CONTAINER:
        try:
            frozen = copy.copy(value)  # keeps the dict subclass (OrderedDict compares in order)
            for key, item in value.items():
                frozen[key] = _freeze(item)
            return frozen
        except Exception:  # a dict subclass that cannot be copied: identity
            return value
    return value  # identity: `==` falls back to `is` for objects without __eq__


def _objects_in(value: Any, depth: int = 0) -> Iterator[Any]:
    """Non-module objects referenced from `value` (through containers) whose own state is guarded."""
    if isinstance(value, _PLAIN) or depth > 2:
        return
    if isinstance(value, list | tuple | set | frozenset) and len(value) <= _MAX_CONTAINER:
        for item in value:
            yield from _objects_in(item, depth + 1)
    elif isinstance(value, dict) and len(value) <= _MAX_CONTAINER:
        for item in value.values():
            yield from _objects_in(item, depth + 1)
    elif not _is_opaque(value) and isinstance(getattr(value, "__dict__", None), dict):
        yield value


class GuardKind(str, enum.Enum):
    """What a guard checks (as Dynamo's guard builder sorts its guards)."""

    STRUCTURE = "structure"  # an object's attribute names, a module's children, its parameter and buffer tables
    STATE = "state"  # one attribute: plain values by value, objects by identity, containers element-wise
    HOOK = "hook"  # a framework's hook attribute inside the target: by type
    WEIGHTS = "weights"  # the values of baked weights

    def __str__(self) -> str:
        return self.value


class _Owner:
    """An object whose `__dict__` is guarded (a submodule of the target, or an object below one): its live dict, the
    snapshot, and the attribute names it was reached through (`keys`)."""

    __slots__ = ("depth", "frozen", "keys", "live", "obj", "path")

    def __init__(self, path: str, obj: Any, depth: int, keys: tuple[str, ...], root_plumbing: frozenset[str] | None,
                 hooks: frozenset[str]) -> None:  # fmt: skip
        self.path, self.obj, self.depth, self.keys = path, obj, depth, keys
        state = vars(obj)
        self.live: dict[str, Any] | _Without = state if root_plumbing is None else _Without(state, root_plumbing)
        self.frozen = _freeze_state(state if root_plumbing is None else self.live.view(), hooks)  # type: ignore[union-attr]

    @property
    def where(self) -> str:
        return self.path or "<target>"

    def view(self) -> dict[str, Any]:
        return self.live.view() if isinstance(self.live, _Without) else self.live

    def text(self) -> Iterator[str]:
        yield f"\n{self.path}:{_type_name(self.obj)}"


class Guard(abc.ABC):
    """One thing a built backend depends on, with its own fail reason (`failure`) and its text in the state
    fingerprint (`text`: none for what the fingerprint leaves out)."""

    __slots__ = ("kind",)

    def __init__(self, kind: GuardKind) -> None:
        self.kind = kind

    @abc.abstractmethod
    def failure(self) -> str | None:
        """None while this guard holds; else what changed."""

    def text(self, left_out: frozenset[str]) -> Iterator[str]:
        """Lines of the state fingerprint, the same in every process (`core.keys.state_fingerprint`)."""
        return iter(())


class _Names(Guard):
    """The attribute names of an owner: none added, none removed."""

    __slots__ = ("owner",)

    def __init__(self, owner: _Owner) -> None:
        super().__init__(GuardKind.STRUCTURE)
        self.owner = owner

    def failure(self) -> str | None:
        frozen, live = self.owner.frozen, self.owner.view()
        for key in sorted(frozen.keys() - live.keys()):
            return f"{self.owner.where}.{key} was removed"
        for key in sorted(live.keys() - frozen.keys()):
            return f"{self.owner.where}.{key} was added ({_short(live[key])})"
        return None


class _Table(Guard):
    """A parameter or buffer table: the same names, each tensor of the same shape, dtype and device type."""

    __slots__ = ("name", "owner", "slots", "table")

    def __init__(self, owner: _Owner, name: str) -> None:
        super().__init__(GuardKind.STRUCTURE)
        self.owner, self.name = owner, name
        self.table = vars(owner.obj)[name]  # the live table when the guard was made (what `_retake` compares)
        self.slots = {k: None if t is None else _TensorSlot(t) for k, t in self.table.items()}

    def failure(self) -> str | None:
        live = self.owner.view().get(self.name)
        if not isinstance(live, dict):
            return None  # the attribute itself went: `_Names` or `_Value` says so
        where = self.owner.where
        added, removed = sorted(live.keys() - self.slots.keys()), sorted(self.slots.keys() - live.keys())
        if added or removed:
            return f"{where}.{self.name} changed: added {added}, removed {removed}"
        for name, slot in self.slots.items():
            if not _matches(slot, live.get(name)):
                return f"{where}.{name} changed to {_short(live.get(name))} (was {slot!r})"
        return None

    def retake(self) -> bool | None:
        """Accept tensors re-assigned with the same shape, dtype and device type (model CPU offload's `.to()` on every
        call) as the new snapshot: True when it did, None when nothing moved, False when the table really changed."""
        frozen, live = self.owner.frozen, self.table
        if frozen[self.name].keys() == live.keys() and all(frozen[self.name][k] is v for k, v in live.items()):
            return None
        if live.keys() != self.slots.keys() or not all(_matches(slot, live[k]) for k, slot in self.slots.items()):
            return False
        frozen[self.name] = dict(live)
        return True

    def text(self, left_out: frozenset[str]) -> Iterator[str]:
        for name, tensor in self.owner.frozen[self.name].items():
            spec = "None" if tensor is None else f"{tuple(tensor.shape)}{tensor.dtype}{_layout_mark(tensor)}"
            yield f"\n{self.owner.path}.{name}={spec}"


class _Value(Guard):
    """One attribute of an owner, as snapshotted (`_freeze`): plain values by value, objects by identity, hooks by
    type. In the fingerprint when it is state (not structure or a hook) of an owner less than `_OBJECT_DEPTH` deep."""

    __slots__ = ("key", "owner")

    def __init__(self, owner: _Owner, key: str, kind: GuardKind) -> None:
        super().__init__(kind)
        self.owner, self.key = owner, key

    def failure(self) -> str | None:
        live = self.owner.view()
        if self.key not in live:
            return None  # `_Names` says it was removed
        change = _difference(self.owner.frozen[self.key], live[self.key])
        return None if change is None else f"{self.owner.where}.{self.key} {change}"

    def text(self, left_out: frozenset[str]) -> Iterator[str]:
        if self.kind is GuardKind.STATE and self.owner.depth < _OBJECT_DEPTH and self.key not in left_out:
            yield f"\n{self.owner.path}.{self.key}={_stable(self.owner.frozen[self.key], left_out)}"


class _Weights(Guard):
    """The values of the weights a backend baked (`core.weights`: sampled, or in full with `weight_check="full"`)."""

    __slots__ = ("check",)

    def __init__(self, check: WeightCheck) -> None:
        super().__init__(GuardKind.WEIGHTS)
        self.check = check

    def failure(self) -> str | None:
        try:
            return self.check.explain()
        except Exception as error:  # a tensor went to the meta device, or cannot be read
            return f"baked weights could not be read back ({type(error).__name__}: {error})"


class ModuleGuard:
    """Everything a backend built for `module` depends on, besides its inputs; `check()` runs per call.

    The guard list (`guards`) is built once, in one walk of the module state, by kind (`GuardKind`), each guard with
    its own fail reason; the per-call check, the explanation of a failure and the state fingerprint
    (`core.keys.state_fingerprint`) all read that one list, so they cannot disagree on what is guarded. The per-call
    fast path compares all owners' live dicts with their snapshots at once (one C-level comparison), which is what
    the list's structure, state and hook guards compare one by one.

    Args:
        module: the target module.
        weights: also verify the values of every parameter and buffer (for a backend that baked them).
        weight_check: "sampled" (spread samples and version counters) or "full" (every tensor's norm, every call).
    """

    def __init__(self, module: torch.nn.Module, weights: bool = False, weight_check: str = "sampled") -> None:
        plumbing, hooks = root_plumbing(), hook_keys()
        owners: list[_Owner] = []
        guards: list[Guard] = []
        order: list[_Owner | Guard] = []  # the walk, owners included: the fingerprint's order
        seen: set[int] = set()

        def add(path: str, obj: Any, depth: int, keys: tuple[str, ...]) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            owner = _Owner(path, obj, depth, keys, plumbing if obj is module else None, hooks)
            owners.append(owner)
            order.append(owner)
            guards.append(_Names(owner))
            for name in _TABLES:
                if isinstance(vars(obj).get(name), dict):
                    table = _Table(owner, name)
                    guards.append(table)
                    order.append(table)
            for key in sorted(owner.frozen):
                if key in _TABLES and isinstance(vars(obj).get(key), dict):
                    continue  # its `_Table` guard
                if key in ("_modules", *_TABLES):
                    kind = GuardKind.STRUCTURE
                elif isinstance(owner.frozen[key], _SameType):
                    kind = GuardKind.HOOK
                else:
                    kind = GuardKind.STATE
                value = _Value(owner, key, kind)
                guards.append(value)
                order.append(value)
                if kind is GuardKind.STATE and depth < _OBJECT_DEPTH:
                    for inner in _objects_in(vars(obj)[key]):
                        add(f"{path}.{key}" if path else key, inner, depth + 1, (*keys, key))

        for name, sub in module.named_modules(remove_duplicate=False):
            add(name, sub, 0, ())
        if weights:
            guards.append(_Weights(make_check(module, weight_check)))
        self.guards: tuple[Guard, ...] = tuple(guards)
        self._order = tuple(order)
        self._live = tuple(owner.live for owner in owners)
        self._frozen = tuple(owner.frozen for owner in owners)
        self._tables = tuple(guard for guard in guards if isinstance(guard, _Table))
        self._weights = guards[-1].check if weights else None  # type: ignore[attr-defined]

    @property
    def weights(self) -> WeightCheck | None:
        """The weight-value check (`holds()`, `places`: the tensors it reads), or None where the backend's weights
        stay live inputs and are not checked by value."""
        return self._weights

    @property
    def guarded_dicts(self) -> int:
        """How many attribute dicts the per-call fast path compares: one per owner (a module, or an object its state
        reaches)."""
        return len(self._live)

    def state_holds(self) -> bool:
        """The per-call fast path's state part alone: every owner's live dict equals its snapshot (structure, state and
        hooks; no weight values, no re-take of moved tables). `check()` is what serving asks."""
        return self._frozen == self._live

    def check(self) -> str | None:
        """None while everything holds; else the fail reason of the first guard of the list that fails."""
        for attempt in range(2):
            try:
                # Snapshots on the left: dict comparison calls the left value's __eq__ first.
                if self._frozen == self._live and (self._weights is None or self._weights.holds()):
                    return None
            except Exception:  # a tensor compared with another: not the same object
                pass
            if attempt == 0 and not self._retake_tables():
                break
        return self.explain()

    def _retake_tables(self) -> bool:
        """Accept parameters and buffers re-assigned with the same shape, dtype and device type (model CPU
        offload's `.to()` on every call) as the new snapshot. False when a table really changed."""
        moved = False
        for table in self._tables:
            retaken = table.retake()
            if retaken is False:
                return False
            moved = moved or bool(retaken)
        return moved

    def failed(self) -> tuple[Guard, str] | None:
        """The first guard of the list that fails, with its reason; None when every one holds."""
        for guard in self.guards:
            reason = guard.failure()
            if reason is not None:
                return guard, reason
        return None

    def explain(self) -> str:
        """What changed: the first failing guard's reason ("module state changed" when none names it)."""
        failed = self.failed()
        return failed[1] if failed is not None else "module state changed"

    def text(self, left_out: frozenset[str] = frozenset()) -> Iterator[str]:
        """The state fingerprint's lines, in the order of the walk: each owner's path and class, then its guards'
        lines. What the fingerprint leaves out: weight values, structure and hook guards (their owners' paths and
        classes stand for them), state of objects `_OBJECT_DEPTH` deep, and attributes named in `left_out` (with
        the objects reached through them)."""
        for item in self._order:
            owner = item if isinstance(item, _Owner) else item.owner  # type: ignore[attr-defined]
            if left_out and any(key in left_out for key in owner.keys):
                continue
            yield from item.text() if isinstance(item, _Owner) else item.text(left_out)


def _difference(old: Any, new: Any) -> str | None:
    """How `new` differs from the snapshot `old`, or None when equal."""
    if old is new:
        return None
    if isinstance(old, _SameType):
        return None if old == new else f"was replaced ({old!r} -> a {type(new).__name__})"
    if isinstance(old, dict) and isinstance(new, dict):
        if old.keys() != new.keys():
            added, removed = sorted(map(str, new.keys() - old.keys())), sorted(map(str, old.keys() - new.keys()))
            parts = [f"added {added}" if added else "", f"removed {removed}" if removed else ""]
            return "changed: " + ", ".join(p for p in parts if p)
        for key in old:
            inner = _difference(old[key], new[key])
            if inner is not None:
                return f"[{key!r}] {inner}"
        return None
    try:
        if type(old) is type(new) and bool(old == new):
            return None
    except Exception:
        pass
    if isinstance(old, _PLAIN) or type(old) in (list, tuple, set, frozenset):
        return f"changed: {_short(old)} -> {_short(new)}"
    return f"was replaced ({type(old).__name__} -> {type(new).__name__})"


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, _PLAIN) or type(value) in (list, tuple, dict) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


# -- the fingerprint's text: the same in every process -----------------------------------------------------------------


def _layout_mark(tensor: torch.Tensor) -> str:
    """ "" for a contiguous tensor, else its strides: weights in another memory format (`module.to(memory_format=
    torch.channels_last)`) export and compile differently, so they are another cache entry."""
    return "" if tensor.is_contiguous() else f"@{tensor.stride()}"


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _stable(value: Any, left_out: frozenset[str], depth: int = 0) -> str:
    """`value` as text that does not depend on the process (no addresses): plain values by repr, containers
    element-wise (dict keys in `left_out` left out), tensors by dtype and shape, functions by qualified name, any other
    object by its type."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if depth < 4 and isinstance(value, list | tuple | set | frozenset) and len(value) <= _MAX_CONTAINER:
        items = [_stable(item, left_out, depth + 1) for item in value]
        return f"{type(value).__name__}[{', '.join(sorted(items) if isinstance(value, set | frozenset) else items)}]"
    if depth < 4 and isinstance(value, dict) and len(value) <= _MAX_CONTAINER:
        items = sorted(
            f"{_stable(k, left_out, depth + 1)}: {_stable(v, left_out, depth + 1)}"
            for k, v in value.items()
            if k not in left_out
        )
        return f"{type(value).__name__}{{{', '.join(items)}}}"
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}{value.dtype}"
    if isinstance(value, types.FunctionType | types.MethodType | types.BuiltinFunctionType):
        return f"function {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '?')}"
    if isinstance(value, type):
        return f"type {value.__module__}.{value.__qualname__}"
    return f"object {_type_name(value)}"
