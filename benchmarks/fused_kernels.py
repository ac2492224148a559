"""ONNX Runtime with and without fused kernels (issue 19), per block kind: plain `OnnxRuntimeBackend()` against
`OnnxRuntimeBackend(kernels="fused")` (onnxscript's ONNX Runtime fusions: MultiHeadAttention, SkipLayerNormalization,
BiasGelu), OpenVINO reading the same export (`OpenVinoBackend()`, f32; and bf16 where the CPU computes it natively,
with its error beside it), and eager, on the same block and call.

    python benchmarks/fused_kernels.py                  # every workload, 1 thread, 31 interleaved rounds
    python benchmarks/fused_kernels.py --workloads minilm_b1_s32 --rounds 51
    python benchmarks/fused_kernels.py --memory --workloads sd_small_attention_32,sd_small_attention_64
    python benchmarks/fused_kernels.py --int8 --workloads minilm_b1_s32,minilm_b32_s64

Workloads: one real MiniLM layer (`aitune_hf.testing.minilm_path()`) at batch 1 x 32 tokens, batch 32 x 64 and
batch 1 x 512, and the first cross-attention block (`Transformer2DModel`) of the SD small UNet
(`build_pipeline("sd", ..., "small")`) at the shapes a call with guidance gives it: 2 x 96 x 16 x 16 latents
(`sd_small_attention`, 256 tokens), 32 x 32 (`_32`, 1024 tokens) and 64 x 64 (`_64`, 4096 tokens), with
2 x 77 x 64 text states. ONNX Runtime's CPU `MultiHeadAttention` runs a tiled (flash) kernel when the attention has
no mask (SD's); set `ORT_DISABLE_FLASH_ATTENTION=1` to time it without.

torch and ONNX Runtime at 1 thread (`torch.set_num_threads(1)`, `intra_op_num_threads=1`, no spinning), one
exact-shape session each, eager and both sessions timed in interleaved rounds (`time_interleaved`), medians.
Prints the machine, the load average before and after, each build's largest error against eager and the fused
operators the rewrite made; and what each costs in a tuning (`register()` with `precision="auto"`, ONNX Runtime
only, exact shapes): the plain candidate's build seconds (export and session) and the fused one's (the rewrite of
that export and a session), from the report.

`--memory`: instead of speed, the working memory of each build, each in a fresh process (this file,
`--memory-of`), so that no allocator, arena or cache kept from another build hides what a call needs: the resident
set size (VmRSS, sampled every 0.5 ms) while the build serves three calls, less the process's size before the build
(the block and its inputs made); and what the build itself left held. Beside it, what one attention score matrix of
the call takes (batch x heads x tokens x tokens, fp32): what an attention that is not computed in tiles holds.

`--int8` (MiniLM layer workloads): OpenVINO running a statically quantized export in int8, the way first tried to
give OpenVINO an int8 candidate: ONNX Runtime's static quantization to QDQ (int8 weights per channel, uint8
activations, calibrated on 8 other calls), which OpenVINO reads and runs in int8. It was 29% off on a real MiniLM
layer, and is not what the backend does: `openvino(precision=int8)` stores the linear layers' weights as int8 and lets
OpenVINO quantize their activations at run time (docs/precision.md). Timed beside eager, ONNX Runtime's own int8
candidate (`OnnxRuntimeBackend(precision="int8")`: dynamic quantization) and OpenVINO f32, on real MiniLM embeddings
of varied sentences (not random hidden states: int8's error depends on the activations' outliers); error as the cosine
of the flattened output with eager's and the relative L2 error (the per-block budget of int8 is 10%: docs/precision.md).
`ov_int8_mixed` leaves the feed-forward's output projection in f32 (its input, after GELU, has the outliers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from machine import cpu_model  # benchmarks/ is on sys.path: the scripts run as files

from aitune_hf import hardware, register, time_interleaved
from aitune_hf.backends import OnnxRuntimeBackend, OpenVinoBackend, forget_exports
from aitune_hf.testing import build_pipeline, minilm_path

WORKLOADS = (
    "minilm_b1_s32",
    "minilm_b32_s64",
    "minilm_b1_s512",
    "sd_small_attention",
    "sd_small_attention_32",
    "sd_small_attention_64",
)


class MiniLMLayer(torch.nn.Module):
    """One encoder layer called as the encoder calls it: hidden states and the additive attention mask."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden, attention_mask=mask)[0]


class CrossAttention(torch.nn.Module):
    """A UNet's Transformer2DModel called as the UNet calls it (latents and text states)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, sample: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.block(sample, encoder_hidden_states=context, return_dict=False)[0]


def workload(name: str, folder: Path) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    if name.startswith("minilm"):
        from transformers import AutoModel

        model = AutoModel.from_pretrained(minilm_path(), attn_implementation="sdpa").eval()
        batch, length = {"minilm_b1_s32": (1, 32), "minilm_b32_s64": (32, 64), "minilm_b1_s512": (1, 512)}[name]
        return MiniLMLayer(model.encoder.layer[0]).eval(), (
            torch.randn(batch, length, model.config.hidden_size),
            torch.zeros(batch, 1, 1, length),
        )
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(build_pipeline("sd", folder / "sd-small", "small"))
    unet = pipe.unet
    channels = unet.config.block_out_channels[0]
    side = {"sd_small_attention": 16, "sd_small_attention_32": 32, "sd_small_attention_64": 64}[name]
    return CrossAttention(unet.down_blocks[0].attentions[0]).eval(), (
        torch.randn(2, channels, side, side),
        torch.randn(2, 77, unet.config.cross_attention_dim),
    )


def measure(name: str, folder: Path, rounds: int) -> dict[str, Any]:
    module, call = workload(name, folder)
    fns: dict[str, Callable[..., Any]] = {"eager": module}
    notes = {}
    with torch.no_grad():
        reference = module(*call)
        candidates = _candidates()
        if hardware.cpu_bf16_reason() is None:
            candidates["ov_bf16"] = OpenVinoBackend(precision="bf16", num_threads=1)
        for label, backend in candidates.items():
            built = backend.build(module, module.forward, [(call, {})])
            out = built.fn(*call)
            error = (out - reference).abs().max().item()
            relative = ((out - reference).norm() / reference.norm()).item()
            fused = getattr(built.fn, "kernels", None)
            notes[label] = f"max abs error {error:.1e} (rel. L2 {relative:.1e})" + (f", fused {fused}" if fused else "")
            fns[label] = built.fn
        latencies, failures = time_interleaved(fns, [(call, {})], warmup=3, repeats=rounds, baseline="eager")
    assert not failures, failures
    return {"latencies": latencies, "notes": notes, "build_s": tuning_builds(module, call)}


def _candidates() -> dict[str, Any]:
    return {
        "ort": OnnxRuntimeBackend(intra_op_num_threads=1),
        "ort_fused": OnnxRuntimeBackend(intra_op_num_threads=1, kernels="fused"),
        "ov": OpenVinoBackend(num_threads=1),
    }


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def memory_of(name: str, label: str, folder: Path) -> dict[str, float]:
    """In this (fresh) process: build `label` for workload `name`, serve three calls, and return the MB the build
    left held and the peak MB during the calls, both above the process's size before the build."""
    module, call = workload(name, folder)
    peak, stop = [0.0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.0005)

    with torch.no_grad():
        before = _rss_mb()
        fn = module if label == "eager" else _candidates()[label].build(module, module.forward, [(call, {})]).fn
        built = _rss_mb()
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            for _ in range(3):
                fn(*call)
        finally:
            stop.set()
            sampler.join()
    return {"held_mb": built - before, "peak_mb": max(peak[0], built) - before}


def score_matrix_mb(name: str, folder: Path) -> tuple[int, float]:
    """(tokens, MB of one fp32 score matrix: batch x heads x tokens x tokens) of an SD attention workload."""
    module, (sample, _) = workload(name, folder)
    tokens = sample.shape[2] * sample.shape[3]
    heads = module.block.transformer_blocks[0].attn1.heads
    return tokens, sample.shape[0] * heads * tokens * tokens * 4 / 2**20


def memory_table(names: list[str], folder: Path) -> None:
    labels = ("eager", "ort", "ort_fused", "ov")
    print("| workload | score matrix MB | " + " | ".join(f"{label}: peak (held) MB" for label in labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for name in names:
        cells = []
        for label in labels:
            command = [sys.executable, __file__, "--memory-of", label, "--workloads", name, "--folder", str(folder)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                cells.append(f"failed: {done.stderr.strip().splitlines()[-1][:80]}")
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            cells.append(f"{result['peak_mb']:.0f} ({result['held_mb']:.0f})")
        matrix = f"{score_matrix_mb(name, folder)[1]:.0f}" if name.startswith("sd") else "-"
        print(f"| {name} | {matrix} | " + " | ".join(cells) + " |", flush=True)


def _real_hidden(model: Any, tokenizer: Any, batch: int, length: int, seed: int) -> torch.Tensor:
    """MiniLM's embeddings of `batch` varied sentences cut to `length` tokens (long enough: no padding)."""
    from minilm_traffic import corpus  # benchmarks/ is on sys.path

    texts = corpus(batch, 3 * length, 3 * length + 20, seed)
    ids = tokenizer(texts, truncation=True, max_length=length, return_tensors="pt")["input_ids"]
    return model.embeddings(input_ids=ids)


class _OpenVinoCall:
    """A compiled (quantized) MiniLM layer called with torch tensors, one infer request."""

    def __init__(self, compiled: Any) -> None:
        self.request = compiled.create_infer_request()
        self.names = [port.get_any_name() for port in compiled.inputs]

    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        feeds = {"hidden": hidden.numpy(), "mask": mask.numpy()}
        return torch.from_numpy(self.request.infer({n: feeds[n] for n in self.names})[0].copy())


def int8_row(name: str, rounds: int) -> dict[str, Any]:
    import onnxruntime.quantization as quantization
    import openvino
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_path(), attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    batch, length = {"minilm_b1_s32": (1, 32), "minilm_b32_s64": (32, 64), "minilm_b1_s512": (1, 512)}[name]
    module = MiniLMLayer(model.encoder.layer[0]).eval()
    mask = torch.zeros(batch, 1, 1, length)
    with torch.no_grad():
        call = (_real_hidden(model, tokenizer, batch, length, seed=0), mask)
        calibration = [(_real_hidden(model, tokenizer, batch, length, seed=1 + i), mask) for i in range(8)]
        reference = module(*call)
        fns: dict[str, Callable[..., Any]] = {"eager": module}
        for label, backend in (("ort_int8", OnnxRuntimeBackend(intra_op_num_threads=1, precision="int8")),
                               ("ov", OpenVinoBackend(num_threads=1))):  # fmt: skip
            fns[label] = backend.build(module, module.forward, [(call, {})]).fn
        with tempfile.TemporaryDirectory(prefix="aitune_hf_ov_int8_") as tmp:
            fp32, int8 = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
            torch.onnx.export(module, call, fp32, dynamo=True, input_names=["hidden", "mask"], verbose=False)

            class Calls(quantization.CalibrationDataReader):  # a fresh reader per quantization
                def __init__(self) -> None:
                    self.feeds = iter([{"hidden": h.numpy(), "mask": m.numpy()} for h, m in calibration])

                def get_next(self) -> dict[str, Any] | None:
                    return next(self.feeds, None)

            import onnx

            matmuls = [n.name for n in onnx.load(fp32).graph.node if n.op_type in ("MatMul", "Gemm")]
            # The last one is the feed-forward's output projection, whose input (after GELU) has the outliers that
            # one activation scale per tensor cannot hold: "ov_int8_mixed" leaves it in f32.
            for label, excluded in (("ov_int8", []), ("ov_int8_mixed", matmuls[-1:])):
                quantization.quantize_static(
                    fp32, int8, Calls(), quant_format=quantization.QuantFormat.QDQ, per_channel=True,
                    activation_type=quantization.QuantType.QUInt8, weight_type=quantization.QuantType.QInt8,
                    op_types_to_quantize=["MatMul", "Gemm"], nodes_to_exclude=excluded,
                )  # fmt: skip
                core = openvino.Core()
                compiled = core.compile_model(core.read_model(int8), "CPU", OpenVinoBackend(num_threads=1).config())
                fns[label] = _OpenVinoCall(compiled)
        errors = {}
        for label, fn in fns.items():
            out = fn(*call).flatten().double()
            expected = reference.flatten().double()
            cosine = torch.nn.functional.cosine_similarity(out, expected, dim=0).item()
            errors[label] = f"cos {cosine:.4f}, rel. L2 {((out - expected).norm() / expected.norm()).item():.1e}"
        latencies, failures = time_interleaved(fns, [(call, {})], warmup=3, repeats=rounds, baseline="eager")
    assert not failures, failures
    return {"latencies": latencies, "errors": errors}


def tuning_builds(module: torch.nn.Module, call: tuple[torch.Tensor, ...]) -> dict[str, float | None]:
    """Build seconds per candidate of one tuning with `precision="auto"` (ONNX Runtime only, exact shapes)."""
    # cache "off": cold builds, and nothing written to the user's cache folder (where a rerun found its last decision)
    config = {"backends": ["onnxruntime"], "precision": "auto", "shapes": "exact", "min_speedup": 0, "progress": False,
              "warmup": 1, "repeats": 3, "cache": "off"}  # fmt: skip
    forget_exports()  # cold builds: no export left for reuse by the builds timed above (docs/backends.md)
    registration = register({"block": module}, config)
    try:
        with torch.no_grad():
            module(*call)
            registration.tune()
            module(*call)
        (signature,) = registration.targets["block"].report().signatures
        return {c.backend: c.build_seconds for c in signature.candidates}
    finally:
        registration.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--memory", action="store_true", help="working memory per build, not speed")
    parser.add_argument("--int8", action="store_true", help="OpenVINO int8 (statically quantized) beside the others")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # the fresh process's job: one build's memory
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)  # where the parent built the pipeline
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.memory_of:
        print(json.dumps(memory_of(args.workloads, args.memory_of, args.folder)))
        return
    if args.int8:
        print(f"machine: {cpu_model()}; load average before: {os.getloadavg()}")
        labels = ("eager", "ort_int8", "ov", "ov_int8", "ov_int8_mixed")
        print("| workload | " + " | ".join(f"{label} ms (x eager)" for label in labels) + " | error vs eager |")
        print("|---|" + "---|" * (len(labels) + 1))
        for name in args.workloads.split(","):
            row = int8_row(name, args.rounds)
            ms = {k: v * 1e3 for k, v in row["latencies"].items()}
            cells = " | ".join(f"{ms[label]:.3f} ({ms['eager'] / ms[label]:.2f}x)" for label in labels)
            errors = "; ".join(f"{label}: {row['errors'][label]}" for label in labels[1:])
            print(f"| {name} | {cells} | {errors} |", flush=True)
        print(f"load average after: {os.getloadavg()}")
        return
    if args.memory:
        print(f"machine: {cpu_model()}; load average before: {os.getloadavg()}")
        with tempfile.TemporaryDirectory(prefix="aitune_hf_fused_") as folder:
            memory_table(args.workloads.split(","), Path(folder))
        return
    print(f"machine: {cpu_model()}; load average before: {os.getloadavg()}")
    print(
        "| workload | eager ms | ORT ms | ORT fused ms | fused vs ORT | OpenVINO f32 ms | OpenVINO bf16 ms | "
        "build s in a tuning: ORT / fused | notes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="aitune_hf_fused_") as folder:
        for name in args.workloads.split(","):
            result = measure(name, Path(folder), args.rounds)
            ms = {k: v * 1e3 for k, v in result["latencies"].items()}
            notes = "; ".join(f"{k}: {v}" for k, v in result["notes"].items())
            builds = result["build_s"]
            plain, fused = builds.get("onnxruntime"), builds.get("onnxruntime(kernels=fused)")
            cost = f"{plain or 0:.1f} / {fused or 0:.1f}"
            bf16 = f"{ms['ov_bf16']:.3f}" if "ov_bf16" in ms else "- (no native bf16)"
            print(f"| {name} | {ms['eager']:.3f} | {ms['ort']:.3f} | {ms['ort_fused']:.3f} | "
                  f"{ms['ort'] / ms['ort_fused']:.2f}x | {ms['ov']:.3f} | {bf16} | {cost} | {notes} |",
                  flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
