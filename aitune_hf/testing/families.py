"""Model families: one tiny model per architecture (17 of them, Diffusers and Transformers), for the integration
tests (tests/hf/test_families.py, tests/hf/test_precision.py) and benchmarks/families.py.

Each family is a single model (no pipeline): built from a tiny config with random weights under a fixed seed
(`aitune_hf.testing.family_models`), written with ``save_pretrained(folder)`` (`build_family`), loaded back with
the concrete class's real ``from_pretrained`` (`load_family`), and run by one whole call (`call_family`):
``model(**inputs)``, ``model.decode(**inputs)`` for the VAE alone, or ``model.generate(**inputs,
**FAMILY_GENERATE)`` for the generative Transformers models (those reuse `build_lm`). Inputs are seeded
(`family_inputs`).

Imports torch, diffusers and transformers only inside its functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from aitune_hf.testing.family_models import BATCH, COND, TEXT, family_model
from aitune_hf.testing.lm import LM_VOCAB, build_lm

#: generate() arguments of the generative families: a fixed number of greedy steps, logits of each step kept.
FAMILY_GENERATE: dict[str, Any] = {
    "max_new_tokens": 4,
    "min_new_tokens": 4,  # no early stop at eos: every call has the same number of steps
    "do_sample": False,
    "output_logits": True,
    "return_dict_in_generate": True,
}


class ModelFamily(NamedTuple):
    """How to build, load, feed and call one tiny model of a family.

    ``library`` is ``"diffusers"`` or ``"transformers"``; ``model_class`` the class (a name in that library)
    whose ``from_pretrained`` loads the folder; ``call`` is ``"forward"``, ``"decode"`` or ``"generate"``;
    ``outputs`` names the fields of a forward's output that `call_family` returns; ``blocks`` describes, in
    words, which modules are the family's repeated blocks.
    """

    name: str
    library: str
    model_class: str
    call: str
    blocks: str
    outputs: tuple[str, ...] = ("sample",)


MODEL_FAMILIES: dict[str, ModelFamily] = {
    f.name: f
    for f in (
        ModelFamily(
            "unet", "diffusers", "UNet2DConditionModel", "forward", "UNet stages: down_blocks.i, mid_block, up_blocks.i"
        ),
        ModelFamily(
            "controlnet",
            "diffusers",
            "ControlNetModel",
            "forward",
            "ControlNet stages: down_blocks.i, mid_block",
            outputs=("down_block_res_samples", "mid_block_res_sample"),
        ),
        ModelFamily(
            "flux",
            "diffusers",
            "FluxTransformer2DModel",
            "forward",
            "_repeated_blocks: transformer_blocks.i, single_transformer_blocks.i",
        ),
        ModelFamily("sd3", "diffusers", "SD3Transformer2DModel", "forward", "_no_split_modules: transformer_blocks.i"),
        ModelFamily(
            "pixart", "diffusers", "PixArtTransformer2DModel", "forward", "_no_split_modules: transformer_blocks.i"
        ),
        ModelFamily("hunyuandit", "diffusers", "HunyuanDiT2DModel", "forward", "structural fallback: blocks.i"),
        ModelFamily(
            "cogvideox",
            "diffusers",
            "CogVideoXTransformer3DModel",
            "forward",
            "_no_split_modules: transformer_blocks.i",
        ),
        ModelFamily("wan", "diffusers", "WanTransformer3DModel", "forward", "_repeated_blocks: blocks.i"),
        ModelFamily(
            "vae", "diffusers", "AutoencoderKL", "decode", "VAE decoder stages: decoder.mid_block, decoder.up_blocks.i"
        ),
        ModelFamily(
            "bert",
            "transformers",
            "BertModel",
            "forward",
            "_no_split_modules: encoder.layer.i",
            outputs=("last_hidden_state", "pooler_output"),
        ),
        ModelFamily(
            "vit",
            "transformers",
            "ViTModel",
            "forward",
            "_no_split_modules: layers.i",
            outputs=("last_hidden_state", "pooler_output"),
        ),
        ModelFamily(
            "clip_text",
            "transformers",
            "CLIPTextModel",
            "forward",
            "_no_split_modules: encoder.layers.i",
            outputs=("last_hidden_state", "pooler_output"),
        ),
        ModelFamily("llama", "transformers", "LlamaForCausalLM", "generate", "_no_split_modules: model.layers.i"),
        ModelFamily("qwen3", "transformers", "Qwen3ForCausalLM", "generate", "_no_split_modules: model.layers.i"),
        ModelFamily("gpt2", "transformers", "GPT2LMHeadModel", "generate", "_no_split_modules: transformer.h.i"),
        ModelFamily(
            "t5",
            "transformers",
            "T5ForConditionalGeneration",
            "generate",
            "_no_split_modules: encoder.block.i, decoder.block.i",
        ),
        ModelFamily(
            "whisper",
            "transformers",
            "WhisperForConditionalGeneration",
            "generate",
            "_no_split_modules: model.encoder.layers.i, model.decoder.layers.i",
        ),
    )
}


def _check_model_family(name: str) -> ModelFamily:
    if name not in MODEL_FAMILIES:
        from aitune_hf.errors import UserInputError  # aitune_hf (and torch) load only when an error is raised

        raise UserInputError(f"unknown model family {name!r}; valid: {', '.join(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[name]


def build_family(name: str, folder: str | Path, seed: int = 0) -> Path:
    """Build the tiny random model of family ``name`` (a key of `MODEL_FAMILIES`) into ``folder``; returns it.

    Load it back with `load_family` (the concrete class's real ``from_pretrained``).
    """
    family = _check_model_family(name)
    if family.call == "generate":
        return build_lm(name, folder, seed=seed)
    import torch

    torch.manual_seed(seed)
    model = family_model(name).eval()
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return path


def load_family(name: str, folder: str | Path) -> Any:
    """The model in ``folder`` (written by `build_family`), loaded with its class's ``from_pretrained``, in eval
    mode."""
    import importlib

    family = _check_model_family(name)
    model_class = getattr(importlib.import_module(family.library), family.model_class)
    return model_class.from_pretrained(str(folder)).eval()


def family_inputs(name: str, seed: int = 1) -> dict[str, Any]:
    """Fresh seeded keyword arguments for one whole call of family ``name`` (batch 2, small sizes)."""
    _check_model_family(name)
    import torch

    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def ids(length: int) -> torch.Tensor:
        return torch.randint(3, LM_VOCAB, (BATCH, length), generator=g)

    b = BATCH
    timestep = torch.tensor([500.0, 20.0])
    if name == "unet":
        return {"sample": randn(b, 4, 8, 8), "timestep": timestep, "encoder_hidden_states": randn(b, TEXT, COND)}
    if name == "controlnet":
        return {
            "sample": randn(b, 4, 8, 8),
            "timestep": timestep,
            "encoder_hidden_states": randn(b, TEXT, COND),
            "controlnet_cond": randn(b, 3, 16, 16),
        }
    if name == "flux":
        side = 4  # 4x4 packed tokens
        img_ids = torch.zeros(side, side, 3)
        img_ids[..., 1] = torch.arange(side)[:, None]
        img_ids[..., 2] = torch.arange(side)[None, :]
        return {
            "hidden_states": randn(b, side * side, 16),
            "encoder_hidden_states": randn(b, TEXT, COND),
            "pooled_projections": randn(b, COND),
            "timestep": torch.tensor([0.5, 0.02]),
            "img_ids": img_ids.reshape(-1, 3),
            "txt_ids": torch.zeros(TEXT, 3),
        }
    if name == "sd3":
        return {
            "hidden_states": randn(b, 4, 8, 8),
            "encoder_hidden_states": randn(b, TEXT, COND),
            "pooled_projections": randn(b, COND),
            "timestep": timestep,
        }
    if name == "pixart":
        return {
            "hidden_states": randn(b, 4, 8, 8),
            "encoder_hidden_states": randn(b, TEXT, COND),
            "timestep": timestep,
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        }
    if name == "hunyuandit":
        from diffusers.models.embeddings import get_2d_rotary_pos_embed

        mask = torch.ones(b, TEXT, dtype=torch.long)
        mask[1, TEXT // 2 :] = 0  # a padded prompt
        return {
            "hidden_states": randn(b, 4, 8, 8),
            "timestep": timestep,
            "encoder_hidden_states": randn(b, TEXT, COND),
            "text_embedding_mask": mask,
            "encoder_hidden_states_t5": randn(b, TEXT, COND),
            "text_embedding_mask_t5": mask.clone(),
            # as HunyuanDiTPipeline makes it: head_dim 8, a 4x4 grid of patches
            "image_rotary_emb": get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4)),
        }
    if name == "cogvideox":
        return {
            "hidden_states": randn(b, 2, 4, 8, 8),  # (batch, latent frames, channels, height, width)
            "encoder_hidden_states": randn(b, TEXT, COND),
            "timestep": torch.tensor([500, 20]),
        }
    if name == "wan":
        return {
            "hidden_states": randn(b, 4, 2, 8, 8),  # (batch, channels, latent frames, height, width)
            "timestep": timestep,
            "encoder_hidden_states": randn(b, TEXT, COND),
        }
    if name == "vae":
        return {"z": randn(b, 4, 8, 8)}
    if name == "bert":
        mask = torch.ones(b, TEXT, dtype=torch.long)
        mask[1, -3:] = 0
        return {"input_ids": ids(TEXT), "attention_mask": mask}
    if name == "vit":
        return {"pixel_values": randn(b, 3, 16, 16)}
    if name == "clip_text":
        return {"input_ids": ids(TEXT)}
    if name == "whisper":
        return {"input_features": randn(b, 8, 32)}  # (batch, mel bins, frames)
    return {"input_ids": ids(5)}  # the decoder-only LMs and T5


def call_family(name: str, model: Any, inputs: dict[str, Any]) -> Any:
    """One whole call of family ``name`` under ``torch.inference_mode()``: its output as plain tensors.

    forward: a tuple of the family's ``outputs`` fields (nested tuples as the model returns them);
    decode: ``(sample,)``; generate: ``(sequences, logits)`` with ``logits`` a tuple of one tensor per step.
    """
    family = _check_model_family(name)
    import torch

    with torch.inference_mode():
        if family.call == "generate":
            out = model.generate(**inputs, **FAMILY_GENERATE)
            return out.sequences, tuple(out.logits)
        out = model.decode(**inputs) if family.call == "decode" else model(**inputs)
        return tuple(out[field] for field in family.outputs)
