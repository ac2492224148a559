"""Where a runtime's build gets its model: the call's layout in the graph (`CallLayout`); `obtain`, the ONNX model,
which reuses an identical module's export, shares one export among the builds of a tuning, or exports (here, or in the
build process for background tuning); and `obtain_program`, the `torch.export` program the ONNX export is made from
(OpenVINO's other door: its PyTorch frontend reads it). ONNX Runtime and OpenVINO both build this way, so a block is
exported once for both, and traced once for both doors."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from aitune_hf.backends.base import Call, current_build
from aitune_hf.backends.onnx.export import (
    dynamic_attempts,
    export_flat,
    first_that_traces,
    named_weights,
    private_twin,
    trace_flat,
    widest,
)
from aitune_hf.backends.onnx.reuse import (
    ProgramSkeleton,
    Skeleton,
    find_skeleton,
    keep_skeleton,
    quietly,
    sibling_key,
    skeleton_keys,
)
from aitune_hf.backends.onnx.worker import WorkerBuild

logger = logging.getLogger(__name__)


@dataclass
class CallLayout:
    """How one call of a forward crosses into an ONNX graph and back: the call's tensor leaves are the graph's inputs
    (after the live weights, if any), every other leaf is baked into the graph; the output's tensor leaves are the
    graph's outputs, put back into the forward's output structure by `outputs`."""

    in_leaves: list[Any]
    in_spec: pytree.TreeSpec
    tensor_positions: list[int]
    #: The weights fed as graph inputs on every call ("live"), by dotted name; empty when the graph bakes them.
    weights: dict[str, torch.Tensor]
    out_leaves: list[Any]
    out_spec: pytree.TreeSpec
    out_tensor_positions: list[int]
    device: torch.device
    dynamic: bool

    @classmethod
    def of(
        cls, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call], dynamic: bool, live: bool
    ) -> CallLayout:
        """The layout of `samples`' call (with `dynamic`, of the widest sample: `widest`); runs `forward` once unless
        the build context holds the call's eager output (`BuildContext.outputs`). Raises TypeError for what no graph
        here can take: a bfloat16 input or live weight, an output with no tensor."""
        chosen = widest(samples) if dynamic else samples[0]
        args, kwargs = chosen
        in_leaves, in_spec = pytree.tree_flatten((args, kwargs))
        for leaf in in_leaves:
            if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.bfloat16:
                raise TypeError("bfloat16 tensors cannot cross into an ONNX runtime here; use float16 or float32")
        weights = named_weights(module) if live else {}
        for name, tensor in weights.items():
            if tensor.dtype == torch.bfloat16:
                raise TypeError(
                    f"weight {name!r} is bfloat16, which cannot be fed to an ONNX runtime live; use weights='baked'"
                )
        kept = current_build().outputs  # the call's eager output, replayed for the references: no forward here
        if id(chosen) in kept:
            out_leaves, out_spec = pytree.tree_flatten(kept[id(chosen)])
        else:
            with torch.no_grad():
                out_leaves, out_spec = pytree.tree_flatten(forward(*args, **kwargs))
        out_tensor_positions = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)]
        if not out_tensor_positions:
            raise TypeError("the forward returns no tensor; nothing to export")
        return cls(
            in_leaves=in_leaves,
            in_spec=in_spec,
            tensor_positions=[i for i, leaf in enumerate(in_leaves) if isinstance(leaf, torch.Tensor)],
            weights=weights,
            out_leaves=out_leaves,
            out_spec=out_spec,
            out_tensor_positions=out_tensor_positions,
            device=next(leaf.device for leaf in in_leaves if isinstance(leaf, torch.Tensor)),
            dynamic=dynamic,
        )

    @property
    def weight_names(self) -> list[str]:
        return [f"weight_{i}" for i in range(len(self.weights))]

    @property
    def input_names(self) -> list[str]:
        return [f"input_{i}" for i in range(len(self.tensor_positions))]

    @property
    def output_names(self) -> list[str]:
        return [f"output_{i}" for i in range(len(self.out_tensor_positions))]

    @property
    def names(self) -> tuple[list[str], list[str], list[str]]:
        """(weight input names, call input names, output names), as the graph names them."""
        return self.weight_names, self.input_names, self.output_names

    @property
    def input_positions(self) -> dict[str, int]:
        """Graph input name -> the position of its tensor among the call's leaves (`leaves_into`)."""
        return {name: self.tensor_positions[i] for i, name in enumerate(self.input_names)}

    @property
    def out_template(self) -> list[Any]:
        """The output's leaves with the tensors left out (None), to be filled by each call's outputs."""
        return [None if isinstance(leaf, torch.Tensor) else leaf for leaf in self.out_leaves]

    @property
    def out_shapes(self) -> list[tuple[int, ...]] | None:
        """The output tensors' shapes for an exact-shape build; None for a shape family."""
        return None if self.dynamic else [tuple(self.out_leaves[i].shape) for i in self.out_tensor_positions]

    @property
    def out_dtypes(self) -> list[torch.dtype]:
        return [self.out_leaves[i].dtype for i in self.out_tensor_positions]


@dataclass
class Obtained:
    """The ONNX model a build starts from (`obtain`)."""

    #: The model in memory (optimised as the exporter optimises), or None when `program` holds it.
    proto: Any | None
    #: The exporter's `ONNXProgram` when this process exported, else None.
    program: Any | None
    #: "export" (exported for this build), "reused" (an identical module's export with this module's weights:
    #: `reuse.Skeleton`) or "shared" (the export another build of the same call made in this tuning).
    how: str
    #: What the build process made (background tuning), or None: all of it here.
    worker: Any | None = None

    @property
    def model_proto(self) -> Any:
        return self.proto if self.proto is not None else self.program.model_proto


def obtain(
    layout: CallLayout,
    module: torch.nn.Module,
    forward: Callable[..., Any],
    samples: Sequence[Call],
    *,
    owner: object,
    opset_version: int | None,
    reusable: bool,
    offload: bool,
    finish: tuple[Callable[..., dict[str, Any]], tuple[Any, ...]] | None = None,
) -> Obtained:
    """The ONNX model of `layout`'s call, made once per module state and call in this process where it can be:
    1. the export another build of the same call made in this tuning (`BuildContext.shared`: another precision's or
       another runtime's candidate), as it is: nothing to redo, else
    2. an identical module's export with `module`'s weights put in (`reuse`; only when `reusable`: weights baked, below
       protobuf's limit), which costs the exporter's optimizer again (measured: 0.5-10 s a SD block in a replica's
       background tuning, where the export shared by the tuning's first build was free), else
    3. with `offload` (background tuning), an export in the build process (`worker`), else
    4. an export here, on a private copy of the module.
    With `offload` and `finish` (a module-level function and its arguments, run in the build process on the model file:
    a runtime's own heavy steps), the build process also runs `finish` on the model, however it was obtained.
    `owner` scopes the sibling reuse to one backend instance (`reuse.skeleton_keys`)."""
    call_key = sibling_key(module, layout.in_leaves, layout.in_spec, layout.dynamic)
    keys = skeleton_keys(owner, module, forward, call_key, opset_version) if reusable else []
    raw: list[Any] | None = [] if keys else None  # a list: `export_flat` keeps the export before its optimizer there
    shared = current_build().shared
    # The trace (weights baked: the one OpenVINO's PyTorch frontend reads too), shared with the other door's build of
    # this call in this tuning: whichever builds first traces it.
    traced: list[Any] | None = [] if shared is not None and not layout.weights else None
    given = shared.get(("program", call_key)) if traced is not None else None
    proto, how = (shared.get(("onnx_export", call_key)) if shared is not None else None), "shared"
    if proto is None:
        skeleton = find_skeleton(keys)
        proto, how = (quietly(skeleton.fill, module) if skeleton is not None else None), "reused"
    attempts = dynamic_attempts(samples) if layout.dynamic else [None]
    worker = None
    program = None
    exported = False
    if proto is None and offload:
        worker = WorkerBuild.export(module, forward, layout, attempts, opset_version, finish, raw=bool(keys))
        if worker is not None:
            proto, exported = worker.exported_proto(), True
            raw = [worker.raw_proto()] if keys and worker.raw is not None else None
    elif offload and finish is not None:
        worker = WorkerBuild.run(proto, finish)
    if proto is None:
        # The exporter swaps the module's parameters for fake tensors while it traces: export a private copy, so that
        # other threads can keep calling the user's module meanwhile. A trace made already needs none.
        def export(twin: tuple[torch.nn.Module, Callable[..., Any]], dims: list[frozenset[int]] | None) -> Any:
            return export_flat(*twin, layout.weights, layout.in_leaves, layout.in_spec, layout.tensor_positions,
                               module.training, dims, layout.names, opset_version, raw, traced, given)  # fmt: skip

        fresh = (lambda: private_twin(module, forward)) if given is None else (lambda: (module, forward))
        program = first_that_traces(attempts if given is None else [None], fresh, export, "export")
        exported = True
    obtained = Obtained(proto, program, "export" if exported else how, worker)
    if exported and shared is not None:  # for the other builds of this call, in this tuning (a fresh export only: a
        # reused one that fails its check is built again afresh, `strategy.try_backend`, and must not be found here)
        shared[("onnx_export", call_key)] = obtained.model_proto
        if traced and given is None:
            shared[("program", call_key)] = traced[0]
    if keys and raw:  # this export, for the identical modules to come
        kept = quietly(Skeleton.of, raw[-1], module, (layout.weight_names + layout.input_names, layout.output_names))
        if kept is not None:
            keep_skeleton(keys, kept)
    return obtained


#: The owner of kept traces (`ProgramSkeleton`) in `reuse.skeleton_keys`: a trace depends on nothing of the backend that
#: reads it (no opset, no options), so every build of the call may reuse it.
_PROGRAM_OWNER = "torch.export program"


def obtain_program(
    layout: CallLayout,
    module: torch.nn.Module,
    forward: Callable[..., Any],
    samples: Sequence[Call],
    *,
    reusable: bool,
    trace: bool = True,
) -> tuple[Any, str]:
    """The `torch.export` program of `layout`'s call (weights baked: `layout` has no live weights), as `export_flat`
    traces it before the ONNX exporter's decompositions, and how it was obtained, once per module state and call in
    this process where it can be:
    1. "shared": the trace another build of the same call made in this tuning (the ONNX export's: one trace for both
       doors), else
    2. "reused": an identical module's trace with copies of `module`'s weights put in (`reuse.ProgramSkeleton`; only
       when `reusable`), else
    3. "export": a trace here, on a private copy of the module, kept for the builds to come; with `trace` False,
       (None, "") instead (the caller traces elsewhere: in the build process)."""
    if layout.weights:
        raise TypeError("a program is traced with its weights baked; this layout feeds them live")
    call_key = sibling_key(module, layout.in_leaves, layout.in_spec, layout.dynamic)
    keys = skeleton_keys(_PROGRAM_OWNER, module, forward, call_key, None, form="program") if reusable else []
    shared = current_build().shared
    program, how = (shared.get(("program", call_key)) if shared is not None else None), "shared"
    if program is None:
        skeleton = find_skeleton(keys)
        program, how = (quietly(skeleton.fill, module) if skeleton is not None else None), "reused"
    if program is not None:
        return program, how
    if not trace:
        return None, ""
    program = first_that_traces(
        dynamic_attempts(samples) if layout.dynamic else [None],
        lambda: private_twin(module, forward),
        lambda twin, dims: trace_flat(
            *twin, {}, layout.in_leaves, layout.in_spec, layout.tensor_positions, module.training, dims
        ),
        "trace",
    )
    if shared is not None:
        shared[("program", call_key)] = program
    if keys:
        kept = quietly(ProgramSkeleton.of, program, module)
        if kept is not None:
            keep_skeleton(keys, kept)
    return program, "export"
