"""Copies of a tuned object: `copy.copy`, `copy.deepcopy`, pickle and `torch.save` give the concrete class, untuned.

The dynamic aitune subclass (`hf/loading.py`) cannot be imported by name, and the Registration (targets, built
backends, ONNX Runtime sessions) must never serve a copy; the forward routers in the modules reduce to the eager
forwards. A reduction whose form cannot be rewritten safely raises `UsageError` naming `disable_aitune()`. The
mixin's `__reduce_ex__`, `__copy__` and `__deepcopy__` delegate here.
"""

from __future__ import annotations

import copy
import copyreg
import types
from typing import Any

from aitune_hf.errors import UsageError

#: The dynamic subclass made for each concrete class (`hf.loading.with_aitune` fills it).
SUBCLASSES: dict[type, type] = {}

#: What copies leave out of an object's state: the live registration.
OWN = frozenset({"_aitune_state"})

COPY_HINT = (
    "aitune_hf cannot copy or pickle this object untuned ({what}): call disable_aitune() first, or copy and "
    "pickle the components themselves"
)


def is_dynamic_class(cls: Any) -> bool:
    """True for a subclass made by `with_aitune` (not importable under its name)."""
    return any(cls is subclass for subclass in SUBCLASSES.values())


def concrete_class(cls: type) -> type:
    """The class that copies and pickles of a `cls` object get: `cls` without the dynamic aitune subclass."""
    while is_dynamic_class(cls):
        cls = cls.__bases__[0]
    return cls


def reduce_ex(self: Any, protocol: Any, own_reduce: Any) -> Any:
    """`__reduce_ex__` of a tuned object: the concrete class's reduction, untuned (`untuned_reduce`)."""
    *reduced, setter = untuned_reduce(self, protocol, own_reduce)
    return (*reduced, setter) if setter is not None else tuple(reduced)


def reconstruct(self: Any, memo: dict[int, Any] | None, own_reduce: Any) -> Any:
    """What `copy` does with a reduction (deep when `memo` is given), from the untuned reduction."""
    *reduced, setter = untuned_reduce(self, 4, own_reduce)
    if setter is not None:  # copy's reconstruction takes no state setter
        raise UsageError(COPY_HINT.format(what=f"a state setter from {type(self).__qualname__}"))
    return copy._reconstruct(self, memo, *reduced)  # type: ignore[attr-defined]


def untuned_reduce(self: Any, protocol: Any, own_reduce: Any) -> tuple[Any, ...]:
    """The concrete class's reduction (6 items, padded with None), rewritten to name the concrete class
    and to leave out `_aitune_state`."""
    cls = type(self)
    concrete = concrete_class(cls)
    reducer = getattr(concrete, "__reduce_ex__", None)
    if reducer is None or reducer is own_reduce:
        reduced = object.__reduce_ex__(self, protocol)
    else:
        reduced = reducer(self, protocol)
    if not isinstance(reduced, tuple) or not 2 <= len(reduced) <= 6:
        raise UsageError(COPY_HINT.format(what=f"a reduction of the form {type(reduced).__name__}"))
    func, args, state, listitems, dictitems, setter = reduced + (None,) * (6 - len(reduced))

    def swap(value: Any) -> Any:
        return concrete_class(value) if isinstance(value, type) and is_dynamic_class(value) else value

    if not isinstance(args, tuple):
        raise UsageError(COPY_HINT.format(what=f"reduction arguments of type {type(args).__name__}"))
    func, args = swap(func), tuple(swap(arg) for arg in args)
    newobj_ex = getattr(copyreg, "__newobj_ex__", None)
    if func in (copyreg.__newobj__, newobj_ex) and args and isinstance(args[0], type):
        # pickle insists that __newobj__'s class is the object's own class; `object.__new__(concrete)` is
        # what __newobj__ would do, through the reconstructor that any plain Python can load.
        new_args, new_kwargs = (args[1], args[2]) if func is newobj_ex else (args[1:], {})
        if new_kwargs:
            raise UsageError(COPY_HINT.format(what=f"{args[0].__qualname__}.__new__ takes keyword arguments"))
        if new_args or args[0].__new__ is not object.__new__:
            func, args = args[0].__new__, (args[0], *new_args)
        else:
            func, args = copyreg._reconstructor, (args[0], object, None)  # type: ignore[attr-defined]
    if is_dynamic_class(func) or any(isinstance(arg, type) and is_dynamic_class(arg) for arg in args):
        raise UsageError(COPY_HINT.format(what="a reduction that names the aitune subclass"))
    if isinstance(state, dict):
        state = {key: value for key, value in state.items() if key not in OWN}
    elif isinstance(state, tuple) and len(state) == 2 and all(isinstance(s, dict | None) for s in state):
        state = tuple(s if s is None else {k: v for k, v in s.items() if k not in OWN} for s in state)
    elif state is not None and OWN & self.__dict__.keys():
        raise UsageError(COPY_HINT.format(what=f"a state of type {type(state).__name__}"))
    return func, args, state, listitems, dictitems, setter


def drop_eager_forwards(obj: Any) -> None:
    """Remove each module's instance `forward` that is just its class's forward bound to itself.

    A router copies into the eager forward it stood in front of; where that was the class forward, the copy
    then carries it as an instance attribute. Removing it leaves exactly the concrete class's own state.
    """
    import torch

    roots = [obj] if isinstance(obj, torch.nn.Module) else list(vars(obj).values())
    seen: set[int] = set()
    for root in roots:
        if not isinstance(root, torch.nn.Module):
            continue
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            forward = module.__dict__.get("forward")
            if (
                isinstance(forward, types.MethodType)
                and forward.__self__ is module
                and forward.__func__ is getattr(type(module), "forward", None)
            ):
                del module.__dict__["forward"]
