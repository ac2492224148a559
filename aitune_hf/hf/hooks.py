"""Offload and placement awareness: where Accelerate and Diffusers hooks keep a module's forward, and which
hooks move weights per call.

Accelerate keeps the hooked module's own forward in ``module._old_forward`` and calls it through the hook's
``new_forward``; Diffusers' ``HookRegistry`` (``module._diffusers_hook``) keeps it in the innermost
``HookFunctionReference`` (``.forward``, or ``.original_forward`` for hooks that bring a ``new_forward``).
A wrapper placed there runs *beneath* the hook: the hook still moves inputs and weights first, and removing
or re-applying the hook carries the wrapper along. Nothing here imports accelerate or diffusers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from aitune_hf.core.slots import SLOT_LOCATORS, ForwardSlot

_DIFFUSERS_WEIGHT_MOVING_HOOKS = ("group_offloading", "lazy_prefetch_group_offloading", "layerwise_casting")


def _defined_in(fn: Any, package: str) -> bool:
    func = getattr(fn, "func", fn)
    return getattr(func, "__module__", "").startswith(package)


class AccelerateSlot(ForwardSlot):
    """``module._old_forward``: what an Accelerate hook calls after its ``pre_forward``."""

    description = "beneath Accelerate's _hf_hook (module._old_forward)"

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def read(self) -> Callable[..., Any]:
        return self.module.__dict__["_old_forward"]

    def write(self, fn: Callable[..., Any]) -> None:
        self.module.__dict__["_old_forward"] = fn


class DiffusersSlot(ForwardSlot):
    """The innermost ``HookFunctionReference`` of a Diffusers ``HookRegistry``."""

    description = "beneath Diffusers' _diffusers_hook registry (innermost forward)"

    def __init__(self, fn_ref: Any) -> None:
        self.fn_ref = fn_ref
        self.attribute = "original_forward" if fn_ref.original_forward is not None else "forward"

    def read(self) -> Callable[..., Any]:
        return getattr(self.fn_ref, self.attribute)

    def write(self, fn: Callable[..., Any]) -> None:
        setattr(self.fn_ref, self.attribute, fn)


def accelerate_slot(module: torch.nn.Module) -> ForwardSlot | None:
    """The slot beneath an Accelerate hook, unless a Diffusers registry sits beneath that hook."""
    if "_hf_hook" not in module.__dict__ or "_old_forward" not in module.__dict__:
        return None
    if _defined_in(module.__dict__["_old_forward"], "diffusers.hooks"):
        return None
    return AccelerateSlot(module)


def diffusers_slot(module: torch.nn.Module) -> ForwardSlot | None:
    """The slot beneath a Diffusers hook registry, unless an Accelerate hook sits beneath it."""
    registry = module.__dict__.get("_diffusers_hook")
    fn_refs = getattr(registry, "_fn_refs", None)
    if not fn_refs:
        return None
    slot = DiffusersSlot(fn_refs[0])
    if _defined_in(slot.read(), "accelerate.") and "_old_forward" in module.__dict__:
        return None
    return slot


def install_slot_locators() -> None:
    """Teach the core where hooks keep forwards (idempotent)."""
    for locator in (accelerate_slot, diffusers_slot):
        if locator not in SLOT_LOCATORS:
            SLOT_LOCATORS.append(locator)


# -- hooks that move weights per call ---------------------------------------------------------------------


def _accelerate_hooks(module: torch.nn.Module) -> Iterator[Any]:
    hook = module.__dict__.get("_hf_hook")
    if hook is None:
        return
    yield from getattr(hook, "hooks", None) or [hook]  # SequentialHook holds several


def moves_weights(module: torch.nn.Module) -> str | None:
    """Why `module`'s own hooks move or re-cast its weights around each call, or None if they do not."""
    for hook in _accelerate_hooks(module):
        name = type(hook).__name__
        if getattr(hook, "offload", False):
            return f"Accelerate {name} offloads its weights (sequential / leaf-level offload)"
        execution = getattr(hook, "execution_device", None)
        if name == "CpuOffload" and execution is not None and torch.device(execution).type != "cpu":
            return f"Accelerate CpuOffload moves the weights to {execution} and back around each call"
    registry = module.__dict__.get("_diffusers_hook")
    for name in getattr(registry, "hooks", {}) or {}:
        if name in _DIFFUSERS_WEIGHT_MOVING_HOOKS:
            return f"Diffusers hook {name!r} moves or re-casts the weights on each call"
    return None


def weight_motion(root: torch.nn.Module, path: str) -> tuple[str | None, str | None]:
    """For the target at `path` inside `root`: (reason its weights move *inside* it per call, reason they move
    around it). The first makes the target untunable; the second rules out backends that bake weights."""
    target = root.get_submodule(path) if path else root
    for name, sub in target.named_modules():
        if sub is not target and (reason := moves_weights(sub)):
            return f"weights move per call inside this block ({name}: {reason})", None
    owners = [root]
    parts = path.split(".") if path else []
    for index in range(len(parts)):
        owners.append(root.get_submodule(".".join(parts[: index + 1])))
    for owner in owners:
        if reason := moves_weights(owner):
            return None, reason
    return None, None
