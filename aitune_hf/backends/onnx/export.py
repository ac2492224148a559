"""The ONNX export that the ONNX runtimes read (ONNX Runtime, OpenVINO): a forward's call flattened to its tensor
leaves (`CallLayout`), exported with the Dynamo-based exporter on a private copy of the module (`export_flat`), and
the one way a build obtains its model (`obtain`): an identical module's export with this module's weights (`reuse`),
the export another build of the same tuning made, the build process's export (`worker`), or a fresh export here.

Inputs and outputs are flattened to their tensor leaves; every non-tensor leaf (None, a scalar) is part of the
signature and baked into the graph. The weights are either graph inputs fed from the module's current tensors on every
call ("live"), or baked into the graph as initializers.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import logging
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from aitune_hf.backends.base import Call, current_build
from aitune_hf.errors import TuningError

logger = logging.getLogger(__name__)

# torch.onnx.export deep-copies the program's tree specs (`ExportedProgram.run_decompositions`), and copying a
# `LeafSpec` warns that the class is deprecated: once per exported block, from torch's own code, nothing a user can
# act on, breaking the progress bar. Ignored by exact message, once at import (tuning itself changes no filter), and
# appended: a filter of the user's (`-W error`, `simplefilter`) still comes first.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                        append=True)  # fmt: skip


def dynamic_attempts(samples: Sequence[Call]) -> list[list[frozenset[int]] | None]:
    """Which dimensions to export as dynamic, per tensor input, most general first. A family of several shapes:
    every dimension of size 2 or more, then only those that vary across the samples (some models trace only with
    fewer symbols). A family of one shape: every dimension of size 2 or more, then none (the build then serves
    that shape only). Sizes 0 and 1 stay fixed: a size-1 dimension is a broadcast one (an attention mask's head
    dimension), which a symbol would break."""
    shapes = [[tuple(t.shape) for t in pytree.tree_leaves(call) if isinstance(t, torch.Tensor)] for call in samples]
    wide = [tuple(t.shape) for t in pytree.tree_leaves(widest(samples)) if isinstance(t, torch.Tensor)]
    every = [frozenset(d for d, size in enumerate(shape) if size > 1) for shape in wide]
    varying = [
        frozenset(d for d in every[index] if len({shape[index][d] for shape in shapes}) > 1)
        for index in range(len(wide))
    ]
    return [every, varying] if any(varying) else [every, None]


def widest(samples: Sequence[Call]) -> Call:
    """The sample to export a shape family from: the most dimensions above 1 (the exporter fixes sizes 0 and 1),
    then the most elements."""

    def width(call: Call) -> tuple[int, int]:
        tensors = [leaf for leaf in pytree.tree_leaves(call) if isinstance(leaf, torch.Tensor)]
        return sum(size > 1 for t in tensors for size in t.shape), sum(t.numel() for t in tensors)

    return max(samples, key=width)


def export_flat(
    twin: torch.nn.Module,
    twin_forward: Callable[..., Any],
    weights: dict[str, torch.Tensor],
    in_leaves: list[Any],
    in_spec: pytree.TreeSpec,
    tensor_positions: list[int],
    training: bool,
    dims: list[frozenset[int]] | None,
    names: tuple[list[str], list[str], list[str]],
    opset_version: int | None,
    raw: list[Any] | None = None,
    traced: list[Any] | None = None,
    program: torch.export.ExportedProgram | None = None,
) -> Any:
    """One `torch.onnx.export` of `twin_forward`'s call (a private copy's: the exporter swaps its parameters for fake
    tensors while it traces), with the weights as inputs when `weights` names them and the tensor leaves as inputs;
    `dims`: per tensor input, the dimensions exported as `Dim.AUTO` (None: the example's shapes). `raw`, when given,
    gets the model before onnxscript's optimizer (`Skeleton`); the program returned is optimized, as
    `torch.onnx.export(optimize=True)` returns it. `traced`, when given, gets the trace the export was made from
    (`trace_flat`'s program, before the exporter's decompositions): what OpenVINO's PyTorch frontend reads. `program`:
    that trace made already (by the other door, for this call), exported without tracing again."""
    weight_names, input_names, output_names = names
    registry = torchlib_registry(opset_version)
    if registry is None:  # a torch whose exporter moved: its public call, which builds the table every time
        flat, example, dynamic_shapes = (program, (), None) if program is not None else _flat_call(
            twin, twin_forward, weights, in_leaves, in_spec, tensor_positions, training, dims
        )  # fmt: skip
        program = torch.onnx.export(
            flat,
            example,
            dynamic_shapes=dynamic_shapes,
            input_names=weight_names + input_names,
            output_names=output_names,
            opset_version=opset_version,
            dynamo=True,
            optimize=True,
            verbose=False,  # no "[torch.onnx] ..." progress lines (the exporter's only prints to stdout)
            report=False,
            dump_exported_program=False,
        )
        zero_rows_that_see_no_key(program.model)  # what `optimized` adds to the exporter's optimizing
        return program
    from torch.onnx._internal.exporter import _core

    if program is None:
        program = trace_flat(twin, twin_forward, weights, in_leaves, in_spec, tensor_positions, training, dims)
    if traced is not None:
        traced.append(program)
    # What `torch.onnx.export(..., dynamo=True)` does for these arguments (`_compat.export_compat`: tensor-only
    # positional examples, `Dim` dynamic shapes, no custom ops, no file), less building the table and capturing the
    # program (`trace_flat`, the exporter's own capture, kept for the other door); its last steps (optimize, then name
    # inputs and outputs) are `optimized`'s, so that `raw` can keep the model before them. The exporter decomposes a
    # copy: the program it is given stays as traced.
    program = _core.export(
        program,
        registry=registry,
        opset_version=opset_version or default_opset(),
        optimize=False,
        verbose=False,  # no "[torch.onnx] ..." progress lines (the exporter's only prints to stdout)
        report=False,
        verify=False,
        profile=False,
        dump_exported_program=False,
    )
    if raw is not None:
        raw.append(program.model_proto)
    program.model = optimized(program.model, weight_names + input_names, output_names)
    return program


def trace_flat(
    twin: torch.nn.Module,
    twin_forward: Callable[..., Any],
    weights: dict[str, torch.Tensor],
    in_leaves: list[Any],
    in_spec: pytree.TreeSpec,
    tensor_positions: list[int],
    training: bool,
    dims: list[frozenset[int]] | None,
) -> torch.export.ExportedProgram:
    """The trace both doors read: `torch.export`'s program of `twin_forward`'s call, flattened as `export_flat` takes
    it, captured as the ONNX exporter captures it (its capture strategies in its order: non-strict first), before any
    decomposition. Raises what the first strategy raised when none traces."""
    flat, example, dynamic_shapes = _flat_call(twin, twin_forward, weights, in_leaves, in_spec, tensor_positions,
                                               training, dims)  # fmt: skip
    try:
        from torch.onnx._internal.exporter import _capture_strategies

        strategies = list(_capture_strategies.CAPTURE_STRATEGIES)
    except (ImportError, AttributeError):  # a torch whose exporter moved: torch.export as the exporter calls it first
        return torch.export.export(flat, example, dynamic_shapes=dynamic_shapes, strict=False)
    first: Exception | None = None
    for strategy in strategies:
        result = strategy(verbose=False)(flat, example, None, dynamic_shapes)
        if result.exported_program is not None:
            return result.exported_program
        first = first or result.exception
    assert first is not None
    raise first


def _flat_call(
    twin: torch.nn.Module,
    twin_forward: Callable[..., Any],
    weights: dict[str, torch.Tensor],
    in_leaves: list[Any],
    in_spec: pytree.TreeSpec,
    tensor_positions: list[int],
    training: bool,
    dims: list[frozenset[int]] | None,
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], Any]:
    """The flat forward of the call (`FlatForward`), its example tensors and its dynamic shapes, as traced."""
    flat = FlatForward(twin, twin_forward, in_leaves, in_spec, tensor_positions, list(weights)).train(training)
    # Weights are passed as they are (no copy) unless they are inference tensors, which the exporter cannot take
    # outside inference mode; tied weights are passed once per name.
    example = tuple(w.clone() if w.is_inference() else w.detach() for w in weights.values())
    # Row-major examples: the exporter cannot take every layout (channels-last, transposed views); the graph does not
    # depend on it, and `cpu_array` feeds the session row-major copies of such inputs.
    example += tuple(in_leaves[i].clone(memory_format=torch.contiguous_format) for i in tensor_positions)
    dynamic_shapes = None
    if dims is not None:
        auto = torch.export.Dim.AUTO
        dynamic_shapes = (tuple(None for _ in weights) + tuple({d: auto for d in f} or None for f in dims),)
    return flat, example, dynamic_shapes


def optimized(model: Any, input_names: list[str], output_names: list[str]) -> Any:
    """What `torch.onnx.export(optimize=True)` does to an exported ONNX IR model after tracing (`_core.export`):
    onnxscript's optimizer (`ONNXProgram.optimize`), then the inputs and outputs named; and the correction every runtime
    reading the export needs (`zero_rows_that_see_no_key`). In place; returns the model."""
    from torch.onnx._internal.exporter import _ir_passes, _onnx_program

    model = _onnx_program.onnxscript_apis.optimize(model)
    zero_rows_that_see_no_key(model)
    if input_names:
        _ir_passes.rename_inputs(model, input_names)
    if output_names:
        _ir_passes.rename_outputs(model, output_names)
    return model


#: The revision of what the export computes beyond the exporter (`optimized`), in the cache keys of every runtime that
#: reads it: a model cached before a correction is not loaded. 1: `zero_rows_that_see_no_key`.
EXPORT_REVISION = "1"


def zero_rows_that_see_no_key(model: Any) -> int:
    """Give a query that sees no key zeros, as torch does, in every attention with a boolean mask; returns how many
    attentions were corrected. In place, on an onnx_ir model.

    The exporter writes `scaled_dot_product_attention` with a boolean mask (onnxscript's
    `_aten_scaled_dot_product_attention_bool_mask_onnx`) as `Softmax(QK + Where(mask, 0, lowest))`, then
    `Where(IsNaN(p), 0, p)`, then `@ V`. Its NaN step is meant for a fully masked row, but `lowest` is the dtype's most
    negative finite value, not -inf: such a row's softmax is uniform, never NaN, and its output is about the mean of
    the values where torch gives zeros (0.21 off on a tiny attention; the pad positions of a left-padded causal batch).

    Rewritten as `p @ V`, then zeros where the mask's row holds no True (`ReduceMax` over the keys): torch's rule. The
    softmax now feeds its MatMul directly, which is the attention OpenVINO's CPU plugin fuses into one kernel and
    onnxscript's ONNX Runtime fusions match (the NaN step kept OpenVINO from fusing). Only where activations are not
    finite can the values differ from the export's: a NaN score gives NaN here and in torch, zeros in the export.
    Anything but this exact pattern is left as it is."""
    import onnx_ir as ir

    corrected = 0
    for softmax in [node for node in model.graph if node.op_type == "Softmax" and node.domain in ("", "ai.onnx")]:
        probs = softmax.outputs[0]
        users = {use.node.op_type: use for use in probs.uses()}
        if len(probs.uses()) != 2 or set(users) != {"IsNaN", "Where"}:
            continue
        guard = users["Where"].node
        if guard.inputs[0] is not users["IsNaN"].node.outputs[0] or guard.inputs[2] is not probs:
            continue
        if not _is_zero(guard.inputs[1]) or len(guard.outputs[0].uses()) != 1:
            continue
        matmul, index = next(iter(guard.outputs[0].uses()))
        scores = softmax.inputs[0].producer()
        if matmul.op_type != "MatMul" or index != 0 or scores is None or scores.op_type != "Add":
            continue
        masks = [mask for side in scores.inputs if (mask := _boolean_mask(side)) is not None]
        if len(masks) != 1:
            continue
        matmul.replace_input_with(0, probs)
        attended = matmul.outputs[0]
        as_bytes = ir.node("Cast", [masks[0]], {"to": ir.DataType.UINT8})
        axes = ir.node("Constant", [], {"value": ir.tensor([-1], dtype=ir.DataType.INT64)})
        any_key = ir.node("ReduceMax", [as_bytes.outputs[0], axes.outputs[0]], {"keepdims": 1})
        sees_a_key = ir.node("Cast", [any_key.outputs[0]], {"to": ir.DataType.BOOL})
        zero = ir.node("Constant", [], {"value": ir.tensor(np.zeros((), dtype=attended.dtype.numpy()))})
        zeroed = ir.node("Where", [sees_a_key.outputs[0], attended, zero.outputs[0]])
        attended.replace_all_uses_with(zeroed.outputs[0])
        zeroed.replace_input_with(1, attended)  # the line above moved this use too
        model.graph.insert_after(matmul, [as_bytes, axes, any_key, sees_a_key, zero, zeroed])
        corrected += 1
    return corrected


def _is_zero(value: Any) -> bool:
    tensor = _constant(value)
    return tensor is not None and not tensor.any()


def _constant(value: Any) -> np.ndarray | None:
    import onnx_ir as ir

    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return tensor.numpy() if tensor is not None else None


def _boolean_mask(value: Any) -> Any:
    """The boolean mask of `Where(mask, 0, lowest)`, the additive mask the exporter makes of a boolean one (lowest:
    the dtype's most negative finite value, or -inf), or None when `value` is anything else."""
    import onnx_ir as ir

    node = value.producer()
    if node is None or node.op_type != "Where" or node.inputs[0].dtype != ir.DataType.BOOL:
        return None
    lowest = _constant(node.inputs[2])
    if not _is_zero(node.inputs[1]) or lowest is None or not np.issubdtype(lowest.dtype, np.floating):
        return None
    return node.inputs[0] if bool((lowest <= np.finfo(lowest.dtype).min).all()) else None


_registries: dict[int, Any] = {}
_registry_lock = threading.Lock()


def default_opset() -> int:
    from torch.onnx import _constants as onnx_constants

    return onnx_constants.ONNX_DEFAULT_OPSET


def torchlib_registry(opset_version: int | None) -> Any:
    """The exporter's table of ATen -> ONNX functions for this opset, built once per process.

    `torch.onnx.export` builds it on every call: about 2 s, and every block of every tuning paid it (a diffusers
    `BasicTransformerBlock`'s export: 5.0 s with it, 2.65 s without, on an AVX2-only AMD EPYC; docs/backends.md).
    The exporter only reads it (`_dispatching`, `_decomp`), so one table serves every export, from any thread.
    None when this torch's exporter lacks the private pieces (`_core.export(registry=...)`,
    `ONNXRegistry.from_torchlib`): the caller then uses `torch.onnx.export`, which is slower, not different;
    `tests/backends/test_onnxruntime.py` fails on the pinned torch if they moved."""
    try:
        from torch.onnx._internal.exporter import _constants, _core, _registration
    except ImportError:
        return None
    if "registry" not in inspect.signature(_core.export).parameters:
        return None
    opset = opset_version or default_opset()
    registry_opset = max(opset, _constants.TORCHLIB_OPSET)  # as `export_compat` does for older opsets
    with _registry_lock:
        registry = _registries.get(registry_opset)
        if registry is None:
            registry = _registries[registry_opset] = _registration.ONNXRegistry.from_torchlib(
                opset_version=registry_opset
            )
    return registry


def first_that_traces(
    attempts: Sequence[list[frozenset[int]] | None],
    fresh: Callable[[], Any],
    trace: Callable[[Any, list[frozenset[int]] | None], Any],
    what: str,
) -> Any:
    """`trace(fresh(), dims)` for each of `attempts` (per tensor input, the dimensions exported dynamic; None: the
    example's shapes) until one traces, exporting (`exporting`, gradients off, out of inference mode): its result.
    `fresh()` makes a new private copy per attempt, a failed trace leaving symbolic state on the copy and its example
    tensors. Raises what the last attempt raised; `what` names the work in the DEBUG line of each one that failed."""
    with exporting(), torch.inference_mode(False), torch.no_grad():
        for attempt, dims in enumerate(attempts):
            try:
                return trace(fresh(), dims)
            except Exception:
                if attempt == len(attempts) - 1:
                    raise
                logger.debug("%s with dynamic dims %s failed; trying fewer", what, dims, exc_info=True)
    raise TuningError("no attempt to trace: attempts was empty")


def private_twin(module: torch.nn.Module, forward: Callable[..., Any]) -> tuple[torch.nn.Module, Callable[..., Any]]:
    """A deep copy of `module` and `forward` bound to it, for the exporter to trace. Falls back to the module
    itself (then other threads must not call it while exporting) when the forward is not the module's own
    bound method or the module cannot be copied."""
    private_only = current_build().private_only  # background tuning: the live module keeps serving
    if getattr(forward, "__self__", None) is not module or not hasattr(forward, "__func__"):
        if private_only:
            raise RuntimeError("cannot export a private copy: the forward to export is not the module's own method")
        return module, forward
    try:
        with torch.no_grad():
            twin = copy.deepcopy(module)
    except Exception as error:
        if private_only:
            raise RuntimeError(f"cannot export a private copy: the module cannot be copied ({error})") from error
        return module, forward
    # Weights in another memory format (`module.to(memory_format=torch.channels_last)`): the exporter turns each
    # into an initializer through a byte view that needs row-major storage. The copy's weights are made row-major;
    # the values, which is all the graph holds, are the same.
    with torch.no_grad():
        for tensor in [*twin.parameters(), *twin.buffers()]:
            if not tensor.is_contiguous():
                tensor.data = tensor.data.contiguous()
    return twin, types.MethodType(forward.__func__, twin)


class FlatForward(torch.nn.Module):
    """`forward(*weights, *tensors)`: rebuilds the call from its tensor leaves and the baked non-tensor leaves.

    With no `weight_names` the module is registered here, so the exporter bakes its weights as initializers.
    Otherwise the module stays hidden from the exporter and the call runs with the weights given as inputs
    (`torch.func.functional_call`), one per name, so tied weights are separate inputs fed the same tensor.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        leaves: list[Any],
        spec: pytree.TreeSpec,
        tensor_positions: list[int],
        weight_names: list[str],
    ) -> None:
        super().__init__()
        if weight_names:
            self._bound = (_Bound(module, forward),)  # a tuple: not a submodule, so no initializers
        else:
            self.module = module  # registers the weights with the exporter
        self._forward = forward
        self._weight_names = [f"module.{name}" for name in weight_names]
        self._constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self._spec = spec
        self._tensor_positions = tensor_positions

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        count = len(self._weight_names)
        leaves = list(self._constants)
        for position, tensor in zip(self._tensor_positions, tensors[count:], strict=True):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        if count:
            weights = dict(zip(self._weight_names, tensors[:count], strict=True))
            out = torch.func.functional_call(self._bound[0], weights, args, kwargs, tie_weights=False, strict=True)
        else:
            out = self._forward(*args, **kwargs)
        out_leaves, _ = pytree.tree_flatten(out)
        return tuple(leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor))


class _Bound(torch.nn.Module):
    """Holds the module (so `functional_call` can swap its weights) and calls the forward to reproduce, which
    may differ from `module.forward` (the tuning core's wrapper sits there)."""

    def __init__(self, module: torch.nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self._forward = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)


def leaves_into(value: Any, out: list[Any]) -> None:
    """Append `value`'s leaves to `out`, in `pytree.tree_leaves` order (what the export flattened the call by).

    Plain tuples, lists and dicts (insertion order, as pytree flattens them) and leaves (a tensor, None, a scalar:
    any type pytree has no node for, tuple subclasses aside) are handled here: 3 us where `pytree.tree_leaves`
    takes 15 on a MiniLM BertLayer call, on every call served; other nodes (a namedtuple, an OrderedDict, a
    `ModelOutput`) are pytree's own to flatten."""
    kind = type(value)
    if kind is tuple or kind is list:
        for item in value:
            leaves_into(item, out)
    elif kind is dict:
        for item in value.values():
            leaves_into(item, out)
    elif kind not in pytree.SUPPORTED_NODES and not isinstance(value, tuple):  # pytree's own leaf test
        out.append(value)
    else:  # another registered node; a namedtuple or structseq (pytree flattens tuple subclasses by their kind)
        out.extend(pytree.tree_leaves(value))


def numpy_dtype(dtype: torch.dtype) -> Any:
    return torch.empty((), dtype=dtype).numpy().dtype


def cpu_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of `tensor` with its exact shape (0-d stays 0-d), in standard row-major layout: no copy
    when it already is, one copy for non-contiguous, broadcast (stride 0) and channels-last tensors."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.numpy()


def named_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too) under every name, tied ones included."""
    weights = dict(module.named_parameters(remove_duplicate=False))
    weights.update(module.named_buffers(remove_duplicate=False))
    return weights


def weight_sources(module: torch.nn.Module, names: list[str]) -> list[tuple[torch.nn.Module, str, str]]:
    """(owner submodule, "_parameters" or "_buffers", attribute) for each dotted weight name."""
    sources = []
    for name in names:
        path, _, attribute = name.rpartition(".")
        owner = module.get_submodule(path)
        sources.append((owner, "_parameters" if attribute in owner._parameters else "_buffers", attribute))
    return sources


def module_tree(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, name, child) for every submodule edge: the structure the exported graph reproduces."""
    return [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent._modules.items()
        if child is not None
    ]


def needs_external_data(module: torch.nn.Module) -> bool:
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    size += sum(b.numel() * b.element_size() for b in module.buffers())
    return size > 1_500_000_000  # protobuf's 2 GB limit, with room for the graph


#: The loggers whose records below ERROR are dropped while the current thread exports (with their descendants:
#: a logger's filters only see records logged on that logger itself, so each one gets the filter).
_EXPORTER_LOGGERS = (
    "torch.onnx",
    "onnxscript",
    "onnx_ir",
    "torch.export",
    "torch._export",
    "torch.fx.experimental.symbolic_shapes",
)
#: Imported before the loggers are looked up, so that a first export finds the loggers of its modules.
_EXPORTER_MODULES = ("torch.onnx._internal.exporter._core", "torch.export._trace", "onnxscript", "onnx_ir")
_state = threading.local()  # `depth`: how many `exporting()` blocks the current thread is in
_filter_lock = threading.Lock()


class _QuietWhileExporting(logging.Filter):
    """Drops records below ERROR logged by a thread that is inside `exporting()` (the exporter's progress
    notes and warnings, e.g. "torchvision is not installed" on every export); other threads' records, and
    everything outside a build, pass untouched. Added once per logger and never removed or toggled: it changes
    no level, handler or global, so concurrent builds and other threads cannot race on it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not getattr(_state, "depth", 0)


_QUIET = _QuietWhileExporting()


def _install_log_filter() -> None:
    """Adds `_QUIET` to every existing logger at or under `_EXPORTER_LOGGERS` that lacks it, and to the root logger
    (ONNX Runtime's quantization tool logs there), idempotently."""
    prefixes = tuple(f"{name}." for name in _EXPORTER_LOGGERS)
    loggers = logging.root.manager.loggerDict.copy()  # one atomic copy: other threads may create loggers
    with _filter_lock:
        logging.root.addFilter(_QUIET)  # records logged on the root logger itself, by this thread, while it exports
        for name, logger in loggers.items():
            if isinstance(logger, logging.Logger) and (name in _EXPORTER_LOGGERS or name.startswith(prefixes)):
                logger.addFilter(_QUIET)  # a no-op when it is there already


@contextlib.contextmanager
def exporting() -> Iterator[None]:
    """Marks the current thread as exporting, so `_QUIET` drops its exporter records below ERROR.

    Nothing process-wide is switched: no redirect of sys.stdout (the exporter prints nothing there with
    `verbose=False`), no `warnings.catch_warnings` (not thread-safe; the exporter's warnings are left to the
    user's filters), no `setLevel`. `torch.compiler.is_compiling()` is a process-wide flag that torch.export
    sets and restores itself in a `finally`; it is not touched here either (restoring it from outside could
    only clobber a compile running in another thread).
    """
    for module in _EXPORTER_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    _install_log_filter()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
        _install_log_filter()  # loggers the export created, for the next one
