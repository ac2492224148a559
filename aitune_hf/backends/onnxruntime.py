"""ONNX Runtime: one session per signature over the block's ONNX export (`backends/onnx/`: the export, its reuse and
the build process are shared with the other ONNX runtimes), with ONNX Runtime's own steps: fused kernels, int8, the
shared arena and its cap, and the session runner.

The weights are either graph inputs fed from the module's current tensors on every call ("live"), or baked into the
graph as initializers ("baked"), in which case the tuning core watches them. See `OnnxRuntimeBackend` for why "baked"
is the default.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
)
from aitune_hf.backends.onnx.export import (
    EXPORT_REVISION,
    cpu_array,
    exporting,
    leaves_into,
    module_tree,
    needs_external_data,
    numpy_dtype,
    weight_sources,
)
from aitune_hf.backends.onnx.model import CallLayout, obtain
from aitune_hf.backends.onnx.worker import WorkerBuild
from aitune_hf.errors import CandidateUnavailable, ConfigError

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'aitune-hf[onnx]'"
_WEIGHT_MODES = ("baked", "live")
_ARENAS = ("shared", "session", "off")
_KERNELS = ("default", "fused")
#: Why a `kernels="fused"` build does not apply to a block (reported as the candidate's "unavailable: ..." reason).
NOTHING_TO_FUSE = "nothing to fuse: no attention, layer-norm or GELU pattern in this block"


@dataclass
class _Model:
    """The model one session reads, and what came with it (`OnnxRuntimeBackend._model`, or the cache's)."""

    model: Any  # what the session reads: bytes, a path (str), or the build process's optimised model
    path: Path | None  # where it was saved (the cache's staging folder, `artifact_dir`, a temporary one), if saved
    cleanup: Path | None  # a temporary folder to remove with the session
    source: str  # "cache", or how `obtain` got the export ("export", "reused", "shared")
    worker: WorkerBuild | None  # what the build process made (removed once the session loaded it)
    fused_ops: dict[str, int] | None  # kernels="fused": the fused operators, by type

    @classmethod
    def cached(cls, folder: Path) -> _Model:
        """The model this backend saved in the cache's `folder` before."""
        path = folder / _MODEL_FILE
        return cls(str(path), path, None, "cache", None, None)

    def artifacts(self, in_place: bool) -> list[Path]:
        """The files to keep with the decision: the folder in the cache's place (`in_place`), else the saved file."""
        if in_place and self.path is not None:
            return [self.path.parent]
        return [self.path] if self.path else []


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
    builds_privately = True  # exports a deep copy of the module (`private_twin`)
    build_process_imports = ("onnx", "onnxscript", "onnxruntime", "torch.onnx")

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
        #: In the keys of this instance's sibling exports (`skeleton_keys`): a sibling reuses an export of the same
        #: registration's candidate only, as the sibling decision it applies is that registration's.
        self._own = object()

    @property
    def bakes_weights(self) -> bool:  # type: ignore[override]
        return self.weights == "baked"

    reads = "onnx"  # every build reads the tuning's one ONNX export (`Backend.reads`)

    @property
    def build_cost(self) -> str:  # type: ignore[override]
        """The int8 variant is a slow build: its dynamic quantization of a whole MiniLM takes 8-21 s (18.3 s on an Ice
        Lake Xeon without bf16, where it was the first int8 candidate built, delayed the first tuned call to 37.8 s and
        did not serve), OpenVINO's int8 of the same export 2.6 s. As a slow build it comes after the cheap ones of its
        precision and is skipped where one of them won clearly (`MinLatency`), as `cannot_win` skips it in the search;
        where none did (or OpenVINO is not installed) it is built as before."""
        return "slow" if self.precision == "int8" else "cheap"

    def with_precision(self, precision: str) -> OnnxRuntimeBackend | None:
        if precision == self.precision:
            return self
        if precision != "int8" or self.weights != "baked":
            return None
        return self._variant(precision=precision)

    def kernel_variants(self) -> list[Backend]:
        """The fused-kernel variant of a plain build (`kernels="fused"`), same options and precision."""
        return [self._variant(kernels="fused")] if self.kernels == "default" else []

    def cannot_win(
        self,
        timed: Sequence[tuple[str, str, float | None]],
        elsewhere: Mapping[str, Sequence[tuple[str, str, float | None]]] | None = None,
    ) -> str | None:
        """The int8 variant, where OpenVINO's int8 was timed on the same target: ONNX Runtime's int8 (dynamic
        quantization: MatMulInteger with the activations quantized per call, the rest in fp32) was no faster than
        OpenVINO's int8 on any workload measured on this project's CPUs, and its build is the slowest of the cheap ones
        (a whole MiniLM: 8-21 s of quantization, then lost to OpenVINO int8)."""
        if self.precision != "int8":
            return None
        openvino = [(name, speedup) for name, precision, speedup in timed
                    if name.startswith("openvino") and precision == "int8" and speedup is not None]  # fmt: skip
        if not openvino:
            return None
        name, speedup = max(openvino, key=lambda item: item[1])
        return (f"{name} was timed here at {speedup:.2f}x: ONNX Runtime's int8 was no faster than OpenVINO's on the "
                "workloads measured, and builds slowest")  # fmt: skip

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
        found = {package: installed_version(package) for package in ("onnxruntime", "onnx", "onnxscript")}
        return {**found, "aitune-hf onnx export": EXPORT_REVISION}

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
        """Export once (or reuse an export: `onnx.model.obtain`) and open one session. With `dynamic=True` every
        dimension of every tensor input is exported as `Dim.AUTO`: the exporter keeps dynamic what the model allows
        (sizes 0 and 1 and sizes its code depends on stay fixed), and `dynamic_dims` reads which dimensions stayed free
        off the session."""
        # No `set_default_logger_severity`: it is process-wide (and cannot be read back); the session's own
        # `log_severity_level` below keeps this session quiet.
        import onnxruntime

        bakes = self._bakes(module)
        layout = CallLayout.of(module, forward, samples, dynamic, live=not bakes)
        place = current_build().place
        cached = place.load(self, bakes) if place is not None else None
        large = bakes and needs_external_data(module)
        if self.kernels == "fused" and large and cached is None:
            raise CandidateUnavailable(
                "kernels='fused' rewrites the model in memory, and this block's weights pass protobuf's 2 GB limit"
            )
        providers = self._providers(layout.device)
        if cached is not None:  # a model this backend exported before, for this module, signature and weights
            # Loaded here, even in the background: a replica that starts warm reads its decisions before it serves,
            # and starting the build process (a Python that imports torch and onnx) would add seconds to its warm-up.
            made = _Model.cached(cached)
        else:
            made = self._model(module, forward, samples, layout, large, place, providers)
        session = self._open(onnxruntime, made, layout.device, providers)
        if cached is not None:
            _check_interface(session, layout.weight_names + layout.input_names, layout.output_names)
        runner = self._runner(module, session, layout, made)
        tensors = [layout.in_leaves[i] for i in layout.tensor_positions]
        return BuiltBackend(
            fn=runner,
            bakes_weights=bakes,
            artifacts=made.artifacts(in_place=place is not None),
            dynamic_dims=_free_dims(session, layout.input_names, tensors) if dynamic else None,
            loaded=cached is not None,
            reused=made.source == "reused",
        )

    def _providers(self, device: torch.device) -> list[Any]:
        """The execution providers asked for, else CUDA's (on a CUDA device) and the CPU's."""
        return self.providers or (["CUDAExecutionProvider"] if device.type == "cuda" else []) + ["CPUExecutionProvider"]

    def _open(self, onnxruntime: Any, made: _Model, device: torch.device, providers: list[Any]) -> Any:
        """The session of `made`; what the build process left for it is removed once the session has loaded it."""
        try:
            return self._session(onnxruntime, made.model, device, providers, optimized=made.worker is not None)
        finally:
            if made.worker is not None:
                made.worker.remove()

    def _runner(self, module: torch.nn.Module, session: Any, layout: CallLayout, made: _Model) -> _SessionRunner:
        """What serves the calls: the session behind the forward's call layout; a temporary folder the model was saved
        in lives as long as it."""
        runner = _SessionRunner(
            source=made.source,
            session=session,
            layout=layout,
            weight_sources=dict(zip(layout.weight_names, weight_sources(module, list(layout.weights)), strict=True)),
            tree=module_tree(module) if layout.weights else [],
            built_in=made.worker.pid if made.worker is not None else None,
            kernels=made.fused_ops,
            arena_cap=(_arena_cap or 0) if layout.device.type == "cpu" and self.arena == "shared" else 0,
        )
        if made.cleanup is not None:
            weakref.finalize(runner, shutil.rmtree, made.cleanup, ignore_errors=True)
        return runner

    def _model(
        self,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        samples: Sequence[Call],
        layout: CallLayout,
        large: bool,
        place: ArtifactPlace | None,
        providers: list[str],
    ) -> _Model:
        """The model the session reads, made afresh (`obtain`), fused and quantized when asked."""
        # Background tuning: the heavy steps (export, int8 quantization, graph optimisation) run in the build process
        # (`backends/base.py`), which holds no GIL of this one.
        offload = current_build().private_only and layout.device.type == "cpu" and not large
        offload = offload and providers == ["CPUExecutionProvider"]
        obtained = obtain(
            layout, module, forward, samples, owner=self._own, opset_version=self.opset_version,
            reusable=self._bakes(module) and not large, offload=offload,
            finish=(_finish_in_worker, (self.precision == "int8", self.kernels == "fused")),
        )  # fmt: skip
        worker = obtained.worker
        if worker is not None:  # the model the worker made (fused and quantized when asked) is the one to keep
            fused_ops = worker.made.get("fused")
            if fused_ops is not None and not fused_ops:
                worker.remove()
                raise CandidateUnavailable(NOTHING_TO_FUSE)
            _, path, cleanup = self._place(None, None, module, large, place, file=Path(worker.made["model"]))
            return _Model(worker.made["optimized"], path, cleanup, obtained.how, worker, fused_ops)
        proto, program, fused_ops = obtained.proto, obtained.program, None
        if self.kernels == "fused":  # before any session: a block where nothing fuses costs none
            with exporting():
                proto, fused_ops = _fuse(obtained.model_proto)
            program = None
            if not fused_ops:
                raise CandidateUnavailable(NOTHING_TO_FUSE)
        if self.precision == "int8":
            with exporting():
                proto, program = _quantize_int8(proto if proto is not None else program.model_proto), None
        model, path, cleanup = self._place(proto, program, module, large, place)
        return _Model(model, path, cleanup, obtained.how, None, fused_ops)

    def _session(
        self, onnxruntime: Any, model: Any, device: torch.device, providers: list[Any], optimized: bool
    ) -> Any:
        """An InferenceSession of `model` (bytes or a path) with this backend's options; `optimized`: the build process
        optimised the model already, so only the (cheap) loading is left."""
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
        if optimized:
            options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        return onnxruntime.InferenceSession(model, options, providers=providers)

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


def _finish_in_worker(directory: Path, model: Path, int8: bool, fused: bool) -> dict[str, Any]:
    """ONNX Runtime's steps in the build process (`onnx.worker`): fuse when `fused` (`_fuse`; where nothing fuses it
    stops there: no model, no session), quantize when `int8`, then optimise with ONNX Runtime (all levels, saved with
    `optimized_model_filepath`) for a session here to load with graph optimisation off. Returns the files' paths and,
    when `fused`, the fused operators."""
    import onnx
    import onnxruntime

    made: dict[str, Any] = {}
    if fused:
        with exporting():
            proto, made["fused"] = _fuse(onnx.load_model(str(model)))
        if not made["fused"]:
            return made
        onnx.save_model(proto, str(directory / "fused.onnx"))
        model = directory / "fused.onnx"
    if int8:
        with exporting():
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


class _SessionRunner:
    """Calls an InferenceSession with torch tensors and returns the forward's output structure."""

    def __init__(
        self,
        source: str,
        session: Any,
        layout: CallLayout,
        weight_sources: dict[str, tuple[torch.nn.Module, str, str]],
        tree: list[tuple[torch.nn.Module, str, torch.nn.Module]],
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
        #: `onnx.reuse`); "shared" (another build's export of this call, in this tuning); "cache".
        self.source = source
        self.session = session
        self.device = layout.device
        graph_inputs = {i.name for i in session.get_inputs()}
        # The exporter drops inputs the graph does not use.
        self.input_positions = {n: p for n, p in layout.input_positions.items() if n in graph_inputs}
        # Live weights: (owner submodule, "_parameters" or "_buffers", attribute), looked up on every call.
        self.weight_sources = {n: s for n, s in weight_sources.items() if n in graph_inputs}
        self.tree = tree
        self.output_names = layout.output_names
        self.out_spec = layout.out_spec
        self.out_template = layout.out_template
        self.out_tensor_positions = layout.out_tensor_positions
        self.out_shapes = layout.out_shapes
        self.out_dtypes = layout.out_dtypes

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
        leaves_into(args, leaves)
        leaves_into(kwargs, leaves)
        inputs = self._current_weights() if self.weight_sources else {}
        inputs.update((name, leaves[pos]) for name, pos in self.input_positions.items())
        if self.device.type == "cuda":
            outputs = self._run_cuda(inputs)
        else:
            feeds = {name: cpu_array(tensor) for name, tensor in inputs.items()}
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
                    tuple(tensor.shape), numpy_dtype(tensor.dtype), "cuda", index
                )
                keep_alive.append(value)
                binding.bind_ortvalue_input(name, value)
                continue
            binding.bind_input(name, "cuda", index, numpy_dtype(tensor.dtype), tuple(tensor.shape), tensor.data_ptr())
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
            binding.bind_output(name, "cuda", index, numpy_dtype(tensor.dtype), tuple(tensor.shape), tensor.data_ptr())
        torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(binding)
        return outputs
