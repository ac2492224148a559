"""Weight fingerprints: notice when weights that a backend baked in have changed since it was built."""

from __future__ import annotations

import torch


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


class WeightsFingerprint:
    """The identity, version and storage of every parameter and buffer, and the module tree's shape.

    Catches `load_state_dict`, in-place edits, re-assigned parameters, moved weights, and submodules that
    were swapped (as LoRA injection does). Edits through ``param.data`` bypass version counters and are
    seen only when they change the storage.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._children = [
            (parent, name, child) for parent in module.modules() for name, child in parent._modules.items()
        ]
        self._tensors = []
        for owner in module.modules():
            for table in (owner._parameters, owner._buffers):
                for name, tensor in table.items():
                    if tensor is not None:
                        self._tensors.append((owner, name, tensor, _version(tensor), tensor.data_ptr()))

    def changed(self) -> str | None:
        """A description of the first change found, or None when everything is as it was."""
        for parent, name, child in self._children:
            if parent._modules.get(name) is not child:
                return f"submodule {name!r} of {type(parent).__name__} was replaced"
        for owner, name, tensor, version, pointer in self._tensors:
            current = owner._parameters.get(name, owner._buffers.get(name))
            if current is not tensor:
                return f"{type(owner).__name__}.{name} was re-assigned"
            if _version(tensor) != version or tensor.data_ptr() != pointer:
                return f"{type(owner).__name__}.{name} was modified"
        return None
