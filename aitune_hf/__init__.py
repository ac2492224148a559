"""aitune_hf: per-block backend tuning for Hugging Face Diffusers and Transformers inference."""

import logging

from aitune_hf import backends
from aitune_hf.core import (
    FirstWins,
    MinLatency,
    OneBackend,
    Registration,
    TargetState,
    TuningConfig,
    TuningReport,
    register,
)

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "FirstWins",
    "MinLatency",
    "OneBackend",
    "Registration",
    "TargetState",
    "TuningConfig",
    "TuningReport",
    "__version__",
    "backends",
    "register",
]
