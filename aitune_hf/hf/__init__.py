"""The Hugging Face layer: everything that knows Diffusers, Transformers and Accelerate."""

from aitune_hf.hf import decoder  # noqa: F401 (registers the openvino_decoder backend)
from aitune_hf.hf.hooks import install_slot_locators
from aitune_hf.hf.loading import AITuneModel, AITunePipeline, apply_mixin, enable_aitune, with_aitune
from aitune_hf.hf.mixin import AITuneMixin
from aitune_hf.hf.names import install_names
from aitune_hf.hf.targets import find_targets

install_slot_locators()
install_names()

__all__ = [
    "AITuneMixin",
    "AITuneModel",
    "AITunePipeline",
    "apply_mixin",
    "enable_aitune",
    "find_targets",
    "with_aitune",
]
