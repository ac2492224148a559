"""The parts the tiny pipelines share: hand-built tokenizers (nothing downloaded), random text encoders, a random
VAE, and saving a pipeline with every module in eval mode.

A byte-level BPE for CLIP and a ``tokenizers`` Unigram model for T5 (no sentencepiece needed). Used by
`aitune_hf.testing.pipelines` and `aitune_hf.testing.family_models`; imports torch, diffusers and transformers only
inside its functions.
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import CLIPTokenizer, T5Tokenizer

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


def clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
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


def t5_tokenizer(model_max_length: int = 512) -> T5Tokenizer:
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
# Text encoders, VAE, saving
# --------------------------------------------------------------------------------------------------------------


def _round_up(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def clip_text_model(tokenizer: CLIPTokenizer, hidden: int, layers: int, heads: int, seed: int) -> Any:
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


def t5_encoder(tokenizer: T5Tokenizer, d_model: int, layers: int, seed: int) -> Any:
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


def vae(channels: tuple[int, ...], groups: int, latent_channels: int, seed: int, **kwargs: Any) -> Any:
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


def save(pipe: Any, folder: str | Path) -> Path:
    """Put every module of ``pipe`` in eval mode and save it to ``folder``."""
    import torch

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(path))
    return path
