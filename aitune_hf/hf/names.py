"""Names of Hugging Face objects that the core must treat specially, registered with it at import
(`install_names`): the core names no framework.

- Incidental attributes and config keys (`core.keys.register_incidental`): where a model was loaded from
  (`_name_or_path`, the Hub commit) and which library version wrote its config say nothing of what it computes;
  they stay out of the state fingerprint, so that replicas loading one model from two paths share cache entries.
- Hook attributes (`core.guards.register_hook_attributes`): Accelerate's `_hf_hook` and the forward it saved
  (`_old_forward`), Diffusers' `_diffusers_hook` registry. On the target they are plumbing around the router (offload
  re-applies them every call); inside it they are compared by type, not identity.
- Arguments sized by the cache (`core.signature.register_object_sized`): a 2D attention mask is as long as the KV
  cache plus the call's tokens; in a call that holds a cache its length is left out of the signature, as the cache's
  is, so that every decode step of a padded batch is one signature, not one per length.
"""

from aitune_hf.core.guards import register_hook_attributes
from aitune_hf.core.keys import register_incidental
from aitune_hf.core.signature import register_object_sized

#: Transformers' and Diffusers' config attributes that are not part of what a model computes.
INCIDENTAL = (
    "_name_or_path",  # Transformers' PretrainedConfig, Diffusers' ConfigMixin: the folder or Hub id loaded from
    "name_or_path",  # Transformers' models and tokenizers
    "_commit_hash",  # the Hub revision loaded
    "transformers_version",  # the version that wrote config.json
    "_diffusers_version",
    "_use_default_values",  # Diffusers' config: a list made from a set, in a per-process order
)


#: Transformers' forward arguments sized by the KV cache the call holds: name -> the dimension (the cache's length plus
#: the call's tokens).
OBJECT_SIZED = {"attention_mask": -1, "decoder_attention_mask": -1}

#: Accelerate's and Diffusers' per-module hook attributes (`hf/hooks.py` finds the forward slots beneath them).
HOOKS = ("_old_forward", "_hf_hook", "_diffusers_hook")


def install_names() -> None:
    """Register these names with the core (idempotent)."""
    register_incidental(*INCIDENTAL)
    register_hook_attributes(*HOOKS)
    for name, dim in OBJECT_SIZED.items():
        register_object_sized(name, dim)
