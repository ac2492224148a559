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
        #: The sampled values at build time, per tensor (never re-taken: a moved storage is compared with them).
        self._initial = [view.clone() for view in self._views]
        #: Per dtype, the positions of its tensors and their build-time samples as one tensor (the torch path).
        self._dtypes = [
            (positions, self._read([self._initial[i] for i in positions]))
            for positions in _by_dtype(self._views).values()
        ]
        self._arrays = _numpy_views(self._views, self._dtypes)

    def _resample(self, index: int, tensor: torch.Tensor) -> None:
        """The storage of tensor `index` moved: sample the new one. The one place the views change, so the numpy
        views of the fast path (`_arrays`) are re-made with them, never left on the old storage."""
        views = [*self._views]
        views[index] = _sample_view(tensor)
        self._views, self._arrays = views, _numpy_views(views, self._dtypes)

    def _tensors(self) -> list[torch.Tensor]:
        return [table[key] for _, table, key in self._places]

    @staticmethod
    def _read(views: list[torch.Tensor]) -> torch.Tensor:
        """Sampled values of one dtype as one tensor (several devices gathered on the CPU)."""
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
        groups = self._arrays
        if groups is not None:  # the same comparison as torch.equal (NaN unequal, -0.0 == 0.0), 5x cheaper
            return all(bool((np.concatenate(views) == expected).all()) for views, expected in groups)
        views = self._views
        return all(
            torch.equal(self._read([views[i] for i in positions]), expected) for positions, expected in self._dtypes
        )

    def explain(self) -> str | None:
        name = self._changed_tensor()
        if name is None:  # each tensor in its own dtype (a promoted one can hide an int64 edit)
            for (place, _, _), view, value in zip(self._places, self._views, self._initial, strict=True):
                if not torch.equal(view.cpu(), value.cpu()):
                    name = place
                    break
        return None if name is None else f"weight {name} was modified (baked into the backend)"


def _by_dtype(views: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """The positions of `views` by dtype: each dtype is compared in its own (`torch.cat` would promote an int64 buffer
    to float32 beside float weights, where an edit of a large value can round away)."""
    groups: dict[torch.dtype, list[int]] = {}
    for position, view in enumerate(views):
        groups.setdefault(view.dtype, []).append(position)
    return groups


def _numpy_views(
    views: list[torch.Tensor], groups: list[tuple[list[int], torch.Tensor]]
) -> list[tuple[list[np.ndarray], np.ndarray]] | None:
    """Per dtype group (`WeightSamples._dtypes`: positions and build-time samples), NumPy views of the sampled elements
    (they read the same memory as `views`, so in-place edits are seen) and of the build-time samples; or None where the
    torch path is needed: a tensor off the CPU or one read whole (a reshape would copy), or a dtype NumPy lacks
    (bfloat16). Made afresh whenever the views change (`WeightSamples._resample`).

    Each dtype is compared in its own: a model's integer buffers (BERT's `position_ids`) beside its float weights no
    longer send every call through `torch.cat`, which promotes them (an int64 compared as float32 loses precision too).
    `torch.cat` and `torch.equal` over 16 small strided views cost about 50 us a call; NumPy about 9 us (MiniLM's
    BertLayer, one thread). The whole MiniLM (103 float tensors, 2 int64 buffers): 146 us -> 77 us a call, with the
    stamps (one thread, AMD EPYC). A NumPy view keeps its tensor, and so its storage, alive, as a torch view does; a
    storage reallocated in place moves the tensor's data pointer, which `_changed_tensor` sees before any view is
    read."""
    if not views or any(view.device.type != "cpu" or view.dim() != 1 for view in views):
        return None
    try:
        return [([views[i].numpy() for i in positions], expected.numpy()) for positions, expected in groups]
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
