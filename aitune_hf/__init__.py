"""aitune_hf: per-block backend tuning for Hugging Face Diffusers and Transformers inference."""

import logging

from aitune_hf import (
    backends,
    plotting,  # noqa: F401  (registers TuningReport.plot's drawing; matplotlib loads lazily)
)
from aitune_hf.core import (
    FirstWins,
    MinLatency,
    OneBackend,
    Registration,
    TargetState,
    TuningConfig,
    TuningReport,
    get_target,
    register,
)
from aitune_hf.core.timing import Stopwatch, clock, time_interleaved  # the one timer (benchmarks use it too)
from aitune_hf.hf import AITuneModel, AITunePipeline, enable_aitune, find_targets

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "AITuneModel",
    "AITunePipeline",
    "FirstWins",
    "MinLatency",
    "OneBackend",
    "Registration",
    "Stopwatch",
    "TargetState",
    "TuningConfig",
    "TuningReport",
    "__version__",
    "backends",
    "clock",
    "enable_aitune",
    "find_targets",
    "get_target",
    "register",
    "time_interleaved",
]
