"""What machine a benchmark ran on: speed claims name the CPU model and the flags that change kernels (the project's
machines vary: an Intel with AMX, an AMD EPYC with AVX512-BF16 and VNNI, an AMD EPYC with AVX2 only)."""

from __future__ import annotations

from aitune_hf.session import describe_machine


def cpu_model() -> str:
    """The CPU's model name and its kernel flags, e.g. "AMD EPYC 9B14 (avx2, avx512f, avx512_bf16, avx512_vnni)"."""
    return describe_machine()
