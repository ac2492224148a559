"""The heavy steps of a background build in the build process (`backends/base.py`: `run_in_build_process`): the export,
and a runtime's own steps on the model (`finish`: ONNX Runtime's fusions, int8 quantization and graph optimisation); or
the trace alone, with a runtime's steps on it (`WorkerBuild.trace`: OpenVINO's PyTorch frontend converting it); or the
private copy alone, which a runtime traces its own way (`WorkerBuild.module`: OpenVINO's trace door).

What stays in the serving process: the private copy (a deep copy, as without the build process) and its pickling,
reading the exported model back (for another precision's build, and the export before onnxscript's optimizer for
identical modules' builds: `reuse.Skeleton`), an identical module's weights put into such an export, and loading the
runtime's model (weights pre-packed, no graph work). The build process touches no GPU: a CUDA build stays here. When the
block cannot be pickled, or the build process fails or ends, `WorkerBuild.export` and `WorkerBuild.run` return None
(said at DEBUG) and the build runs here as in the foreground."""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import shutil
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from aitune_hf.backends.base import pickle_out_of_band, run_in_build_process
from aitune_hf.backends.onnx.export import export_flat, first_that_traces, private_twin, trace_flat
from aitune_hf.errors import TuningError

logger = logging.getLogger(__name__)

#: A runtime's steps in the build process: a module-level function (it goes by pickle) called as
#: `fn(folder, model_file, *args)`, returning plain data for `WorkerBuild.made`.
Finish = tuple[Callable[..., dict[str, Any]], tuple[Any, ...]]


class Layout(Protocol):
    """What an export in the build process needs of a call's layout (`model.CallLayout`, named here by its shape so
    that this module, below `model.py`, does not import it)."""

    in_leaves: list[Any]
    in_spec: pytree.TreeSpec
    tensor_positions: list[int]
    weights: dict[str, torch.Tensor]

    @property
    def names(self) -> tuple[list[str], list[str], list[str]]: ...


class WorkerBuild:
    """What the build process made for one build: the exported model (when it exported), the export before
    onnxscript's optimizer (when asked), and what the runtime's `finish` returned (`made`). Files in a folder of this
    process's, deleted by `remove` once the runtime has loaded what it needs."""

    def __init__(self, folder: Path, made: dict[str, Any]) -> None:
        self.folder = folder
        self.pid: int = made["pid"]
        self.exported: str | None = made["export"]
        self.raw: str | None = made.get("raw")
        #: Everything the build process returned, the runtime's `finish` results included.
        self.made = made

    @classmethod
    def export(
        cls,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        layout: Layout,
        attempts: list[list[frozenset[int]] | None],
        opset_version: int | None,
        finish: Finish | None,
        raw: bool = False,
    ) -> WorkerBuild | None:
        """Export (the first of `attempts` that traces), then `finish`: all in the build process; `raw`: keep the export
        before onnxscript's optimizer too (`raw_proto`, for `reuse.Skeleton`)."""
        job = cls._job(module, forward, layout, attempts, opset_version, raw)
        return cls._call(job, None, finish) if job is not None else None

    @classmethod
    def trace(
        cls,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        layout: Layout,
        attempts: list[list[frozenset[int]] | None],
        finish: Finish,
    ) -> WorkerBuild | None:
        """Trace the call (`export.trace_flat`, the first of `attempts` that traces: the program OpenVINO's PyTorch
        frontend reads), then `finish(folder, program, *args)`: all in the build process. No ONNX model is made.
        Raises `TuningError` (with what failed) where the block cannot go there or the trace or `finish` failed."""
        job = cls._job(module, forward, layout, attempts, None, raw=False)
        if job is None:
            raise TuningError("the block cannot be pickled for the build process")
        return cls._call({**job, "form": "program"}, None, finish, strict=True)

    @classmethod
    def module(
        cls, module: torch.nn.Module, forward: Callable[..., Any], layout: Layout, finish: Finish
    ) -> WorkerBuild:
        """`finish(folder, (copy, copy_forward, in_leaves, in_spec, tensor_positions, training), *args)` in the build
        process, on a private copy of the block: the runtime traces it its own way (OpenVINO's trace door,
        `torch.jit.trace`). No ONNX model is made. Raises `TuningError` (with what failed) where the block cannot go
        there or `finish` failed."""
        job = cls._job(module, forward, layout, [None], None, raw=False)
        if job is None:
            raise TuningError("the block cannot be pickled for the build process")
        return cls._call({**job, "form": "module"}, None, finish, strict=True)  # type: ignore[return-value]

    @classmethod
    def _job(
        cls,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        layout: Layout,
        attempts: list[list[frozenset[int]] | None],
        opset_version: int | None,
        raw: bool,
    ) -> dict[str, Any] | None:
        """What the build process needs to trace the call (a pickled private copy), or None when it cannot go there."""
        try:
            twin, twin_forward = private_twin(module, forward)
            # The forward's function, not the bound method: a bound method pickles by attribute name, which on the
            # copy may find another forward (the tuning core's router is an instance attribute).
            payload, buffers = pickle_out_of_band((twin, twin_forward.__func__, layout.weights, layout.in_leaves))
        except Exception:
            logger.debug("aitune_hf: the block cannot go to the build process; exporting here", exc_info=True)
            return None
        return {
            "payload": payload,
            "buffers": buffers,
            "spec": layout.in_spec,
            "tensor_positions": layout.tensor_positions,
            "training": module.training,
            "attempts": attempts,
            "names": layout.names,
            "opset_version": opset_version,
            "raw": raw,
        }

    @classmethod
    def run(cls, source: Any, finish: Finish) -> WorkerBuild | None:
        """`finish` on `source`, a model file (Path) or a model in memory (ModelProto), in the build process."""
        return cls._call(None, source, finish)

    @classmethod
    def _call(
        cls, job: dict[str, Any] | None, source: Any, finish: Finish | None, strict: bool = False
    ) -> WorkerBuild | None:
        folder = Path(tempfile.mkdtemp(prefix="aitune_hf_onnx_build_"))
        # Removed by `remove` once the runtime has what it needs; and at exit, whatever still holds it then.
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        try:
            if source is not None and not isinstance(source, Path):
                import onnx

                onnx.save_model(source, str(folder / "source.onnx"))
                source = folder / "source.onnx"
            where = None if source is None else str(source)
            made = run_in_build_process(build_in_worker, str(folder), job, where, finish)
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)
            if strict:  # the caller has no other way to build it (`trace`): what failed is the build's reason
                raise
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


def build_in_worker(
    folder: str, job: dict[str, Any] | None, source: str | None, finish: Finish | None
) -> dict[str, Any]:
    """In the build process (`WorkerBuild`): export `job` (or start from the model file `source`), then the runtime's
    `finish` on the model; returns the files' paths (in `folder`), what `finish` returned and this process's id."""
    import onnx

    directory = Path(folder)
    made: dict[str, Any] = {"pid": os.getpid(), "export": None}
    if job is not None:

        def fresh() -> tuple[torch.nn.Module, Any, dict[str, torch.Tensor], list[Any]]:
            """A fresh copy and fresh example tensors per attempt: a failed trace leaves symbolic state on them."""
            twin, function, weights, in_leaves = pickle.loads(job["payload"], buffers=job["buffers"])
            return twin, types.MethodType(function, twin), weights, in_leaves

        flat = (job["spec"], job["tensor_positions"], job["training"])
        if job.get("form") == "module":  # the copy itself, traced by `finish` (`WorkerBuild.module`)
            assert finish is not None
            twin, twin_forward, _, in_leaves = fresh()
            fn, args = finish
            made.update(fn(directory, (twin, twin_forward, in_leaves, *flat), *args))
            return made
        if job.get("form") == "program":  # the trace alone, handed to `finish` (`WorkerBuild.trace`)
            assert finish is not None
            program = first_that_traces(
                job["attempts"], fresh, lambda twin, dims: trace_flat(*twin, *flat, dims), "trace"
            )
            fn, args = finish
            made.update(fn(directory, program, *args))
            return made
        raw: list[Any] | None = [] if job.get("raw") else None
        program = first_that_traces(
            job["attempts"],
            fresh,
            lambda twin, dims: export_flat(*twin, *flat, dims, job["names"], job["opset_version"], raw),
            "export",
        )
        source = str(directory / "export.onnx")
        onnx.save_model(program.model_proto, source)
        made["export"] = source
        if raw:
            onnx.save_model(raw[-1], str(directory / "raw.onnx"))
            made["raw"] = str(directory / "raw.onnx")
    assert source is not None
    if finish is not None:
        fn, args = finish
        made.update(fn(directory, Path(source), *args))
    return made
