"""One export per module state per process: an export kept without its weights (`Skeleton`) serves later builds of
identical modules (a sibling block, a second pipeline of the same architecture, a block tuned again after a weight
edit), which put their own weights in and optimise as the exporter does; the result is byte for byte their own export.
The same for the trace OpenVINO's PyTorch frontend reads (`ProgramSkeleton`: a `torch.export` program without its
weights).
Keys (`skeleton_keys`) say when a kept export fits; the most recent `_SKELETONS_KEPT` are kept; `forget_exports`
drops them all."""

from __future__ import annotations

import collections
import copy
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from aitune_hf.backends.base import current_build
from aitune_hf.backends.onnx.export import named_weights, optimized

logger = logging.getLogger(__name__)


#: Keys of exports kept for reuse in this process (up to two per export: `skeleton_keys`), their weights taken out
#: (`Skeleton`): graphs only, a few hundred KB each at most; the least recently used goes first.
_SKELETONS_KEPT = 128
_skeletons: collections.OrderedDict[Any, Skeleton] = collections.OrderedDict()
_skeletons_lock = threading.Lock()


def skeleton_keys(
    owner: object,
    module: torch.nn.Module,
    forward: Callable[..., Any],
    call_key: tuple[Any, ...],
    opset_version: int | None,
    form: str = "onnx",
) -> list[tuple[Any, ...]]:
    """The keys under which this build may find, and keeps, an export without weights (`Skeleton`; with `form`
    "program", a trace without weights: `ProgramSkeleton`):
    - ("sibling", owner, ...): while the core applies an identical sibling's decision (`BuildContext.sibling`: same
      class, weight shapes and call, which is all the sibling decision promises), from the same backend instance;
    - ("state", ...): when the core gives the module's state digest (`BuildContext.state`: structure, plain values,
      the calls' signature and modes, training) and the forward is the module's own method, whose function is in
      the key (a closure or hook could trace to another graph).
    The opset and the form are in both; precision and fused kernels are not (they rewrite the export afterwards)."""
    build = current_build()
    keys: list[tuple[Any, ...]] = [("sibling", owner, opset_version, call_key, form)]
    function = getattr(forward, "__func__", None)
    if build.state is not None and function is not None and getattr(forward, "__self__", None) is module:
        keys.append(("state", opset_version, build.state(), call_key, function, form))
    return keys


def forget_exports() -> None:
    """Drop the exports this process keeps for reuse (`Skeleton`): later builds export afresh. For tests whose
    subject is the export itself (under threads, in the build process), and to free what they hold."""
    with _skeletons_lock:
        _skeletons.clear()


def find_skeleton(keys: list[tuple[Any, ...]]) -> Any:
    """The kept export under the first key that has one; a sibling's only while the core applies its decision."""
    sibling = current_build().sibling
    with _skeletons_lock:
        for key in keys:
            if key[0] == "sibling" and not sibling:
                continue
            skeleton = _skeletons.get(key)
            if skeleton is not None:
                _skeletons.move_to_end(key)
                return skeleton
    return None


def keep_skeleton(keys: list[tuple[Any, ...]], skeleton: Skeleton | ProgramSkeleton) -> None:
    with _skeletons_lock:
        for key in keys:
            _skeletons[key] = skeleton
            _skeletons.move_to_end(key)
        while len(_skeletons) > _SKELETONS_KEPT:
            _skeletons.popitem(last=False)


def sibling_key(module: torch.nn.Module, leaves: list[Any], spec: Any, dynamic: bool) -> tuple[Any, ...]:
    """Modules with equal keys export to the same graph up to their weights' values (checked: a sibling's build
    is checked against its own eager outputs like any build)."""
    weights = tuple((name, tuple(t.shape), t.dtype) for name, t in named_weights(module).items())
    call = tuple(
        (tuple(leaf.shape), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
    )
    return type(module), weights, str(spec), call, dynamic


def quietly(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or None when it raises (a sibling's export is an optimisation: without it, export)."""
    try:
        return fn(*args)
    except Exception:
        logger.debug("sibling export reuse skipped", exc_info=True)
        return None


class Skeleton:
    """An export before onnxscript's optimizer, its weights taken out. There every parameter and buffer the graph reads
    is an initializer named as in the module, and nothing is computed from them yet (`weight.T`, `weight * 2`,
    GroupNorm's reshaped scale stay nodes), so `fill` puts another module's weights in by name and optimizes as the
    exporter does: the model that exporting that module would give (tests/backends/test_onnxruntime.py)."""

    def __init__(self, proto: Any, slots: list[tuple[int, str]], names: tuple[list[str], list[str]]) -> None:
        self.proto, self.slots, self.names = proto, slots, names

    @classmethod
    def of(cls, raw: Any, module: torch.nn.Module, names: tuple[list[str], list[str]]) -> Skeleton:
        """The skeleton of `raw` (`export_flat`'s model before its optimizer, which it takes over), exported from
        `module`; `names`: the model's input and output names, given after optimizing as `export_flat` gives them."""
        weights = named_weights(module)
        slots = []
        for index, init in enumerate(raw.graph.initializer):
            name = init.name.removeprefix("module.")
            if name in weights and tuple(init.dims) == tuple(weights[name].shape):
                slots.append((index, name))
        for index, _ in slots:
            raw.graph.initializer[index].ClearField("raw_data")
        return cls(raw, slots, names)

    def fill(self, module: torch.nn.Module) -> Any:
        """A model for `module`: this skeleton with `module`'s weights, optimized as the exporter optimizes."""
        import onnxscript.ir as ir
        from onnx import numpy_helper

        weights = named_weights(module)
        proto = copy.deepcopy(self.proto)
        for index, name in self.slots:
            init, value = proto.graph.initializer[index], weights[name].detach().cpu().numpy()
            init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value), init.name))
        return ir.serde.serialize_model(optimized(ir.serde.deserialize_model(proto), *self.names))


class ProgramSkeleton:
    """A `torch.export` program of a flat call (`export.trace_flat`) with the module's weights taken out (meta tensors
    of their shapes): `fill` puts another module's weights in, by name, and gives the program tracing that module would
    give (its graph depends on the weights' shapes and the module's state, which the keys hold, not on their values).
    Weights are the module's parameters and buffers (non-persistent ones among the program's constants); a tensor the
    trace lifted as a constant of its own stays as traced."""

    def __init__(self, program: Any, weights: dict[str, str]) -> None:
        #: The program, weights stripped; its weights' keys (in the state dict or the constants) -> the module's names.
        self.program, self.weights = program, weights

    @classmethod
    def of(cls, program: Any, module: torch.nn.Module) -> ProgramSkeleton:
        """The skeleton of `program`, traced from `module` (held as `module` by the flat forward)."""
        names = named_weights(module)
        weights = {key: key.removeprefix("module.") for key in [*program.state_dict, *program.constants]
                   if key.removeprefix("module.") in names}  # fmt: skip
        return cls(_program_with(program, {key: None for key in weights}), weights)

    def fill(self, module: torch.nn.Module) -> Any:
        """A program for `module`: this skeleton with copies of `module`'s weights (never the live tensors: a runtime
        may keep what it reads)."""
        names = named_weights(module)
        return _program_with(self.program, {key: names[name].detach().clone() for key, name in self.weights.items()})


def _program_with(program: Any, values: dict[str, torch.Tensor | None]) -> Any:
    """`program` with the state dict and constant entries in `values` replaced (None: a meta tensor of the same shape);
    the graph is shared, never changed."""
    from torch.export import ExportedProgram

    def replaced(key: str, old: torch.Tensor) -> torch.Tensor:
        if key not in values:
            return old
        new = values[key]
        new = torch.empty_like(old, device="meta") if new is None else new
        return torch.nn.Parameter(new, requires_grad=False) if isinstance(old, torch.nn.Parameter) else new

    return ExportedProgram(
        program.graph_module,
        program.graph,
        program.graph_signature,
        {key: replaced(key, value) for key, value in program.state_dict.items()},
        program.range_constraints,
        program.module_call_graph,
        program.example_inputs,
        constants={key: replaced(key, value) for key, value in program.constants.items()},
        verifiers=program.verifiers,
    )
