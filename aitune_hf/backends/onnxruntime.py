"""ONNX Runtime: export the forward with `torch.onnx.export` and run one session per signature.

Inputs and outputs are flattened to their tensor leaves; every non-tensor leaf (None, a scalar) is part of
the signature and baked into the graph. The weights are baked too, so the tuning core watches them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from aitune_hf.backends.base import Backend, BuiltBackend, Call, register_backend

_INSTALL_HINT = "pip install 'aitune-hf[onnx]'"


@register_backend
class OnnxRuntimeBackend(Backend):
    """Export with the Dynamo-based ONNX exporter, run with onnxruntime (CPU, or CUDA where present)."""

    name = "onnxruntime"
    bakes_weights = True

    def __init__(
        self,
        providers: Sequence[str] | None = None,
        intra_op_num_threads: int | None = None,
        opset_version: int | None = None,
        artifact_dir: str | Path | None = None,
    ) -> None:
        self.providers = list(providers) if providers else None
        self.intra_op_num_threads = intra_op_num_threads
        self.opset_version = opset_version
        self.artifact_dir = Path(artifact_dir) if artifact_dir else None

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

    def build(self, module: torch.nn.Module, forward: Callable[..., Any], samples: Sequence[Call]) -> BuiltBackend:
        import onnxruntime

        onnxruntime.set_default_logger_severity(4)  # fatal only: failures are reported by aitune_hf
        args, kwargs = samples[0]
        in_leaves, in_spec = pytree.tree_flatten((args, kwargs))
        tensor_positions = [i for i, leaf in enumerate(in_leaves) if isinstance(leaf, torch.Tensor)]
        for leaf in in_leaves:
            if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.bfloat16:
                raise TypeError("bfloat16 tensors cannot cross into onnxruntime here; use float16 or float32")
        with torch.no_grad():
            out_leaves, out_spec = pytree.tree_flatten(forward(*args, **kwargs))
        out_tensor_positions = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)]
        if not out_tensor_positions:
            raise TypeError("the forward returns no tensor; nothing to export")

        flat = _FlatForward(module, forward, in_leaves, in_spec, tensor_positions).train(module.training)
        input_names = [f"input_{i}" for i in range(len(tensor_positions))]
        output_names = [f"output_{i}" for i in range(len(out_tensor_positions))]
        device = next(leaf.device for leaf in in_leaves if isinstance(leaf, torch.Tensor))

        with _quiet_exporter(), torch.inference_mode(False), torch.no_grad():
            example = tuple(in_leaves[i].clone() for i in tensor_positions)
            program = torch.onnx.export(
                flat,
                example,
                input_names=input_names,
                output_names=output_names,
                opset_version=self.opset_version,
                dynamo=True,
                optimize=True,
                verbose=False,
            )
            model, path, cleanup = self._place(program, module)

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.intra_op_num_threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 4
        # Idle ORT threads must not spin: many sessions (one per block) share the cores with torch.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = self.providers or (
            ["CUDAExecutionProvider", "CPUExecutionProvider"] if device.type == "cuda" else ["CPUExecutionProvider"]
        )
        if device.type == "cuda":
            providers = [
                (p, {"device_id": device.index or 0}) if p == "CUDAExecutionProvider" else p for p in providers
            ]
        session = onnxruntime.InferenceSession(model, options, providers=providers)
        runner = _SessionRunner(
            session=session,
            device=device,
            input_positions={name: tensor_positions[i] for i, name in enumerate(input_names)},
            output_names=output_names,
            out_spec=out_spec,
            out_template=[None if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves],
            out_tensor_positions=out_tensor_positions,
            out_shapes=[tuple(out_leaves[i].shape) for i in out_tensor_positions],
            out_dtypes=[out_leaves[i].dtype for i in out_tensor_positions],
        )
        if cleanup is not None:  # a temporary folder lives as long as the session that reads it
            weakref.finalize(runner, shutil.rmtree, cleanup, ignore_errors=True)
        return BuiltBackend(fn=runner, bakes_weights=True, artifacts=[path] if path else [])

    def _place(self, program: Any, module: torch.nn.Module) -> tuple[Any, Path | None, Path | None]:
        """Where the session reads the model from: `artifact_dir` when set, else memory (or, past protobuf's
        2 GB limit, a temporary folder removed with the session). Returns (model, saved path, folder to remove)."""
        large = _needs_external_data(module)
        if self.artifact_dir is None and not large:
            return program.model_proto.SerializeToString(), None, None
        directory = self.artifact_dir or Path(tempfile.mkdtemp(prefix="aitune_hf_onnx_"))
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{type(module).__name__}_{id(module):x}_{len(list(directory.iterdir()))}.onnx"
        program.save(str(path), external_data=large)
        return str(path), path, None if self.artifact_dir else directory


class _FlatForward(torch.nn.Module):
    """`forward(*tensors)`: rebuilds the call from its tensor leaves and the baked non-tensor leaves."""

    def __init__(
        self,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        leaves: list[Any],
        spec: pytree.TreeSpec,
        tensor_positions: list[int],
    ) -> None:
        super().__init__()
        self.module = module  # registers the weights with the exporter
        self._forward = forward
        self._constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self._spec = spec
        self._tensor_positions = tensor_positions

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._constants)
        for position, tensor in zip(self._tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        out_leaves, _ = pytree.tree_flatten(self._forward(*args, **kwargs))
        return tuple(leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor))


class _SessionRunner:
    """Calls an InferenceSession with torch tensors and returns the forward's output structure."""

    def __init__(
        self,
        session: Any,
        device: torch.device,
        input_positions: dict[str, int],
        output_names: list[str],
        out_spec: pytree.TreeSpec,
        out_template: list[Any],
        out_tensor_positions: list[int],
        out_shapes: list[tuple[int, ...]],
        out_dtypes: list[torch.dtype],
    ) -> None:
        self.session = session
        self.device = device
        graph_inputs = {i.name for i in session.get_inputs()}
        # The exporter drops inputs the graph does not use.
        self.input_positions = {n: p for n, p in input_positions.items() if n in graph_inputs}
        self.output_names = output_names
        self.out_spec = out_spec
        self.out_template = out_template
        self.out_tensor_positions = out_tensor_positions
        self.out_shapes = out_shapes
        self.out_dtypes = out_dtypes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        if self.device.type == "cuda":
            outputs = self._run_cuda(leaves)
        else:
            feeds = {
                name: np.ascontiguousarray(leaves[pos].detach().cpu().numpy())
                for name, pos in self.input_positions.items()
            }
            outputs = [torch.from_numpy(a) for a in self.session.run(self.output_names, feeds)]
        out_leaves = list(self.out_template)
        for position, tensor in zip(self.out_tensor_positions, outputs, strict=True):
            out_leaves[position] = tensor
        return pytree.tree_unflatten(out_leaves, self.out_spec)

    def _run_cuda(self, leaves: list[Any]) -> list[torch.Tensor]:
        binding = self.session.io_binding()
        keep_alive = []
        for name, pos in self.input_positions.items():
            tensor = leaves[pos].detach().contiguous()
            keep_alive.append(tensor)
            binding.bind_input(
                name, "cuda", self.device.index or 0, _numpy_dtype(tensor.dtype), tuple(tensor.shape), tensor.data_ptr()
            )
        # Fresh buffers every call: an output handed to the user is never overwritten later.
        outputs = [
            torch.empty(shape, dtype=dtype, device=self.device)
            for shape, dtype in zip(self.out_shapes, self.out_dtypes, strict=True)
        ]
        for name, tensor in zip(self.output_names, outputs, strict=True):
            binding.bind_output(
                name, "cuda", self.device.index or 0, _numpy_dtype(tensor.dtype), tuple(tensor.shape), tensor.data_ptr()
            )
        torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(binding)
        return outputs


def _numpy_dtype(dtype: torch.dtype) -> Any:
    return torch.empty((), dtype=dtype).numpy().dtype


def _needs_external_data(module: torch.nn.Module) -> bool:
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    size += sum(b.numel() * b.element_size() for b in module.buffers())
    return size > 1_500_000_000  # protobuf's 2 GB limit, with room for the graph


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's progress lines and warnings (errors still raise)."""
    names = ("torch.onnx", "onnxscript", "onnx_ir", "torch.export", "torch._export")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(None):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
