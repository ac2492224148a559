"""The weight-value checks: whether the weights a backend baked into what it built (`BuiltBackend.bakes_weights`: ONNX
Runtime by default, Inductor with `freezing=True`) still hold the values they had when it was built. A guard of kind
weights (`core.guards.ModuleGuard`, with `weights=True`) holds one of them and asks it on every call it serves.

- `WeightSamples` (`weight_check="sampled"`, the default): each tensor's version counter and storage pointer, and
  about 16 elements spread over every tensor compared exactly. It sees every write autograd sees, a re-assignment, an
  offload copy (equal values keep serving) and a dense write through `.data`.
- `WeightValues` (`weight_check="full"`): every tensor's L2 norm on every call (one `torch._foreach_norm` pass).

Each reads the tensors afresh from their modules' tables on every check: an offload hook re-assigns buffers and
`.data` between calls, and `p.data = t` swaps what `p` holds.

Blind spots (docs/guarantees.md): the sampled check misses a write through `.data` confined to elements its samples
skip; the full check misses an edit that keeps every tensor's L2 norm (a permutation of elements within one tensor).
A backend that keeps its weights live inputs (Inductor without freezing, ONNX Runtime with weights as inputs) needs
neither: it reads the current tensors on every call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _weight_places(module: torch.nn.Module) -> list[tuple[str, dict[str, Any], str]]:
    """(name, table, key) of every parameter and buffer of `module`, tied ones once: read afresh on each check,
    since an offload hook re-assigns buffers and `.data` between calls, and `p.data = t` swaps what `p` holds."""
    places: list[tuple[str, dict[str, Any], str]] = []
    seen: set[int] = set()
    for owner_name, owner in module.named_modules():
        for table in (owner._parameters, owner._buffers):
            for key, tensor in table.items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    places.append((f"{owner_name}.{key}" if owner_name else key, table, key))
    return places


#: Elements read per baked tensor on every call by the sampled weight check.
_SAMPLES_PER_TENSOR = 16


def _sample_view(tensor: torch.Tensor) -> torch.Tensor:
    """A strided view of about `_SAMPLES_PER_TENSOR` elements spread over `tensor` (whole when small): it reads
    the live storage, so in-place edits are seen. A dense tensor in another memory format (channels-last weights) is
    sampled through its dimensions in storage order; any other non-contiguous tensor is read whole."""
    flat = tensor.detach()
    if not flat.is_contiguous():
        in_storage_order = flat.permute(sorted(range(flat.dim()), key=lambda d: (-flat.stride(d), -d)))
        if not in_storage_order.is_contiguous():
            return flat
        flat = in_storage_order
    flat = flat.view(-1)
    stride = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
    return flat[stride // 2 :: stride]


def _stamp(tensor: torch.Tensor) -> tuple[int | None, int]:
    """(version counter, storage pointer): what moves when a tensor is written through autograd's view or
    re-assigned. Inference tensors keep no version counter."""
    try:
        return tensor._version, tensor.data_ptr()
    except RuntimeError:
        return None, tensor.data_ptr()


class WeightSamples:
    """The cheap check of baked weights, in two parts that together see every realistic edit:

    - each tensor's version counter and storage pointer. Any write that autograd sees (`p.add_()` under
      no_grad, an optimizer step, `load_state_dict`, which copies into every tensor) bumps the version, and
      `p.data = t` or an offload copy moves the pointer. Then that tensor is compared in full with its value
      at build time (its L2 norm, or exactly for integer tensors): equal values (an offload move, a reload of
      the same weights) keep serving, anything else is a change.
    - about 16 elements spread over every tensor, compared exactly on every call: writes through `.data`
      bump no version counter (`p.data.add_()`, peft's LoRA merge), and a dense edit like those changes them.

    It misses a write through `.data` confined to a few rows or elements that the spread samples skip:
    `weight_check="full"` compares every tensor in full on every call, at the cost of a pass over the weights.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.places = self._places = _weight_places(module)
        tensors = self._tensors()
        self._stamps = [_stamp(t) for t in tensors]
        self._full = [_full_value(t) for t in tensors]
        self._views = [_sample_view(t) for t in tensors]
        self._expected = self._read(self._views).clone()
        self._arrays = _numpy_views(self._views, self._expected)

    def _resample(self, index: int, tensor: torch.Tensor) -> None:
        """The storage of tensor `index` moved: sample the new one. The one place the views change, so the numpy
        views of the fast path (`_arrays`) are re-made with them, never left on the old storage."""
        views = [*self._views]
        views[index] = _sample_view(tensor)
        self._views, self._arrays = views, _numpy_views(views, self._expected)

    def _tensors(self) -> list[torch.Tensor]:
        return [table[key] for _, table, key in self._places]

    @staticmethod
    def _read(views: list[torch.Tensor]) -> torch.Tensor:
        """The sampled values as one tensor (dtypes promoted; several devices gathered on the CPU)."""
        if not views:
            return torch.empty(0)
        with torch.no_grad():
            flat = views if all(view.dim() == 1 for view in views) else [view.reshape(-1) for view in views]
            try:
                return torch.cat(flat)
            except RuntimeError:  # tensors on several devices
                return torch.cat([view.cpu() for view in flat])

    def _changed_tensor(self) -> str | None:
        """Compare in full the tensors whose version or pointer moved; take the new stamps when equal."""
        tensors = self._tensors()
        try:  # `_stamp` inlined (this runs on every call); an inference tensor has no version counter
            stamps = [(t._version, t.data_ptr()) for t in tensors]
        except RuntimeError:
            stamps = [_stamp(t) for t in tensors]
        if stamps == self._stamps:
            return None
        for index, (tensor, stamp) in enumerate(zip(tensors, stamps, strict=True)):
            if stamp != self._stamps[index]:
                if not _same_value(_full_value(tensor), self._full[index]):
                    return self._places[index][0]
                if stamp[1] != self._stamps[index][1]:
                    self._resample(index, tensor)
                self._stamps[index] = stamp
        return None

    def holds(self) -> bool:
        if self._changed_tensor() is not None:
            return False
        arrays = self._arrays
        if arrays is not None:  # the same comparison as torch.equal (NaN unequal, -0.0 == 0.0), 5x cheaper
            return bool((np.concatenate(arrays[0]) == arrays[1]).all())
        return torch.equal(self._read(self._views), self._expected)

    def explain(self) -> str | None:
        name = self._changed_tensor()
        if name is None:
            current = self._read(self._views)
            offset = 0
            for (place, _, _), view in zip(self._places, self._views, strict=True):
                size = view.numel()
                if not torch.equal(current[offset : offset + size], self._expected[offset : offset + size]):
                    name = place
                    break
                offset += size
        return None if name is None else f"weight {name} was modified (baked into the backend)"


def _numpy_views(views: list[torch.Tensor], expected: torch.Tensor) -> tuple[list[np.ndarray], np.ndarray] | None:
    """NumPy views of the sampled elements (they read the same memory as `views`, so in-place edits are seen) and of
    `expected` (the values at build time, shared, never re-taken), or None where the torch path is needed: a tensor
    off the CPU, a dtype NumPy lacks (bfloat16), or several dtypes (`torch.cat` promotes them by torch's rules, NumPy
    by its own). Made afresh whenever the views change (`WeightSamples._resample`).

    `torch.cat` and `torch.equal` over 16 small strided views cost about 50 us a call; NumPy about 9 us (MiniLM's
    BertLayer, one thread). A NumPy view keeps its tensor, and so its storage, alive, as a torch view does; a storage
    reallocated in place moves the tensor's data pointer, which `_changed_tensor` sees before any view is read."""
    dtypes = {view.dtype for view in views}
    if not views or len(dtypes) != 1 or expected.dtype not in dtypes or expected.device.type != "cpu":
        return None
    # 1-d views only: a tensor read whole (`_sample_view`) would need a reshape, which copies in NumPy.
    if any(view.device.type != "cpu" or view.dim() != 1 for view in views):
        return None
    try:
        return [view.numpy() for view in views], expected.numpy()
    except (TypeError, RuntimeError):  # no NumPy dtype, or a tensor NumPy cannot view
        return None


def _full_value(tensor: torch.Tensor) -> torch.Tensor:
    """What a tensor is compared by in full: its L2 norm (floating point) or a copy (other dtypes)."""
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            return torch.linalg.vector_norm(tensor.detach()).float().cpu()
        return tensor.detach().cpu().clone()


def _same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


class WeightValues:
    """The L2 norm of every floating-point parameter and buffer (one foreach pass); other tensors exactly.

    Each tensor is read afresh from its table on every check: an offload hook re-assigns buffers and `.data`
    between calls, and `p.data = t` swaps what `p` holds.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.places = places = _weight_places(module)
        self._names = [name for name, table, key in places if table[key].is_floating_point()]
        self._floats = [(table, key) for _, table, key in places if table[key].is_floating_point()]
        self._others = [
            (name, table, key, table[key].detach().cpu().clone()) for name, table, key in places
            if not table[key].is_floating_point()
        ]  # fmt: skip
        self._norms = self._current_norms()

    def _current_norms(self) -> torch.Tensor | None:
        if not self._floats:
            return None
        with torch.no_grad():
            norms = torch._foreach_norm([table[key] for table, key in self._floats])
            return torch.stack([n.float().cpu() for n in norms])

    def holds(self) -> bool:
        norms = self._current_norms()
        if norms is not None and not torch.equal(norms, self._norms):
            return False
        with torch.no_grad():
            return all(torch.equal(table[key].cpu(), saved) for _, table, key, saved in self._others)

    def explain(self) -> str | None:
        try:
            norms = self._current_norms()
        except Exception as error:  # a tensor went missing or to the meta device
            return f"weights could not be read back ({type(error).__name__}: {error})"
        if norms is not None:
            for name, old, new in zip(self._names, self._norms.tolist(), norms.tolist(), strict=True):
                if old != new and not (old != old and new != new):  # NaN == NaN here
                    return f"weight {name} was modified (baked into the backend; L2 norm {old:.6g} -> {new:.6g})"
        for name, table, key, saved in self._others:
            if not torch.equal(table[key].cpu(), saved):
                return f"weight {name} was modified (baked into the backend)"
        return None


#: A weight-value check: `holds()` on every call served, `explain()` (the changed weight) once it fails, and `places`,
#: the (name, table, key) of every tensor it reads.
WeightCheck = WeightSamples | WeightValues


def make_check(module: torch.nn.Module, how: str = "sampled") -> WeightCheck:
    """The weight-value check of `module`'s parameters and buffers as they are now; `how`: `TuningConfig.weight_check`,
    "sampled" or "full"."""
    return (WeightValues if how == "full" else WeightSamples)(module)
