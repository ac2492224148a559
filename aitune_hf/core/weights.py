"""Weight fingerprints: notice when weights that a backend baked in have changed since it was built.

The fast path compares identities, version counters and storage pointers. When one of those moved (an
offload hook copies weights between devices, Accelerate re-wraps parameters), the values are compared
with checksums taken at build time: a move with equal values is accepted and remembered, an edit is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def checksum(tensor: torch.Tensor) -> tuple[float, ...]:
    """Sum, sum of squares and a position-weighted sum, in float64: equal values give equal checksums."""
    with torch.no_grad():
        flat = tensor.detach().reshape(-1).double()
        if flat.numel() == 0:
            return (0.0, 0.0, 0.0)
        positions = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
        sums = torch.stack([flat.sum(), (flat * flat).sum(), (flat * positions.reciprocal()).sum()])
        return tuple(sums.cpu().tolist())


@dataclass
class _Entry:
    owner: torch.nn.Module
    name: str
    tensor: torch.Tensor
    version: int | None
    pointer: int
    shape: torch.Size
    dtype: torch.dtype
    checksum: tuple[float, ...]

    def current(self) -> torch.Tensor | None:
        return self.owner._parameters.get(self.name, self.owner._buffers.get(self.name))

    def unchanged_fast(self, tensor: torch.Tensor) -> bool:
        return tensor is self.tensor and _version(tensor) == self.version and tensor.data_ptr() == self.pointer


class WeightsFingerprint:
    """The values of every parameter and buffer of a module, and the shape of its module tree.

    Catches `load_state_dict`, in-place edits, re-assigned parameters or ``.data`` (as LoRA fusing does),
    and swapped submodules (as LoRA injection does). Moves and re-wraps that keep the values are accepted.
    Edits made in place through ``param.data`` bypass version counters and go unseen.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._children = [
            (parent, name, child) for parent in module.modules() for name, child in parent._modules.items()
        ]
        self._entries = [
            _Entry(owner, name, t, _version(t), t.data_ptr(), t.shape, t.dtype, checksum(t))
            for owner in module.modules()
            for table in (owner._parameters, owner._buffers)
            for name, t in table.items()
            if t is not None
        ]

    def changed(self) -> str | None:
        """A description of the first change found, or None when every value is as it was."""
        for parent, name, child in self._children:
            if parent._modules.get(name) is not child:
                return f"submodule {name!r} of {type(parent).__name__} was replaced"
        for entry in self._entries:
            tensor = entry.current()
            if tensor is not None and entry.unchanged_fast(tensor):
                continue
            where = f"{type(entry.owner).__name__}.{entry.name}"
            if tensor is None:
                return f"{where} was removed"
            if tensor.shape != entry.shape or tensor.dtype != entry.dtype or tensor.device.type == "meta":
                return f"{where} changed shape, dtype or device"
            if checksum(tensor) != entry.checksum:
                return f"{where} was modified"
            entry.tensor, entry.version, entry.pointer = tensor, _version(tensor), tensor.data_ptr()
        return None
