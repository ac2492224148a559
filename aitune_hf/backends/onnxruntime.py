"""ONNX Runtime: export the forward with `torch.onnx.export` and run one session per signature.

Inputs and outputs are flattened to their tensor leaves; every non-tensor leaf (None, a scalar) is part of
the signature and baked into the graph. The weights are either graph inputs fed from the module's current
tensors on every call ("live"), or baked into the graph as initializers ("baked"), in which case the tuning
core watches them. See `OnnxRuntimeBackend` for why "baked" is the default.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib
import importlib.util
import inspect
import logging
import math
import os
import pickle
import re
import shutil
import tempfile
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from aitune_hf.backends.base import (
    ArtifactPlace,
    Backend,
    BuiltBackend,
    Call,
    current_build,
    installed_version,
    register_backend,
    run_in_build_process,
)
from aitune_hf.errors import CandidateUnavailable, ConfigError

logger = logging.getLogger(__name__)

# torch.onnx.export deep-copies the program's tree specs (`ExportedProgram.run_decompositions`), and copying a
# `LeafSpec` warns that the class is deprecated: once per exported block, from torch's own code, nothing a user can
# act on, breaking the progress bar. Ignored by exact message, once at import (tuning itself changes no filter), and
# appended: a filter of the user's (`-W error`, `simplefilter`) still comes first.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                        append=True)  # fmt: skip
_INSTALL_HINT = "pip install 'aitune-hf[onnx]'"
_WEIGHT_MODES = ("baked", "live")
_ARENAS = ("shared", "session", "off")
_KERNELS = ("default", "fused")
#: Why a `kernels="fused"` build does not apply to a block (reported as the candidate's "unavailable: ..." reason).
NOTHING_TO_FUSE = "nothing to fuse: no attention, layer-norm or GELU pattern in this block"


@register_backend
class OnnxRuntimeBackend(Backend):
    """Export with the Dynamo-based ONNX exporter, run with onnxruntime (CPU, or CUDA where present).

    `arena`: where a CPU session keeps its working memory (activations). "shared" (default): one CPU arena for
    every aitune_hf session in the process, registered once with ONNX Runtime's environment (sessions that do
    not opt in, the user's own, are untouched); blocks run one after another, so it grows to the largest block's
    working set, not to the sum over blocks, and it stays for the process (also after `disable_aitune()`), capped at
    `arena_cap()` (a call that needs more raises MemoryError: a candidate that fails, a served call that falls back).
    "session": ONNX Runtime's default, an arena per session that keeps its largest call's memory while the
    session lives (MiniLM at batch 32 x 121 tokens: +450 MB for 6 layers, against +85 MB shared). "off": no
    arena, memory returned after every call; measured 15-25% slower at batch 32 (docs/backends.md).

    `weights`: "baked" (default) stores them in the graph as initializers, and the tuning core verifies their
    values before each call; "live" makes every parameter and buffer a graph input, fed with the module's
    current tensors on every call (zero-copy), so any edit to the weights is seen with no check. Measured on
    this project's CPUs (docs/backends.md): live costs 6-12% on SD UNet stages (ORT's NCHWc convolutions need
    constant weights) and 20-70% on MiniLM layers at short inputs (ORT packs constant MatMul weights once per
    session, live ones on every call), while the value check of baked weights costs one read of the weights
    (0.2 ms per MiniLM layer): baked wins or ties on every workload measured.

    `precision="int8"` (reduced precision, opt-in through `TuningConfig.precision`): the exported model's MatMul and
    Gemm nodes with constant weights are quantized dynamically (`onnxruntime.quantization.quantize_dynamic`: weights
    int8 per output channel, activations uint8 quantized per call: the U8S8 format ONNX Runtime documents for CPUs
    with VNNI; U8U8 on a CPU without, where U8S8 saturates); convolutions stay fp32. Needs baked weights. The fp32
    export of the same module and call, made for the fp32 candidate of the same tuning, is reused: the variant costs
    a quantization, not a second export.

    `kernels`: "default" leaves kernel choice to ONNX Runtime's own graph optimisations. "fused" first rewrites the
    exported model with onnxscript's ONNX Runtime fusions (`_fuse`: the steps of `optimize_for_ort` without its
    CUDA-only GroupNorm rewrite): attention into one `com.microsoft` `MultiHeadAttention`, residual add + LayerNorm
    into `SkipLayerNormalization`, bias + GELU into `BiasGelu`, and the like. It computes in fp32 (outputs equal
    eager within fp32 tolerances, as every fp32 candidate is checked); `precision="auto"` offers it beside the plain
    fp32 candidate (`kernel_variants`). Like the int8 variant it reuses the fp32 export of the same tuning (a
    rewrite and a session, not a second export). A block where nothing fuses (a convolution-only block) raises
    `CandidateUnavailable` before any session is made: the candidate is reported unavailable. With
    `precision="int8"`: fused first, then the remaining MatMul and Gemm nodes quantized. The model it serves is the
    fused one (`_SessionRunner.kernels` counts its fused operators).
    """

    name = "onnxruntime"
    polymorphic = True  # dynamic axes: one session serves a shape family
    builds_privately = True  # exports a deep copy of the module (`_private_twin`)

    def __init__(
        self,
        providers: Sequence[str] | None = None,
        intra_op_num_threads: int | None = None,
        opset_version: int | None = None,
        artifact_dir: str | Path | None = None,
        weights: str = "baked",
        arena: str = "shared",
        precision: str = "fp32",
        kernels: str = "default",
    ) -> None:
        if kernels not in _KERNELS:
            raise ConfigError(
                f"OnnxRuntimeBackend: kernels={kernels!r} is not valid; valid values: {', '.join(map(repr, _KERNELS))}"
            )
        self.kernels = kernels
        if precision not in ("fp32", "int8"):
            raise ConfigError(f"OnnxRuntimeBackend: precision={precision!r} is not valid; valid values: 'fp32', 'int8'")
        if precision == "int8" and weights != "baked":
            raise ConfigError(
                "OnnxRuntimeBackend: precision='int8' quantizes constant weights: it needs weights='baked'"
            )
        self.precision = precision
        if weights not in _WEIGHT_MODES:
            raise ConfigError(
                f"OnnxRuntimeBackend: weights={weights!r} is not valid; valid values: "
                f"{', '.join(map(repr, _WEIGHT_MODES))}"
            )
        if arena not in _ARENAS:
            raise ConfigError(
                f"OnnxRuntimeBackend: arena={arena!r} is not valid; valid values: {', '.join(map(repr, _ARENAS))}"
            )
        self.arena = arena
        self.providers = list(providers) if providers else None
        self.intra_op_num_threads = intra_op_num_threads
        self.opset_version = opset_version
        self.artifact_dir = Path(artifact_dir) if artifact_dir else None
        self.weights = weights
        #: In the keys of this instance's sibling exports (`_skeleton_keys`): a sibling reuses an export of the same
        #: registration's candidate only, as the sibling decision it applies is that registration's.
        self._own = object()

    @property
    def bakes_weights(self) -> bool:  # type: ignore[override]
        return self.weights == "baked"

    def with_precision(self, precision: str) -> OnnxRuntimeBackend | None:
        if precision == self.precision:
            return self
        if precision != "int8" or self.weights != "baked":
            return None
        return self._variant(precision=precision)

    def kernel_variants(self) -> list[Backend]:
        """The fused-kernel variant of a plain build (`kernels="fused"`), same options and precision."""
        return [self._variant(kernels="fused")] if self.kernels == "default" else []

    def _variant(self, **changes: Any) -> OnnxRuntimeBackend:
        """A new instance with this one's options and `changes`."""
        options = dict(
            providers=self.providers, intra_op_num_threads=self.intra_op_num_threads, opset_version=self.opset_version,
            artifact_dir=self.artifact_dir, weights=self.weights, arena=self.arena, precision=self.precision,
            kernels=self.kernels,
        )  # fmt: skip
        return OnnxRuntimeBackend(**(options | changes))

    def describe(self) -> str:
        options = [f"weights={self.weights}"] if self.weights != "baked" else []
        options += [f"arena={self.arena}"] if self.arena != "shared" else []
        options += [f"precision={self.precision}"] if self.precision != "fp32" else []
        options += [f"kernels={self.kernels}"] if self.kernels != "default" else []
        return f"{self.name}({', '.join(options)})" if options else self.name

    def _bakes(self, module: torch.nn.Module) -> bool:
        """Whether this build bakes the weights of `module`."""
        return self.weights == "baked"

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        return {package: installed_version(package) for package in ("onnxruntime", "onnx", "onnxscript")}

    def unavailable_reason(self, devices: frozenset[torch.device]) -> str | None:
        for package in ("onnxruntime", "onnxscript", "onnx"):
            if importlib.util.find_spec(package) is None:
                return f"{package} is not installed ({_INSTALL_HINT})"
        unsupported = sorted(str(d) for d in devices if d.type not in ("cpu", "cuda"))
        if unsupported:
            return f"onnxruntime runs on cpu and cuda only, not on {', '.join(unsupported)}"
        if any(d.type == "cuda" for d in devices):
            import onnxruntime

            if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
                return "the installed onnxruntime has no CUDAExecutionProvider (pip install onnxruntime-gpu)"
        if len(devices) > 1:
            return f"inputs span several devices ({', '.join(sorted(map(str, devices)))})"
        return None

    def prepare(self) -> None:
        """Imports onnxruntime and onnx, which a build in the build process still needs here (the session; reading the
        export back). Measured on a loaded 2-core machine: `import onnx` 2.4 s, most of it with the GIL held; made
        by the first background build, it was the slowest request while a MiniLM replica tuned (about 2 s)."""
        with contextlib.suppress(ImportError):  # not installed: `unavailable_reason` says so
            import onnx
            import onnx.numpy_helper  # noqa: F401
            import onnxruntime  # noqa: F401

            if self.kernels == "fused":  # the rewrite runs here unless the build process makes it
                import onnx_ir  # noqa: F401
                import onnxscript.rewriter.ort_fusions  # noqa: F401

    def build(
        self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call], dynamic: bool = False
    ) -> BuiltBackend:
        """Export once and open one session. With `dynamic=True` every dimension of every tensor input is
        exported as `Dim.AUTO`: the exporter keeps dynamic what the model allows (sizes 0 and 1 and sizes its
        code depends on stay fixed), and `dynamic_dims` reads which dimensions stayed free off the session."""
        # No `set_default_logger_severity`: it is process-wide (and cannot be read back); the session's own
        # `log_severity_level` below keeps this session quiet.
        import onnxruntime

        args, kwargs = _widest(samples) if dynamic else samples[0]
        in_leaves, in_spec = pytree.tree_flatten((args, kwargs))
        tensor_positions = [i for i, leaf in enumerate(in_leaves) if isinstance(leaf, torch.Tensor)]
        for leaf in in_leaves:
            if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.bfloat16:
                raise TypeError("bfloat16 tensors cannot cross into onnxruntime here; use float16 or float32")
        bakes = self._bakes(module)
        weights = {} if bakes else _named_weights(module)
        for name, tensor in weights.items():
            if tensor.dtype == torch.bfloat16:
                raise TypeError(
                    f"weight {name!r} is bfloat16, which cannot be fed to onnxruntime live; use weights='baked'"
                )
        with torch.no_grad():
            out_leaves, out_spec = pytree.tree_flatten(forward(*args, **kwargs))
        out_tensor_positions = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)]
        if not out_tensor_positions:
            raise TypeError("the forward returns no tensor; nothing to export")

        weight_names = [f"weight_{i}" for i in range(len(weights))]
        input_names = [f"input_{i}" for i in range(len(tensor_positions))]
        output_names = [f"output_{i}" for i in range(len(out_tensor_positions))]
        device = next(leaf.device for leaf in in_leaves if isinstance(leaf, torch.Tensor))

        names = (weight_names, input_names, output_names)

        raw: list[Any] | None = None  # set to a list to get the export before onnxscript's optimizer (`_Skeleton`)

        def export(dims: list[frozenset[int]] | None) -> Any:
            # The exporter swaps the module's parameters for fake tensors while it traces: export a private copy,
            # so that other threads can keep calling the user's module meanwhile. The session reads nothing of it.
            # A fresh copy and fresh example tensors per attempt: a failed trace leaves symbolic state on them.
            twin, twin_forward = _private_twin(module, forward)
            return _export_flat(twin, twin_forward, weights, in_leaves, in_spec, tensor_positions, module.training,
                                dims, names, self.opset_version, raw)  # fmt: skip

        place = current_build().place
        reused = False
        cached = place.load(self, bakes) if place is not None else None
        large = bakes and _needs_external_data(module)
        if self.kernels == "fused" and large and cached is None:
            raise CandidateUnavailable(
                "kernels='fused' rewrites the model in memory, and this block's weights pass protobuf's 2 GB limit"
            )
        fused_ops: dict[str, int] | None = None
        providers = self.providers or (
            ["CUDAExecutionProvider", "CPUExecutionProvider"] if device.type == "cuda" else ["CPUExecutionProvider"]
        )
        # Background tuning: the heavy steps (export, int8 quantization, graph optimisation) run in the build process
        # (`backends/base.py`), which holds no GIL of this one; `worker` keeps what it made (None: all of it here).
        offload = current_build().private_only and device.type == "cpu" and not large
        offload = offload and providers == ["CPUExecutionProvider"]
        worker: _WorkerBuild | None = None
        program = None
        exported = False
        if cached is not None:  # a model this backend exported before, for this module, signature and weights
            # Loaded here, even in the background: a replica that starts warm reads its decisions before it serves,
            # and starting the build process (a Python that imports torch and onnx) would add seconds to its warm-up.
            model, path, cleanup = str(cached / _MODEL_FILE), cached / _MODEL_FILE, None
        else:
            # An identical module's export with this module's weights put in (`_skeleton_keys`): a sibling's, when
            # the core applies that sibling's decision, or any earlier build's of a module in the same state called
            # alike. The core checks the result, and builds afresh without reuse if it fails.
            call_key = _sibling_key(module, in_leaves, in_spec, dynamic)
            reusable = bakes and not large
            keys = _skeleton_keys(self._own, module, forward, call_key, self.opset_version) if reusable else []
            raw = [] if keys else None
            skeleton = _find_skeleton(keys)
            proto = _quietly(skeleton.fill, module) if skeleton is not None else None
            reused = proto is not None
            shared = current_build().shared
            if proto is None and shared is not None:  # the export another precision's build of this call made
                proto = shared.get(("onnx_export", call_key))
            attempts = _dynamic_attempts(samples) if dynamic else [None]
            if proto is None and offload:
                worker = _WorkerBuild.export(
                    module, forward, weights, in_leaves, in_spec, tensor_positions, attempts, names,
                    self.opset_version, int8=self.precision == "int8", fused=self.kernels == "fused", raw=bool(keys),
                )  # fmt: skip
                if worker is not None:
                    proto, exported = worker.exported_proto(), True
                    raw = [worker.raw_proto()] if keys and worker.raw is not None else None
            elif offload:
                worker = _WorkerBuild.run(source=proto, int8=self.precision == "int8", fused=self.kernels == "fused")
            if proto is None:
                with _exporting(), torch.inference_mode(False), torch.no_grad():
                    for attempt, dims in enumerate(attempts):
                        try:
                            program = export(dims)
                            break
                        except Exception:
                            if attempt == len(attempts) - 1:
                                raise
                            logger.debug("export with dynamic dims %s failed; trying fewer", dims, exc_info=True)
                exported = True
            if exported and shared is not None:  # for the other precision's build of this call, in this tuning
                shared[("onnx_export", call_key)] = proto if proto is not None else program.model_proto
            if keys and raw:  # this export, for the identical modules to come
                skeleton = _quietly(_Skeleton.of, raw[-1], module, (weight_names + input_names, output_names))
                if skeleton is not None:
                    _keep_skeleton(keys, skeleton)
            if worker is not None:  # the model the worker made (fused and quantized when asked) is the one to keep
                fused_ops = worker.fused
                if fused_ops is not None and not fused_ops:
                    worker.remove()
                    raise CandidateUnavailable(NOTHING_TO_FUSE)
                model, path, cleanup = self._place(None, None, module, large, place, file=worker.model)
            else:
                if self.kernels == "fused":  # before any session: a block where nothing fuses costs none
                    with _exporting():
                        proto, fused_ops = _fuse(proto if proto is not None else program.model_proto)
                    program = None
                    if not fused_ops:
                        raise CandidateUnavailable(NOTHING_TO_FUSE)
                if self.precision == "int8":
                    with _exporting():
                        proto, program = _quantize_int8(proto if proto is not None else program.model_proto), None
                model, path, cleanup = self._place(proto, program, module, large, place)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.intra_op_num_threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 4
        if device.type == "cpu" and self.arena == "shared":
            _register_shared_arena(onnxruntime)
            options.add_session_config_entry("session.use_env_allocators", "1")
        elif self.arena == "off":
            options.enable_cpu_mem_arena = False
        # Idle ORT threads must not spin: many sessions (one per block) share the cores with torch.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if device.type == "cuda":
            providers = [
                (p, {"device_id": device.index or 0}) if p == "CUDAExecutionProvider" else p for p in providers
            ]
        if worker is not None:  # optimised there already: here only the (cheap) loading
            options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
            model = worker.optimized
        try:
            session = onnxruntime.InferenceSession(model, options, providers=providers)
        finally:
            if worker is not None:
                worker.remove()
        if cached is not None:
            _check_interface(session, weight_names + input_names, output_names)
        runner = _SessionRunner(
            source="cache" if cached is not None else "reused" if reused else "export" if exported else "shared",
            session=session,
            device=device,
            input_positions={name: tensor_positions[i] for i, name in enumerate(input_names)},
            weight_sources=dict(zip(weight_names, _weight_sources(module, list(weights)), strict=True)),
            tree=_module_tree(module) if weights else [],
            output_names=output_names,
            out_spec=out_spec,
            out_template=[None if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves],
            out_tensor_positions=out_tensor_positions,
            out_shapes=None if dynamic else [tuple(out_leaves[i].shape) for i in out_tensor_positions],
            out_dtypes=[out_leaves[i].dtype for i in out_tensor_positions],
            built_in=worker.pid if worker is not None else None,
            kernels=fused_ops,
            arena_cap=(_arena_cap or 0) if device.type == "cpu" and self.arena == "shared" else 0,
        )
        if cleanup is not None:  # a temporary folder lives as long as the session that reads it
            weakref.finalize(runner, shutil.rmtree, cleanup, ignore_errors=True)
        dynamic_dims = _free_dims(session, input_names, [in_leaves[i] for i in tensor_positions]) if dynamic else None
        artifacts = [path.parent] if place is not None and path is not None else [path] if path else []
        return BuiltBackend(
            fn=runner,
            bakes_weights=bakes,
            artifacts=artifacts,
            dynamic_dims=dynamic_dims,
            loaded=cached is not None,
            reused=reused,
        )

    def _place(
        self,
        proto: Any,
        program: Any,
        module: torch.nn.Module,
        large: bool,
        place: ArtifactPlace | None,
        file: Path | None = None,
    ) -> tuple[Any, Path | None, Path | None]:
        """Where the session reads the model (`proto`, else the exported `program`, else the model `file` the build
        process wrote) from: the cache's staging folder, `artifact_dir` when set, else memory (or, past protobuf's
        2 GB limit, a temporary folder removed with the session). Returns (model, saved path, folder to remove);
        the model is None for a `file` kept nowhere (the session reads the build process's optimised model)."""
        if place is None and self.artifact_dir is None and not large:
            if file is not None:
                return None, None, None
            return (proto if proto is not None else program.model_proto).SerializeToString(), None, None
        if place is not None:
            directory, cleanup = place.save(), None
            path = directory / _MODEL_FILE
        else:
            directory = self.artifact_dir or Path(tempfile.mkdtemp(prefix="aitune_hf_onnx_"))
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"{type(module).__name__}_{id(module):x}_{len(list(directory.iterdir()))}.onnx"
            cleanup = None if self.artifact_dir else directory
        if file is not None:
            shutil.copyfile(file, path)
        elif proto is not None:
            import onnx

            onnx.save_model(proto, str(path))
        else:
            program.save(str(path), external_data=large)
        return str(path), path, cleanup


#: Keys of exports kept for reuse in this process (up to two per export: `_skeleton_keys`), their weights taken out
#: (`_Skeleton`): graphs only, a few hundred KB each at most; the least recently used goes first.
_SKELETONS_KEPT = 128
_skeletons: collections.OrderedDict[Any, _Skeleton] = collections.OrderedDict()
_skeletons_lock = threading.Lock()


def _skeleton_keys(
    owner: object,
    module: torch.nn.Module,
    forward: Callable[..., Any],
    call_key: tuple[Any, ...],
    opset_version: int | None,
) -> list[tuple[Any, ...]]:
    """The keys under which this build may find, and keeps, an export without weights (`_Skeleton`):
    - ("sibling", owner, ...): while the core applies an identical sibling's decision (`BuildContext.sibling`: same
      class, weight shapes and call, which is all the sibling decision promises), from the same backend instance;
    - ("state", ...): when the core gives the module's state digest (`BuildContext.state`: structure, plain values,
      the calls' signature and modes, training) and the forward is the module's own method, whose function is in
      the key (a closure or hook could trace to another graph).
    The opset is in both; precision and fused kernels are not (they rewrite the export afterwards)."""
    build = current_build()
    keys: list[tuple[Any, ...]] = [("sibling", owner, opset_version, call_key)]
    function = getattr(forward, "__func__", None)
    if build.state is not None and function is not None and getattr(forward, "__self__", None) is module:
        keys.append(("state", opset_version, build.state(), call_key, function))
    return keys


def forget_exports() -> None:
    """Drop the exports this process keeps for reuse (`_Skeleton`): later builds export afresh. For tests whose
    subject is the export itself (under threads, in the build process), and to free what they hold."""
    with _skeletons_lock:
        _skeletons.clear()


def _find_skeleton(keys: list[tuple[Any, ...]]) -> _Skeleton | None:
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


def _keep_skeleton(keys: list[tuple[Any, ...]], skeleton: _Skeleton) -> None:
    with _skeletons_lock:
        for key in keys:
            _skeletons[key] = skeleton
            _skeletons.move_to_end(key)
        while len(_skeletons) > _SKELETONS_KEPT:
            _skeletons.popitem(last=False)


def _fuse(proto: Any) -> tuple[Any, dict[str, int]]:
    """`proto` rewritten by onnxscript's ONNX Runtime fusions, as a new model (`proto`, which another build of the same
    tuning may read, is left as it is), and the fused operators the rewrite made (`com.microsoft` domain), by op type.

    The steps of `onnxscript.rewriter.ort_fusions.optimize_for_ort` but one: Gemm to MatMul + Add, the transformer
    fusions (`fuse_xformers`: attention, skip and RMS layer norm, GELU, rotary embeddings), then ORT's pattern rules
    without the InstanceNormalization -> `GroupNorm` rewrite, whose `com.microsoft` kernel ONNX Runtime has for CUDA
    only (a CPU session of it fails: "Could not find an implementation for GroupNorm(1)"; measured on onnxruntime
    1.32 with a SD UNet attention block). `fuse_xformers` is private upstream (`_core`): `_FUSION_STEPS` names what
    is used, and tests/backends/test_fused_kernels.py fails when it moves.

    The counts hold what the transformer fusions made (and the FusedMatMul of the pattern rules only beside them):
    empty when no attention, layer-norm or GELU pattern fused, which the caller reports as nothing to fuse (a
    FusedMatMul alone is what ONNX Runtime's own optimisations make anyway)."""
    import onnx_ir as ir
    import onnx_ir.passes.common as passes
    from onnxscript.rewriter import rewrite
    from onnxscript.rewriter.ort_fusions import ORT_PATTERN_REWRITE_RULES, instance_to_group_normalization
    from onnxscript.rewriter.ort_fusions._core import fuse_xformers
    from onnxscript.rewriter.rules.common import gemm_to_matmul_add_rule

    model = ir.from_proto(proto)
    rewrite(model, [gemm_to_matmul_add_rule])
    model, _ = fuse_xformers(model)
    if not _contrib_ops(model.graph):
        return proto, {}
    group_norm = set(instance_to_group_normalization.rules.rules)
    rewrite(model, [rule for rule in ORT_PATTERN_REWRITE_RULES if rule not in group_norm])
    ir.passes.Sequential(
        passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=1),
        passes.RemoveInitializersFromInputsPass(),
        passes.ShapeInferencePass(),
    )(model)
    return ir.to_proto(model), _contrib_ops(model.graph)


#: The upstream names `_fuse` uses (module, attribute), checked by a test: `_core` is private to onnxscript.
_FUSION_STEPS = (
    ("onnxscript.rewriter.ort_fusions", "ORT_PATTERN_REWRITE_RULES"),
    ("onnxscript.rewriter.ort_fusions.instance_to_group_normalization", "rules"),
    ("onnxscript.rewriter.ort_fusions._core", "fuse_xformers"),
    ("onnxscript.rewriter.rules.common", "gemm_to_matmul_add_rule"),
)


def _contrib_ops(graph: Any) -> dict[str, int]:
    """The `com.microsoft` nodes of an onnx_ir graph, by op type."""
    counts: dict[str, int] = {}
    for node in graph:
        if node.domain == "com.microsoft":
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _quantize_int8(proto: Any) -> Any:
    """`proto` with its MatMul and Gemm nodes quantized dynamically: 8-bit weights per output channel, uint8
    activations (U8S8, or U8U8 without VNNI: `_quantize_int8_file`); the rest, convolutions included, stays fp32."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="aitune_hf_int8_") as folder:
        source, target = Path(folder) / "fp32.onnx", Path(folder) / "int8.onnx"
        onnx.save_model(proto, str(source))
        _quantize_int8_file(source, target)
        return onnx.load_model(str(target))


def _quantize_int8_file(source: Path, target: Path) -> None:
    """`_quantize_int8` from model file to model file, in the format ONNX Runtime documents for this CPU: U8S8 (int8
    weights) where it has int8 dot-product instructions (VNNI, AMX-INT8); U8U8 (uint8 weights) elsewhere, where U8S8's
    AVX2 kernel (VPMADDUBSW) saturates its 16-bit sums: on an AVX2-only AMD EPYC a test MLP's outputs were then 0.087
    off (relative), outside the test's 0.05, which U8U8 meets."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from aitune_hf.hardware import cpu_int8_reason

    weights = QuantType.QInt8 if cpu_int8_reason() is None else QuantType.QUInt8
    quantize_dynamic(
        source, target, op_types_to_quantize=["MatMul", "Gemm"], per_channel=True, weight_type=weights,
        extra_options={"MatMulConstBOnly": True},
    )  # fmt: skip


def _sibling_key(module: torch.nn.Module, leaves: list[Any], spec: Any, dynamic: bool) -> tuple[Any, ...]:
    """Modules with equal keys export to the same graph up to their weights' values (checked: a sibling's build
    is checked against its own eager outputs like any build)."""
    weights = tuple((name, tuple(t.shape), t.dtype) for name, t in _named_weights(module).items())
    call = tuple(
        (tuple(leaf.shape), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
    )
    return type(module), weights, str(spec), call, dynamic


def _quietly(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or None when it raises (a sibling's export is an optimisation: without it, export)."""
    try:
        return fn(*args)
    except Exception:
        logger.debug("sibling export reuse skipped", exc_info=True)
        return None


class _Skeleton:
    """An export before onnxscript's optimizer, its weights taken out. There every parameter and buffer the graph reads
    is an initializer named as in the module, and nothing is computed from them yet (`weight.T`, `weight * 2`,
    GroupNorm's reshaped scale stay nodes), so `fill` puts another module's weights in by name and optimizes as the
    exporter does: the model that exporting that module would give (tests/backends/test_onnxruntime.py)."""

    def __init__(self, proto: Any, slots: list[tuple[int, str]], names: tuple[list[str], list[str]]) -> None:
        self.proto, self.slots, self.names = proto, slots, names

    @classmethod
    def of(cls, raw: Any, module: torch.nn.Module, names: tuple[list[str], list[str]]) -> _Skeleton:
        """The skeleton of `raw` (`_export_flat`'s model before its optimizer, which it takes over), exported from
        `module`; `names`: the model's input and output names, given after optimizing as `_export_flat` gives them."""
        weights = _named_weights(module)
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

        weights = _named_weights(module)
        proto = copy.deepcopy(self.proto)
        for index, name in self.slots:
            init, value = proto.graph.initializer[index], weights[name].detach().cpu().numpy()
            init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value), init.name))
        return ir.serde.serialize_model(_optimized(ir.serde.deserialize_model(proto), *self.names))


#: The model's file name inside an artifact folder (external data, if any, sits beside it).
_MODEL_FILE = "model.onnx"


def _check_interface(session: Any, inputs: list[str], outputs: list[str]) -> None:
    """A cached model must take (a subset of) the inputs this call passes and return the outputs it expects."""
    names = [i.name for i in session.get_inputs()]
    unknown = sorted(set(names) - set(inputs))
    returned = [o.name for o in session.get_outputs()]
    if unknown or returned != outputs:
        raise RuntimeError(
            f"the cached ONNX model does not fit this call: inputs {names} (expected from {inputs}), outputs "
            f"{returned} (expected {outputs})"
        )


_arena_lock = threading.Lock()
_arena_cap: int | None = None  # bytes, 0 for no cap; None until the shared arena is registered (once per process)

#: The shared arena's cap, read when the arena is made: GiB (a positive number) or "off". Unset: `ARENA_SHARE` of the
#: memory available then.
ARENA_CAP_ENV = "AITUNE_HF_ORT_ARENA_GIB"
#: The default cap, as a share of the memory available (`hardware.available_memory`) when the shared arena is made.
ARENA_SHARE = 0.5


def arena_cap() -> int:
    """The cap in bytes on the shared CPU arena (`arena="shared"`), 0 for none: `$AITUNE_HF_ORT_ARENA_GIB`, else half
    the memory available when the arena is made. A call whose working memory exceeds it fails in ONNX Runtime (a
    candidate that fails its check; a served call that falls back to eager) where it would otherwise have taken the
    machine's memory: a plain attention graph holds its whole score matrix, which at long token counts is many GiB
    where eager's SDPA kernel works in tiles (docs/backends.md). Fixed for the process once the arena exists."""
    if _arena_cap is not None:
        return _arena_cap
    from aitune_hf.hardware import available_memory

    return _cap_of(os.environ.get(ARENA_CAP_ENV, ""), available_memory())


def _cap_of(value: str, available: int | None) -> int:
    """The arena cap in bytes that `$AITUNE_HF_ORT_ARENA_GIB` = `value` asks for ("" for unset), with `available`
    bytes of memory available (None: unknown, no default cap)."""
    value = value.strip()
    if value.lower() == "off":
        return 0
    if value:
        try:
            gib = float(value)
        except ValueError:
            gib = math.nan
        if not math.isfinite(gib) or gib <= 0:
            raise ConfigError(f"{ARENA_CAP_ENV}={value!r} is not valid; valid values: a positive number of GiB, 'off'")
        return int(gib * 2**30)
    return int(available * ARENA_SHARE) if available else 0


def _over_cap(message: str, cap: int) -> str:
    """What a call that ran out of the capped shared arena tells the report, from ONNX Runtime's `message`."""
    op = re.search(r"running (\S+) node", message)
    sizes = re.search(r"Available memory of (\d+) is smaller than requested bytes of (\d+)", message)
    asked = "an allocation failed"
    if sizes:
        left, wanted = (int(n) / 2**20 for n in sizes.groups())
        asked = f"{op.group(1) if op else 'an operator'} asked for {wanted:.1f} MiB with {left:.1f} MiB left"
    return (
        f"this call needs more working memory than the shared ONNX Runtime arena's cap of {cap / 2**30:.2f} GiB "
        f"({asked}; raise it with {ARENA_CAP_ENV}, docs/backends.md)"
    )


def _register_shared_arena(onnxruntime: Any) -> None:
    """Registers one CPU arena allocator with ONNX Runtime's environment, once per process (sessions opt in to it
    with `session.use_env_allocators`), capped at `arena_cap()`."""
    global _arena_cap
    with _arena_lock:
        if _arena_cap is not None:
            return
        cap = arena_cap()
        info = onnxruntime.OrtMemoryInfo(
            "Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, onnxruntime.OrtMemType.DEFAULT
        )
        # Capped (0: none); extend by what a call requests (not the next power of two); default chunk and dead-byte
        # sizes.
        onnxruntime.create_and_register_allocator(info, onnxruntime.OrtArenaCfg(cap, 1, -1, -1))
        _arena_cap = cap


def _dynamic_attempts(samples: Sequence[Call]) -> list[list[frozenset[int]] | None]:
    """Which dimensions to export as dynamic, per tensor input, most general first. A family of several shapes:
    every dimension of size 2 or more, then only those that vary across the samples (some models trace only with
    fewer symbols). A family of one shape: every dimension of size 2 or more, then none (the build then serves
    that shape only). Sizes 0 and 1 stay fixed: a size-1 dimension is a broadcast one (an attention mask's head
    dimension), which a symbol would break."""
    shapes = [[tuple(t.shape) for t in pytree.tree_leaves(call) if isinstance(t, torch.Tensor)] for call in samples]
    widest = [tuple(t.shape) for t in pytree.tree_leaves(_widest(samples)) if isinstance(t, torch.Tensor)]
    every = [frozenset(d for d, size in enumerate(shape) if size > 1) for shape in widest]
    varying = [
        frozenset(d for d in every[index] if len({shape[index][d] for shape in shapes}) > 1)
        for index in range(len(widest))
    ]
    return [every, varying] if any(varying) else [every, None]


def _widest(samples: Sequence[Call]) -> Call:
    """The sample to export a shape family from: the most dimensions above 1 (the exporter fixes sizes 0 and 1),
    then the most elements."""

    def width(call: Call) -> tuple[int, int]:
        tensors = [leaf for leaf in pytree.tree_leaves(call) if isinstance(leaf, torch.Tensor)]
        return sum(size > 1 for t in tensors for size in t.shape), sum(t.numel() for t in tensors)

    return max(samples, key=width)


def _free_dims(session: Any, input_names: list[str], tensors: list[torch.Tensor]) -> tuple[frozenset[int], ...]:
    """Per tensor input, the dimensions the session leaves free (symbolic in the graph); an input the graph
    dropped takes any shape."""
    shapes = {i.name: i.shape for i in session.get_inputs()}
    free = []
    for name, tensor in zip(input_names, tensors, strict=True):
        shape = shapes.get(name)
        if shape is None:
            free.append(frozenset(range(tensor.dim())))
        else:
            free.append(frozenset(d for d, size in enumerate(shape) if not isinstance(size, int)))
    return tuple(free)


def _export_flat(
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
) -> Any:
    """One `torch.onnx.export` of `twin_forward`'s call (a private copy's: the exporter swaps its parameters for fake
    tensors while it traces), with the weights as inputs when `weights` names them and the tensor leaves as inputs;
    `dims`: per tensor input, the dimensions exported as `Dim.AUTO` (None: the example's shapes). `raw`, when given,
    gets the model before onnxscript's optimizer (`_Skeleton`); the program returned is optimized, as
    `torch.onnx.export(optimize=True)` returns it."""
    weight_names, input_names, output_names = names
    flat = _FlatForward(twin, twin_forward, in_leaves, in_spec, tensor_positions, list(weights)).train(training)
    # Weights are passed as they are (no copy) unless they are inference tensors, which the exporter cannot take
    # outside inference mode; tied weights are passed once per name.
    example = tuple(w.clone() if w.is_inference() else w.detach() for w in weights.values())
    # Row-major examples: the exporter cannot take every layout (channels-last, transposed views); the graph does not
    # depend on it, and `_cpu_array` feeds the session row-major copies of such inputs.
    example += tuple(in_leaves[i].clone(memory_format=torch.contiguous_format) for i in tensor_positions)
    dynamic_shapes = None
    if dims is not None:
        auto = torch.export.Dim.AUTO
        dynamic_shapes = (tuple(None for _ in weights) + tuple({d: auto for d in f} or None for f in dims),)
    registry = _torchlib_registry(opset_version)
    if registry is None:  # a torch whose exporter moved: its public call, which builds the table every time
        return torch.onnx.export(
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
    from torch.onnx._internal.exporter import _core

    # What `torch.onnx.export(..., dynamo=True)` does for these arguments (`_compat.export_compat`: tensor-only
    # positional examples, `Dim` dynamic shapes, no custom ops, no file), less building the table; its last steps
    # (optimize, then name inputs and outputs) are `_optimized`'s, so that `raw` can keep the model before them.
    program = _core.export(
        flat,
        example,
        None,
        registry=registry,
        dynamic_shapes=dynamic_shapes,
        opset_version=opset_version or _default_opset(),
        optimize=False,
        verbose=False,  # no "[torch.onnx] ..." progress lines (the exporter's only prints to stdout)
        report=False,
        verify=False,
        profile=False,
        dump_exported_program=False,
    )
    if raw is not None:
        raw.append(program.model_proto)
    program.model = _optimized(program.model, weight_names + input_names, output_names)
    return program


def _optimized(model: Any, input_names: list[str], output_names: list[str]) -> Any:
    """What `torch.onnx.export(optimize=True)` does to an exported ONNX IR model after tracing (`_core.export`):
    onnxscript's optimizer (`ONNXProgram.optimize`), then the inputs and outputs named. In place; returns the model."""
    from torch.onnx._internal.exporter import _ir_passes, _onnx_program

    model = _onnx_program.onnxscript_apis.optimize(model)
    if input_names:
        _ir_passes.rename_inputs(model, input_names)
    if output_names:
        _ir_passes.rename_outputs(model, output_names)
    return model


_registries: dict[int, Any] = {}
_registry_lock = threading.Lock()


def _default_opset() -> int:
    from torch.onnx import _constants as onnx_constants

    return onnx_constants.ONNX_DEFAULT_OPSET


def _torchlib_registry(opset_version: int | None) -> Any:
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
    opset = opset_version or _default_opset()
    registry_opset = max(opset, _constants.TORCHLIB_OPSET)  # as `export_compat` does for older opsets
    with _registry_lock:
        registry = _registries.get(registry_opset)
        if registry is None:
            registry = _registries[registry_opset] = _registration.ONNXRegistry.from_torchlib(
                opset_version=registry_opset
            )
    return registry


class _WorkerBuild:
    """What the build process (`backends/base.py`: `run_in_build_process`) made for one build of a background tuning:
    the exported model (when it exported), the model to keep (quantized when asked) and that model optimised by ONNX
    Runtime (`SessionOptions.optimized_model_filepath`, all levels), which a session of this process loads with graph
    optimisation off. Files in a folder of this process's, deleted by `remove` once the session is made.

    What stays here: the private copy (a deep copy, as without the build process) and its pickling, reading the
    exported model back (for the int8 variant; and the export before onnxscript's optimizer, for identical modules'
    builds: `_Skeleton`), an identical module's weights put into such an export and the result optimized by
    onnxscript, and the session's loading (weights pre-packed, no graph work). The session's model is the one ONNX
    Runtime would have made here: the same library, options and machine, the CPU provider only (a CUDA build
    stays in this process: the build process touches no GPU). When the block cannot be pickled, or the build process
    fails or ends, `export` and `run` return None (said at DEBUG) and the build runs here as in the foreground."""

    def __init__(self, folder: Path, made: dict[str, Any]) -> None:
        self.folder = folder
        self.pid: int = made["pid"]
        self.exported: str | None = made["export"]
        self.raw: str | None = made.get("raw")
        #: The fused operators by op type (`_fuse`) when fused kernels were asked for, else None; empty: nothing fused,
        #: and then no model was made.
        self.fused: dict[str, int] | None = made.get("fused")
        self.model = Path(made["model"]) if "model" in made else None
        self.optimized: str | None = made.get("optimized")

    @classmethod
    def export(
        cls,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        weights: dict[str, torch.Tensor],
        in_leaves: list[Any],
        in_spec: pytree.TreeSpec,
        tensor_positions: list[int],
        attempts: list[list[frozenset[int]] | None],
        names: tuple[list[str], list[str], list[str]],
        opset_version: int | None,
        int8: bool,
        fused: bool = False,
        raw: bool = False,
    ) -> _WorkerBuild | None:
        """Export (the first of `attempts` that traces), fuse when `fused`, quantize when `int8`, optimise: all in the
        build process; `raw`: keep the export before onnxscript's optimizer too (`raw_proto`, for `_Skeleton`)."""
        try:
            twin, twin_forward = _private_twin(module, forward)
            # The forward's function, not the bound method: a bound method pickles by attribute name, which on the
            # copy may find another forward (the tuning core's router is an instance attribute).
            payload = pickle.dumps((twin, twin_forward.__func__, weights, in_leaves), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            logger.debug("aitune_hf: the block cannot go to the build process; exporting here", exc_info=True)
            return None
        job = {
            "payload": payload,
            "spec": in_spec,
            "tensor_positions": tensor_positions,
            "training": module.training,
            "attempts": attempts,
            "names": names,
            "opset_version": opset_version,
            "raw": raw,
        }
        return cls._call(job, None, int8, fused)

    @classmethod
    def run(cls, source: Any, int8: bool, fused: bool = False) -> _WorkerBuild | None:
        """Fuse when `fused`, quantize when `int8`, optimise: `source` a model file (Path) or a model in memory
        (ModelProto)."""
        return cls._call(None, source, int8, fused)

    @classmethod
    def _call(cls, job: dict[str, Any] | None, source: Any, int8: bool, fused: bool) -> _WorkerBuild | None:
        folder = Path(tempfile.mkdtemp(prefix="aitune_hf_onnx_build_"))
        try:
            if source is not None and not isinstance(source, Path):
                import onnx

                onnx.save_model(source, str(folder / "source.onnx"))
                source = folder / "source.onnx"
            where = None if source is None else str(source)
            made = run_in_build_process(_build_in_worker, str(folder), job, where, int8, fused)
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)
            logger.debug("aitune_hf: the build process did not build this block; building it here", exc_info=True)
            return None
        return cls(folder, made)

    def exported_proto(self) -> Any:
        import onnx

        return onnx.load_model(self.exported)

    def raw_proto(self) -> Any:
        """The export before onnxscript's optimizer, when `export` was asked for it (else None)."""
        import onnx

        return onnx.load_model(self.raw) if self.raw is not None else None

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _build_in_worker(
    folder: str, job: dict[str, Any] | None, source: str | None, int8: bool, fused: bool = False
) -> dict[str, Any]:
    """In the build process (`_WorkerBuild`): export `job` (or start from the model file `source`), fuse when `fused`
    (`_fuse`; where nothing fuses, it stops there: no model, no session), quantize when `int8`, optimise; returns the
    files' paths (in `folder`), the fused operators (when `fused`) and this process's id."""
    import onnx
    import onnxruntime

    directory = Path(folder)
    made: dict[str, Any] = {"pid": os.getpid(), "export": None}
    if job is not None:
        attempts = job["attempts"]
        with _exporting(), torch.inference_mode(False), torch.no_grad():
            for attempt, dims in enumerate(attempts):
                # A fresh copy and fresh example tensors per attempt: a failed trace leaves symbolic state on them.
                twin, function, weights, in_leaves = pickle.loads(job["payload"])
                try:
                    raw: list[Any] | None = [] if job.get("raw") else None
                    program = _export_flat(
                        twin, types.MethodType(function, twin), weights, in_leaves, job["spec"],
                        job["tensor_positions"], job["training"], dims, job["names"], job["opset_version"], raw,
                    )  # fmt: skip
                    break
                except Exception:
                    if attempt == len(attempts) - 1:
                        raise
        source = str(directory / "export.onnx")
        onnx.save_model(program.model_proto, source)
        made["export"] = source
        if raw:
            onnx.save_model(raw[-1], str(directory / "raw.onnx"))
            made["raw"] = str(directory / "raw.onnx")
    assert source is not None
    model = Path(source)
    if fused:
        with _exporting():
            proto, made["fused"] = _fuse(onnx.load_model(str(model)))
        if not made["fused"]:
            return made
        onnx.save_model(proto, str(directory / "fused.onnx"))
        model = directory / "fused.onnx"
    if int8:
        with _exporting():
            _quantize_int8_file(model, directory / "int8.onnx")
        model = directory / "int8.onnx"
    made["model"] = str(model)
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(directory / "optimized.onnx")
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 4
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    onnxruntime.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    made["optimized"] = options.optimized_model_filepath
    return made


def _private_twin(module: torch.nn.Module, forward: Callable[..., Any]) -> tuple[torch.nn.Module, Callable[..., Any]]:
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


class _FlatForward(torch.nn.Module):
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


class _SessionRunner:
    """Calls an InferenceSession with torch tensors and returns the forward's output structure."""

    def __init__(
        self,
        source: str,
        session: Any,
        device: torch.device,
        input_positions: dict[str, int],
        weight_sources: dict[str, tuple[torch.nn.Module, str, str]],
        tree: list[tuple[torch.nn.Module, str, torch.nn.Module]],
        output_names: list[str],
        out_spec: pytree.TreeSpec,
        out_template: list[Any],
        out_tensor_positions: list[int],
        out_shapes: list[tuple[int, ...]] | None,
        out_dtypes: list[torch.dtype],
        built_in: int | None = None,
        kernels: dict[str, int] | None = None,
        arena_cap: int = 0,
    ) -> None:
        #: The cap in bytes on the arena this session allocates from (the shared arena's `arena_cap()`), 0 for none.
        self.arena_cap = arena_cap
        #: The fused ONNX Runtime operators (`com.microsoft` domain) in the model this session serves, by op type,
        #: for a `kernels="fused"` build (None otherwise, and for a model read from the cache).
        self.kernels = kernels
        #: The process id of the build process that exported and optimised the model (background tuning), or None
        #: when this process built it.
        self.built_in = built_in
        #: Where the model came from: "export"; "reused" (an identical module's export with these weights:
        #: `_skeleton_keys`); "shared" (another precision's build of this call, in this tuning); "cache".
        self.source = source
        self.session = session
        self.device = device
        graph_inputs = {i.name for i in session.get_inputs()}
        # The exporter drops inputs the graph does not use.
        self.input_positions = {n: p for n, p in input_positions.items() if n in graph_inputs}
        # Live weights: (owner submodule, "_parameters" or "_buffers", attribute), looked up on every call.
        self.weight_sources = {n: s for n, s in weight_sources.items() if n in graph_inputs}
        self.tree = tree
        self.output_names = output_names
        self.out_spec = out_spec
        self.out_template = out_template
        self.out_tensor_positions = out_tensor_positions
        self.out_shapes = out_shapes
        self.out_dtypes = out_dtypes

    def _current_weights(self) -> dict[str, torch.Tensor]:
        """The module's weights as they are now (re-assigned `.data`, replaced Parameters and in-place edits)."""
        for parent, name, child in self.tree:
            if parent._modules.get(name) is not child:
                raise RuntimeError(
                    f"submodule {name!r} of {type(parent).__name__} was replaced or removed since the onnxruntime "
                    "session was built; the graph no longer matches the module"
                )
        weights = {}
        for input_name, (owner, table, attribute) in self.weight_sources.items():
            tensor = getattr(owner, table).get(attribute)
            if tensor is None:
                raise RuntimeError(
                    f"{type(owner).__name__}.{attribute} is no longer a {table[1:-1]}; it was one when the "
                    "onnxruntime session was built"
                )
            weights[input_name] = tensor
        return weights

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves: list[Any] = []
        _leaves(args, leaves)
        _leaves(kwargs, leaves)
        inputs = self._current_weights() if self.weight_sources else {}
        inputs.update((name, leaves[pos]) for name, pos in self.input_positions.items())
        if self.device.type == "cuda":
            outputs = self._run_cuda(inputs)
        else:
            feeds = {name: _cpu_array(tensor) for name, tensor in inputs.items()}
            try:
                outputs = [torch.from_numpy(a) for a in self.session.run(self.output_names, feeds)]
            except Exception as error:
                if self.arena_cap and "BFCArena" in str(error):  # the shared arena's cap: `arena_cap()`
                    raise MemoryError(_over_cap(str(error), self.arena_cap)) from None
                raise
        out_leaves = list(self.out_template)
        for position, tensor in zip(self.out_tensor_positions, outputs, strict=True):
            out_leaves[position] = tensor
        return pytree.tree_unflatten(out_leaves, self.out_spec)

    def _run_cuda(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        import onnxruntime

        binding = self.session.io_binding()
        index = self.device.index or 0
        keep_alive = []
        for name, tensor in inputs.items():
            if tensor.device != self.device:  # e.g. a weight an offload hook moved away: never bind a foreign pointer
                raise RuntimeError(f"onnxruntime input {name} is on {tensor.device}, the session on {self.device}")
            # Standard (row-major) layout: copies non-contiguous, broadcast and channels-last tensors; keeps 0-d.
            tensor = tensor.detach().contiguous()
            keep_alive.append(tensor)
            if tensor.numel() == 0:  # no storage to point at: let onnxruntime hold the (empty) value
                value = onnxruntime.OrtValue.ortvalue_from_shape_and_type(
                    tuple(tensor.shape), _numpy_dtype(tensor.dtype), "cuda", index
                )
                keep_alive.append(value)
                binding.bind_ortvalue_input(name, value)
                continue
            binding.bind_input(name, "cuda", index, _numpy_dtype(tensor.dtype), tuple(tensor.shape), tensor.data_ptr())
        if self.out_shapes is None:  # a shape family: output shapes are known after the run
            for name in self.output_names:
                binding.bind_output(name, "cuda", index)
            torch.cuda.current_stream(self.device).synchronize()
            self.session.run_with_iobinding(binding)
            # A copy through the host: correct for every shape, slower than the fixed-shape path below.
            return [torch.from_numpy(value.numpy()).to(self.device) for value in binding.get_outputs()]
        # Fresh buffers every call: an output handed to the user is never overwritten later.
        outputs = [
            torch.empty(shape, dtype=dtype, device=self.device)
            for shape, dtype in zip(self.out_shapes, self.out_dtypes, strict=True)
        ]
        for name, tensor in zip(self.output_names, outputs, strict=True):
            if tensor.numel() == 0:
                binding.bind_output(name, "cuda", index)  # onnxruntime allocates; the torch output is empty anyway
                continue
            binding.bind_output(name, "cuda", index, _numpy_dtype(tensor.dtype), tuple(tensor.shape), tensor.data_ptr())
        torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(binding)
        return outputs


def _leaves(value: Any, out: list[Any]) -> None:
    """Append `value`'s leaves to `out`, in `pytree.tree_leaves` order (what the export flattened the call by).

    Plain tuples, lists and dicts (insertion order, as pytree flattens them) and leaves (a tensor, None, a scalar:
    any type pytree has no node for, tuple subclasses aside) are handled here: 3 us where `pytree.tree_leaves`
    takes 15 on a MiniLM BertLayer call, on every call served; other nodes (a namedtuple, an OrderedDict, a
    `ModelOutput`) are pytree's own to flatten."""
    kind = type(value)
    if kind is tuple or kind is list:
        for item in value:
            _leaves(item, out)
    elif kind is dict:
        for item in value.values():
            _leaves(item, out)
    elif kind not in pytree.SUPPORTED_NODES and not isinstance(value, tuple):  # pytree's own leaf test
        out.append(value)
    else:  # another registered node; a namedtuple or structseq (pytree flattens tuple subclasses by their kind)
        out.extend(pytree.tree_leaves(value))


def _numpy_dtype(dtype: torch.dtype) -> Any:
    return torch.empty((), dtype=dtype).numpy().dtype


def _cpu_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of `tensor` with its exact shape (0-d stays 0-d), in standard row-major layout: no copy
    when it already is, one copy for non-contiguous, broadcast (stride 0) and channels-last tensors."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.numpy()


def _named_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too) under every name, tied ones included."""
    weights = dict(module.named_parameters(remove_duplicate=False))
    weights.update(module.named_buffers(remove_duplicate=False))
    return weights


def _weight_sources(module: torch.nn.Module, names: list[str]) -> list[tuple[torch.nn.Module, str, str]]:
    """(owner submodule, "_parameters" or "_buffers", attribute) for each dotted weight name."""
    sources = []
    for name in names:
        path, _, attribute = name.rpartition(".")
        owner = module.get_submodule(path)
        sources.append((owner, "_parameters" if attribute in owner._parameters else "_buffers", attribute))
    return sources


def _module_tree(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, name, child) for every submodule edge: the structure the exported graph reproduces."""
    return [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent._modules.items()
        if child is not None
    ]


def _needs_external_data(module: torch.nn.Module) -> bool:
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
_state = threading.local()  # `depth`: how many `_exporting()` blocks the current thread is in
_filter_lock = threading.Lock()


class _QuietWhileExporting(logging.Filter):
    """Drops records below ERROR logged by a thread that is inside `_exporting()` (the exporter's progress
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
def _exporting() -> Iterator[None]:
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
