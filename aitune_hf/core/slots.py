"""Where a module's forward lives, so a wrapper can be put there and taken out again exactly.

A plain module's forward is the class method; the wrapper becomes the instance's `forward` attribute
(as Accelerate does). Hooks that already wrapped the forward keep the original in a place of their own;
the Hugging Face layer registers locators for those so the wrapper goes *beneath* the hook. The core
itself knows only the plain instance slot.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch


class ForwardSlot(abc.ABC):
    """A place that holds the forward that a module call ends up running."""

    description: str = "forward"

    @abc.abstractmethod
    def read(self) -> Callable[..., Any]:
        """The callable in the slot now."""

    @abc.abstractmethod
    def write(self, fn: Callable[..., Any]) -> None:
        """Put `fn` in the slot."""

    def restore(self, original: Callable[..., Any]) -> None:
        """Put back what was there before the wrapper (by default, write it back)."""
        self.write(original)


class InstanceForwardSlot(ForwardSlot):
    """`module.forward` itself: an instance attribute when set, else the class method."""

    description = "module.forward"

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.had_instance_forward = "forward" in module.__dict__

    def read(self) -> Callable[..., Any]:
        return self.module.forward

    def write(self, fn: Callable[..., Any]) -> None:
        self.module.__dict__["forward"] = fn

    def restore(self, original: Callable[..., Any]) -> None:
        if self.had_instance_forward:
            self.module.__dict__["forward"] = original
        else:
            self.module.__dict__.pop("forward", None)


#: Functions that return the slot beneath a hook on `module`, or None when they see no such hook.
#: The first match wins; the plain instance slot is the fallback.
SLOT_LOCATORS: list[Callable[[torch.nn.Module], ForwardSlot | None]] = []


def locate_slot(module: torch.nn.Module) -> ForwardSlot:
    """The innermost slot for `module`'s forward: beneath any known hook, else the instance slot."""
    for locator in SLOT_LOCATORS:
        slot = locator(module)
        if slot is not None:
            return slot
    return InstanceForwardSlot(module)


def all_slots(module: torch.nn.Module) -> list[ForwardSlot]:
    """Every slot that could hold `module`'s wrapper now (hooks may have moved it since install)."""
    slots = [slot for slot in (locator(module) for locator in SLOT_LOCATORS) if slot is not None]
    return [*slots, InstanceForwardSlot(module)]
