"""What this machine computes natively: CPU model and ISA flags, GPU capability, and from them the precisions worth
trying here. Read once, never assumed: the project's machines differ (an Intel with AMX, an AMD EPYC with AVX512-BF16
and AVX512-VNNI, an AMD EPYC with AVX2 only), and a reduced precision the hardware emulates is slower than fp32 (a
bf16 linear on an AVX2-only host: 7x slower; int8 without VNNI: no faster than fp32, docs/precision.md).

The one place that reads CPU flags, below the core and the backends: the cache key (`core/keys.py`), the precision
candidates (`core/precision.py`), the int8 format of ONNX Runtime (`backends/onnxruntime.py`) and the benchmarks
(`aitune_hf.session.describe_machine`) use it. Also the memory the machine has available now (`available_memory`),
which caps ONNX Runtime's shared arena.
"""

from __future__ import annotations

import contextlib
import functools
import platform
from pathlib import Path

import torch

#: The CPU flags that change which kernels run, and so timings and decisions (part of the cache key).
KERNEL_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.partition(":")[2].strip()
            elif line.startswith("flags") and not flags:
                flags = frozenset(line.partition(":")[2].split())
    return model or platform.processor() or platform.machine(), flags


def available_memory() -> int | None:
    """Bytes of memory the machine can give now without swapping (Linux `MemAvailable`), or None where that is not
    known. Read on every call: it changes."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9B14"), else what `platform` knows."""
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    """Every flag /proc/cpuinfo lists (empty where there is none)."""
    return _cpuinfo()[1]


def kernel_flags() -> list[str]:
    """The flags of `KERNEL_FLAGS` this CPU has, in that order."""
    flags = cpu_flags()
    return [flag for flag in KERNEL_FLAGS if flag in flags]


def cpu_text() -> str:
    """The CPU as the cache key and the benchmarks name it: architecture, torch's CPU capability, kernel flags."""
    return f"cpu {platform.machine()} {torch.backends.cpu.get_cpu_capability()} {' '.join(kernel_flags())}".strip()


def describe() -> str:
    """A line for benchmark results and speed claims: the CPU model and its kernel flags."""
    return f"{cpu_model()} ({', '.join(kernel_flags()) or 'no AVX2'})"


def cpu_bf16_reason() -> str | None:
    """None when the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16), else why not."""
    flags = cpu_flags()
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return None
    return "this CPU has no native bf16 (neither AVX512-BF16 nor AMX-BF16): bf16 would be emulated, slower than fp32"


def cpu_int8_reason() -> str | None:
    """None when the CPU has int8 dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX-INT8), else why not."""
    flags = cpu_flags()
    if flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        return None
    return "this CPU has no int8 dot-product instructions (no VNNI, no AMX-INT8): int8 is no faster than fp32 there"


def cpu_fp16_reason() -> str | None:
    """None when the CPU has fp16 matrix instructions (AMX-FP16), else why not."""
    if "amx_fp16" in cpu_flags():
        return None
    return "this CPU has no fp16 matrix instructions (no AMX-FP16)"


def cuda_reason(device: torch.device, precision: str) -> str | None:
    """None when the CUDA device computes `precision` natively (fp16 everywhere, bf16 from compute capability 8.0),
    else why not; int8 is not offered on CUDA."""
    if precision == "fp16":
        return None
    if precision == "bf16":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return None if major >= 8 else f"bf16 needs compute capability 8.0 or newer (this GPU has {major}.{minor})"
    return f"{precision} is not offered on CUDA"
