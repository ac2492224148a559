"""OpenVINO's engine alone, through each door, against `ov.convert_model`: the compiled model and nothing else (no
router, no guard), per workload, at batch 1 and batch 32, f32 and (where the CPU computes it natively) bf16.

    python benchmarks/openvino_doors.py                   # writes benchmarks/results/openvino_doors.md
    python benchmarks/openvino_doors.py --quick --out /tmp/doors.md

Doors (issue 45): `onnx` (aitune_hf's ONNX export read by OpenVINO), `torch.export` (the same call's `torch.export`
program through OpenVINO's PyTorch frontend), `trace` (the call's TorchScript trace through that frontend, as
`convert_model` takes a module), each built by `OpenVinoBackend(door=...)` with every input dimension
free (a shape family, `specialize=False`); the peer, `convert_model`, is what sentence-transformers' and
optimum-intel's OpenVINO backends do: `openvino.convert_model(model, example_input=...)` (a TorchScript trace), every
input dimension made dynamic. Each is compiled with the same properties (one thread, one stream, latency, the precision
named). Per workload and shape: median milliseconds per call over interleaved rounds (the order rotating), and the ratio
of the peer's time to ours (above 1: ours is faster); per door, the runtime graph's layer counts (MatMul and Softmax
left: attention not fused). 1 torch and 1 OpenVINO thread.

Where in the process an engine was compiled changes its speed, so every engine is compiled twice, in opposite orders,
after one compile that is thrown away, and its figure is the median of both copies' rounds together. Measured (AMD
EPYC, AVX512-BF16; whole MiniLM bf16, batch 1, one core): the same model compiled six times in one process, the first
ran at 3.49 ms and the others at 3.08-3.14 ms, each later one a little faster (3.23 against 3.08-3.14 with glibc's
malloc on huge pages, `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`). Before this, each engine was compiled once, the doors
in `DOORS`' order and `convert_model` last: the batch 1 rows of that form (results/openvino_doors_icelake.md, and
results/openvino_doors.md before it) favour the engines compiled later.

Workloads: all-MiniLM-L6-v2 whole (real weights) as sentence-transformers calls it, a padded batch of 32 and a single
sentence; the small SD pipeline's UNet at one step's call (latents 2 x 4 x 16 x 16, classifier-free guidance), which
runs at one shape (a batch of 1 is not its call).
"""

from __future__ import annotations

import argparse
import collections
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from machine import cpu_model  # benchmarks/ is on sys.path: the scripts run as files

from aitune_hf import Stopwatch, hardware, testing
from aitune_hf.backends import OpenVinoBackend

RESULTS = Path(__file__).resolve().parent / "results"
DOORS = OpenVinoBackend.doors
UNFUSED = ("MatMul", "Softmax")


def _layers(compiled: Any) -> collections.Counter[str]:
    ops = compiled.get_runtime_model().get_ops()
    return collections.Counter(op.get_rt_info()["layerType"].astype(str) for op in ops)


def _config(hint: str) -> dict[str, Any]:
    return {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False}  # fmt: skip


def _minilm() -> tuple[torch.nn.Module, dict[str, dict[str, torch.Tensor]]]:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(testing.minilm_path(), local_files_only=True)
    model = AutoModel.from_pretrained(str(testing.minilm_path()), local_files_only=True).eval()
    words = ["river", "stone", "quiet", "market", "near", "the", "old", "bridge"]
    batch = [" ".join(words[: 3 + i % 6] * (1 + i % 4)) for i in range(32)]
    calls = {
        "batch 32": dict(tokenizer(batch, padding=True, return_tensors="pt")),
        "batch 1": dict(tokenizer(["a short query about a river stone"], return_tensors="pt")),
    }
    return model, calls


def _unet(folder: Path) -> tuple[torch.nn.Module, dict[str, dict[str, torch.Tensor]]]:
    from diffusers import UNet2DConditionModel

    path = testing.build_pipeline("sd", folder / "sd", size="small")
    unet = UNet2DConditionModel.from_pretrained(path / "unet", local_files_only=True).eval()
    generator = torch.Generator().manual_seed(0)
    side = unet.config.sample_size
    call = {
        "sample": torch.randn(2, unet.config.in_channels, side, side, generator=generator),
        "timestep": torch.tensor(500),
        "encoder_hidden_states": torch.randn(2, 77, unet.config.cross_attention_dim, generator=generator),
    }
    return unet, {f"batch 2 x {side} x {side}": call}


class _Flat(torch.nn.Module):
    """The module called with keyword tensors, returning its first output tensor: what `convert_model` traces."""

    def __init__(self, module: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.module, self.names = module, names

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        out = self.module(**dict(zip(self.names, tensors, strict=True)), return_dict=False)
        return out[0]


def _peer(
    module: torch.nn.Module, calls: dict[str, dict[str, torch.Tensor]], precision: str
) -> tuple[Any, Callable[[dict], Any]]:
    """`openvino.convert_model` of the module whole, traced from the first of `calls`, every input dimension dynamic (a
    scalar stays one), compiled in `precision`."""
    import openvino

    example, hint = next(iter(calls.values())), {"fp32": "f32", "bf16": "bf16"}[precision]
    names = list(example)
    flat = _Flat(module, names).eval()
    with torch.no_grad():
        converted = openvino.convert_model(flat, example_input=tuple(example[n] for n in names))
    converted.reshape({port: openvino.PartialShape([-1] * port.get_partial_shape().rank.get_length())
                       for port in converted.inputs})  # fmt: skip
    compiled = openvino.Core().compile_model(converted, "CPU", _config(hint))
    request = compiled.create_infer_request()
    return compiled, lambda call: request.infer([call[n].numpy() for n in names])


def _ours(module: torch.nn.Module, calls: dict[str, dict[str, torch.Tensor]], precision: str, door: str):
    """`OpenVinoBackend(door=...)` built for the calls as one shape family; its compiled model and a call of it."""
    backend = OpenVinoBackend(precision=precision, num_threads=1, door=door, specialize=False)
    samples = [((), {**call, "return_dict": False}) for call in calls.values()]
    with torch.no_grad():
        built = backend.build(module, module.forward, samples, dynamic=True)
    return built.fn.compiled, lambda call: built.fn(**call, return_dict=False)


def _median_ms(fns: dict[tuple[str, int], Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Per label, the median milliseconds over the interleaved rounds of all its copies (`(label, copy)` keys)."""
    times: dict[tuple[str, int], list[float]] = {key: [] for key in fns}
    keys = list(fns)
    for fn in fns.values():  # warm-up
        fn()
    for r in range(rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            with Stopwatch() as watch:
                fns[key]()
            times[key].append(watch.seconds)
    pooled: dict[str, list[float]] = {}
    for (label, _), values in times.items():
        pooled.setdefault(label, []).extend(values)
    return {label: statistics.median(values) * 1e3 for label, values in pooled.items()}


def _engines(
    name: str, module: torch.nn.Module, calls: dict[str, dict], precision: str, order: list[str], lines: list[str]
) -> dict[str, tuple[Any, Callable[[dict], Any]]]:
    """Each engine in `order` (a door in `DOORS`, or "convert_model"), compiled in that order; a door that fails is a
    row of `lines` (once)."""
    engines: dict[str, tuple[Any, Callable[[dict], Any]]] = {}
    for label in order:
        if label == "convert_model":
            engines[label] = _peer(module, calls, precision)
            continue
        try:
            engines[label] = _ours(module, calls, precision, label)
        except Exception as error:  # a door that fails is a finding
            failed = f"| {name} | {precision} | {label} | failed: {type(error).__name__}: {error!s:.80} |"
            if failed not in lines:
                lines.append(failed)
    return engines


def run(name: str, module: torch.nn.Module, calls: dict[str, dict], rounds: int, lines: list[str]) -> None:
    precisions = ["fp32"] + (["bf16"] if hardware.cpu_bf16_reason() is None else [])
    for precision in precisions:
        order = [*DOORS, "convert_model"]
        _peer(module, calls, precision)  # the process's first compile, thrown away (module docstring)
        copies = [_engines(name, module, calls, precision, order, lines)]
        copies.append(_engines(name, module, calls, precision, order[::-1], lines))
        engines = copies[0]
        counts = {label: _layers(compiled) for label, (compiled, _) in engines.items()}
        for shape, call in calls.items():
            with torch.no_grad():
                fns = {(label, copy): (lambda run=run_, call=call: run(call))
                       for copy, built in enumerate(copies) for label, (_, run_) in built.items()}  # fmt: skip
                fns["eager", 0] = lambda call=call: module(**call)
                ms = _median_ms(fns, rounds if "32" not in shape else max(rounds // 4, 3))
            for label in engines:
                ratio = ms["convert_model"] / ms[label]
                unfused = sum(counts[label][k] for k in UNFUSED)
                lines.append(
                    f"| {name} | {precision} | {label} | {shape} | {ms[label]:.2f} | {ms['eager'] / ms[label]:.2f}x | "
                    f"{ratio:.2f} | {unfused} ({counts[label]['MatMul']} MatMul, {counts[label]['Softmax']} "
                    f"Softmax, {counts[label]['Transpose']} Transpose; {sum(counts[label].values())} layers) |"
                )
        print("\n".join(lines[-len(engines) * len(calls) :]), file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--out", type=Path, default=RESULTS / "openvino_doors.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 40 if args.quick else 200
    lines = [
        "# OpenVINO's engine alone: aitune_hf's doors against `ov.convert_model`",
        "",
        f"`python benchmarks/{Path(__file__).name}{' --quick' if args.quick else ''}` on {cpu_model()} "
        f"({platform.machine()}), 1 thread, torch {torch.__version__}, openvino "
        f"{__import__('openvino').__version__}; medians of interleaved rounds ({rounds} for single sentences, "
        f"{max(rounds // 4, 3)} for batches, each round calling each engine's two copies, compiled in opposite "
        "orders after one thrown away). `vs convert_model`: the peer's time over this one's (above 1: faster than the "
        "peer). Unfused attention layers: MatMul and Softmax left in the runtime graph.",
        "",
        "| workload | precision | door | call | ms | vs eager | vs convert_model | unfused attention layers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    model, calls = _minilm()
    run("all-MiniLM-L6-v2 whole", model, calls, rounds, lines)
    with tempfile.TemporaryDirectory(prefix="aitune_doors_") as folder:
        unet, calls = _unet(Path(folder))
        run("SD small UNet", unet, calls, max(rounds // 4, 10), lines)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
