"""Tiny Diffusers pipelines (Stable Diffusion, Flux, PixArt) for docs, notebooks, benchmarks, the CLI demo and
tests.

Every builder creates its models from configs with random weights under a fixed seed, puts every module in eval
mode, writes the pipeline with ``save_pretrained(folder)`` and returns the folder. Callers load it back with the
real ``DiffusionPipeline.from_pretrained(folder)``. Nothing is downloaded (the tokenizers are built by hand:
`aitune_hf.testing.parts`).

Two sizes exist: ``"tiny"`` (a 2-step call takes 5-20 ms on CPU, a few hundred kB on disk) and ``"small"``
(per-block compute dominates Python overhead; a 4-step call takes about 0.35-0.6 s on 2 CPU cores; 45-150 MB
on disk, Flux being the largest).
``DEFAULT_CALL_KWARGS[family][size]`` holds call arguments that fit each pipeline.

Imports torch and diffusers only inside its functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aitune_hf.testing import parts

FAMILIES: tuple[str, ...] = ("sd", "flux", "pixart")
SIZES: tuple[str, ...] = ("tiny", "small")

PROMPT = "a photo of an astronaut riding a horse"

DEFAULT_CALL_KWARGS: dict[str, dict[str, dict[str, Any]]] = {
    "sd": {
        "tiny": {"prompt": PROMPT, "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 7.5},
        "small": {
            "prompt": PROMPT,
            "height": 128,
            "width": 128,
            "num_inference_steps": 4,
            "guidance_scale": 7.5,
        },
    },
    "flux": {
        "tiny": {
            "prompt": PROMPT,
            "height": 32,
            "width": 32,
            "num_inference_steps": 2,
            "guidance_scale": 3.5,
            "max_sequence_length": 32,
        },
        "small": {
            "prompt": PROMPT,
            "height": 128,
            "width": 128,
            "num_inference_steps": 4,
            "guidance_scale": 3.5,
            "max_sequence_length": 64,
        },
    },
    "pixart": {
        # use_resolution_binning=False: PixArt's binning only knows sample sizes 32/64/128 and would
        # otherwise resize to 256..1024 pixel buckets.
        "tiny": {
            "prompt": PROMPT,
            "height": 32,
            "width": 32,
            "num_inference_steps": 2,
            "guidance_scale": 4.5,
            "max_sequence_length": 32,
            "use_resolution_binning": False,
            "clean_caption": False,
        },
        "small": {
            "prompt": PROMPT,
            "height": 128,
            "width": 128,
            "num_inference_steps": 4,
            "guidance_scale": 4.5,
            "max_sequence_length": 64,
            "use_resolution_binning": False,
            "clean_caption": False,
        },
    },
}

# Model hyper-parameters per family and size.
_SD_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "unet_channels": (8, 16),
        "unet_layers": 1,
        "unet_heads": 2,
        "unet_groups": 4,
        "vae_channels": (8, 16, 16),
        "vae_groups": 4,
        "text_hidden": 16,
        "text_layers": 2,
        "text_heads": 2,
    },
    "small": {
        "unet_channels": (96, 192),
        "unet_layers": 2,
        "unet_heads": 4,
        "unet_groups": 32,
        "vae_channels": (32, 64, 64),
        "vae_groups": 32,
        "text_hidden": 64,
        "text_layers": 4,
        "text_heads": 4,
    },
}

_FLUX_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "layers": 1,
        "single_layers": 1,
        "heads": 2,
        "head_dim": 16,
        "axes_dims_rope": (4, 6, 6),
        "vae_channels": (8, 16),
        "vae_groups": 4,
        "clip_hidden": 16,
        "clip_layers": 2,
        "t5_d_model": 16,
        "t5_layers": 2,
    },
    "small": {
        "layers": 2,
        "single_layers": 4,
        "heads": 8,
        "head_dim": 64,
        "axes_dims_rope": (16, 24, 24),
        "vae_channels": (32, 64, 64),
        "vae_groups": 32,
        "clip_hidden": 64,
        "clip_layers": 4,
        "t5_d_model": 64,
        "t5_layers": 4,
    },
}

_PIXART_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "layers": 2,
        "heads": 2,
        "head_dim": 8,
        "vae_channels": (8, 16),
        "vae_groups": 4,
        "t5_d_model": 16,
        "t5_layers": 2,
    },
    "small": {
        "layers": 6,
        "heads": 6,
        "head_dim": 64,
        "vae_channels": (32, 64, 64),
        "vae_groups": 32,
        "t5_d_model": 64,
        "t5_layers": 4,
    },
}


def _check_size(size: str) -> None:
    if size not in SIZES:
        from aitune_hf.errors import UserInputError  # aitune_hf (and torch) load only when an error is raised

        raise UserInputError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        from aitune_hf.errors import UserInputError  # aitune_hf (and torch) load only when an error is raised

        raise UserInputError(f"unknown family {family!r}; valid families: {', '.join(FAMILIES)}")


def default_call_kwargs(family: str, size: str = "tiny") -> dict[str, Any]:
    """Return a fresh copy of the pipeline call arguments for ``family`` and ``size``."""
    _check_family(family)
    _check_size(size)
    return dict(DEFAULT_CALL_KWARGS[family][size])


# --------------------------------------------------------------------------------------------------------------
# Pipelines
# --------------------------------------------------------------------------------------------------------------


def build_sd_pipeline(folder: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Build a random ``StableDiffusionPipeline`` (UNet with cross-attention blocks, VAE, CLIP) into ``folder``.

    Structure: ``unet.down_blocks`` = (CrossAttnDownBlock2D, DownBlock2D), ``unet.mid_block`` =
    UNetMidBlock2DCrossAttn, ``unet.up_blocks`` = (UpBlock2D, CrossAttnUpBlock2D); DDIM scheduler with SD 1.x
    betas; no safety checker. Returns ``Path(folder)``.
    """
    _check_size(size)
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    cfg = _SD_CONFIGS[size]
    tokenizer = parts.clip_tokenizer()
    text_encoder = parts.clip_text_model(tokenizer, cfg["text_hidden"], cfg["text_layers"], cfg["text_heads"], seed)
    vae_scale = 2 ** (len(cfg["vae_channels"]) - 1)
    latent_size = DEFAULT_CALL_KWARGS["sd"][size]["height"] // vae_scale
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=latent_size,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=cfg["unet_channels"],
        layers_per_block=cfg["unet_layers"],
        norm_num_groups=cfg["unet_groups"],
        cross_attention_dim=cfg["text_hidden"],
        attention_head_dim=cfg["unet_heads"],  # diffusers' (mis)name for the number of heads in the UNet
    ).eval()
    vae = parts.vae(cfg["vae_channels"], cfg["vae_groups"], 4, seed, sample_size=latent_size * vae_scale)
    scheduler = DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return parts.save(pipe, folder)


def build_flux_pipeline(folder: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Build a random ``FluxPipeline`` (Flux transformer, 16-channel VAE, CLIP + T5) into ``folder``.

    The transformer has ``transformer_blocks`` (FluxTransformerBlock) and ``single_transformer_blocks``
    (FluxSingleTransformerBlock), guidance embedding on (Flux-dev style). Returns ``Path(folder)``.
    """
    _check_size(size)
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    cfg = _FLUX_CONFIGS[size]
    latent_channels = 16
    tokenizer = parts.clip_tokenizer()
    text_encoder = parts.clip_text_model(tokenizer, cfg["clip_hidden"], cfg["clip_layers"], 2, seed)
    tokenizer_2 = parts.t5_tokenizer()
    text_encoder_2 = parts.t5_encoder(tokenizer_2, cfg["t5_d_model"], cfg["t5_layers"], seed)
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,  # latents are packed 2x2
        num_layers=cfg["layers"],
        num_single_layers=cfg["single_layers"],
        attention_head_dim=cfg["head_dim"],
        num_attention_heads=cfg["heads"],
        joint_attention_dim=cfg["t5_d_model"],
        pooled_projection_dim=cfg["clip_hidden"],
        guidance_embeds=True,
        axes_dims_rope=cfg["axes_dims_rope"],
    ).eval()
    vae = parts.vae(
        cfg["vae_channels"],
        cfg["vae_groups"],
        latent_channels,
        seed,
        sample_size=DEFAULT_CALL_KWARGS["flux"][size]["height"],
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    return parts.save(pipe, folder)


def build_pixart_pipeline(folder: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Build a random ``PixArtAlphaPipeline`` (PixArt transformer, VAE, T5) into ``folder``.

    The transformer's ``transformer_blocks`` are BasicTransformerBlocks (ada_norm_single, learned sigma).
    Call it with ``use_resolution_binning=False`` (see ``DEFAULT_CALL_KWARGS``). Returns ``Path(folder)``.
    """
    _check_size(size)
    import torch
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel

    cfg = _PIXART_CONFIGS[size]
    tokenizer = parts.t5_tokenizer()
    text_encoder = parts.t5_encoder(tokenizer, cfg["t5_d_model"], cfg["t5_layers"], seed)
    vae_scale = 2 ** (len(cfg["vae_channels"]) - 1)
    latent_size = DEFAULT_CALL_KWARGS["pixart"][size]["height"] // vae_scale
    inner_dim = cfg["heads"] * cfg["head_dim"]
    torch.manual_seed(seed)
    transformer = PixArtTransformer2DModel(
        num_attention_heads=cfg["heads"],
        attention_head_dim=cfg["head_dim"],
        in_channels=4,
        out_channels=8,  # learned sigma, as in PixArt-alpha
        num_layers=cfg["layers"],
        cross_attention_dim=inner_dim,
        attention_bias=True,
        sample_size=latent_size,
        patch_size=2,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        caption_channels=cfg["t5_d_model"],
    ).eval()
    vae = parts.vae(cfg["vae_channels"], cfg["vae_groups"], 4, seed, sample_size=latent_size * vae_scale)
    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000,
        beta_start=0.0001,
        beta_end=0.02,
        beta_schedule="linear",
    )
    pipe = PixArtAlphaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    return parts.save(pipe, folder)


_BUILDERS = {"sd": build_sd_pipeline, "flux": build_flux_pipeline, "pixart": build_pixart_pipeline}


def build_pipeline(family: str, folder: str | Path | None = None, size: str = "tiny", seed: int = 0) -> Path:
    """Build the random pipeline of ``family`` (one of ``FAMILIES``) into ``folder`` and return the folder. With no
    ``folder``, into a new temporary folder that is removed when the process exits (nothing is left in the current
    folder, or anywhere else)."""
    _check_family(family)
    if folder is None:
        folder = Path(_temporary_folder(f"aitune_hf_{family}_")) / family
    return _BUILDERS[family](folder, size=size, seed=seed)


def _temporary_folder(prefix: str) -> str:
    """A new temporary folder, removed at process exit."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
