"""The explicit-registration tuning core. Knows torch, not Hugging Face."""

from aitune_hf.core.config import DEFAULT_TOLERANCES, TuningConfig
from aitune_hf.core.registration import Registration, get_target, register
from aitune_hf.core.report import CandidateResult, ModuleReport, SignatureReport, TuningReport
from aitune_hf.core.signature import InputSignature, Sample, signature_of
from aitune_hf.core.strategy import FirstWins, MinLatency, OneBackend, Strategy
from aitune_hf.core.target import Target, TargetState
from aitune_hf.errors import TuningError

__all__ = [
    "DEFAULT_TOLERANCES",
    "CandidateResult",
    "FirstWins",
    "InputSignature",
    "MinLatency",
    "ModuleReport",
    "OneBackend",
    "Registration",
    "Sample",
    "SignatureReport",
    "Strategy",
    "Target",
    "TargetState",
    "TuningConfig",
    "TuningError",
    "TuningReport",
    "get_target",
    "register",
    "signature_of",
]
