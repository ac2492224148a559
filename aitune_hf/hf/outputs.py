"""What an object's whole calls return, where the object says so before any call: the output kinds of the quality
budgets (`core/quality.py`: "images", "embeddings", "logits", "tokens").

`enable_aitune` checks a `quality=` budget against these kinds (`quality.check_budget`) before anything is patched;
for an object not named here (None: a UNet or VAE alone, a classifier head, a Transformers pipeline, a user's
wrapper) the mixin checks it against the first whole call's output instead (`quality.output_kind`). Each rule below
agrees with what `output_kind` reads from that object's outputs; the libraries are recognised by class hierarchy
and attributes, none is imported here.
"""

from __future__ import annotations

from typing import Any

from aitune_hf.hf.targets import is_hf_model


def output_kinds(obj: Any) -> frozenset[str] | None:
    """The kinds of output `obj`'s whole calls return, or None where `obj` does not say before a call.

    - A Diffusers pipeline that makes images (it has an `image_processor`, no `video_processor`): images (`.images`).
    - A sentence-transformers `SentenceTransformer`: embeddings (`encode()`, and its forward's `sentence_embedding`).
    - A Transformers model that generates: logits (its forward) or tokens (`generate()`).
    - A Transformers base model (no head: `model.base_model is model`, as BertModel): embeddings (hidden states).
    """
    if _named(obj, "DiffusionPipeline", "diffusers"):
        if getattr(obj, "image_processor", None) is not None and getattr(obj, "video_processor", None) is None:
            return frozenset({"images"})
        return None
    if _named(obj, "SentenceTransformer", "sentence_transformers"):
        return frozenset({"embeddings"})
    if _named(obj, "PreTrainedModel", "transformers") and is_hf_model(obj):
        if generates(obj):
            return frozenset({"logits", "tokens"})
        if getattr(obj, "base_model", None) is obj:
            return frozenset({"embeddings"})
    return None


def _named(obj: Any, name: str, library: str) -> bool:
    return any(cls.__name__ == name and cls.__module__.split(".")[0] == library for cls in type(obj).__mro__)


def generates(model: Any) -> bool:
    """True for a Transformers model that generates (its forward runs once per generated token)."""
    can_generate = getattr(model, "can_generate", None)
    try:
        return bool(callable(can_generate) and can_generate())
    except Exception:  # a model whose can_generate() needs more set-up than it has
        return False
