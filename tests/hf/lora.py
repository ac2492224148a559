"""Real peft LoRA adapters for the tiny SD pipeline, built locally and saved the way Diffusers loads them.

`build_sd_lora(pipeline_folder, out_folder, seed)` adds a peft `LoraConfig` adapter to a fresh copy of the
pipeline's UNet, with `init_lora_weights=False` so that lora_B is non-zero and the adapter really changes the
output, and writes `pytorch_lora_weights.safetensors` with `StableDiffusionPipeline.save_lora_weights`.
A test then loads it with `pipe.load_lora_weights(out_folder, adapter_name=...)`. Different seeds give
different adapters.

Facts about peft 0.21 / Diffusers 0.42 that the guard tests rely on (seen with `vars(module)` before/after):
- `load_lora_weights` replaces each targeted `nn.Linear` (`to_q`, `to_k`, `to_v`, `to_out.0`) by a peft
  `lora.Linear` (children `base_layer`, `lora_A`/`lora_B` ModuleDicts, ...), which is left in training mode
  (`training=True`, the UNet itself stays `False`). Loading a second adapter adds `lora_A.<name>` etc. to
  the same layers and makes it the only active one (`_active_adapter == [name]`).
- `set_adapters(names, weights)` writes `scaling[name] = weight * lora_alpha / r` and `_active_adapter`.
- `cross_attention_kwargs={"scale": s}`: the UNet forward multiplies `scaling` by s before the blocks run and
  divides it back after (no net change after the call); the blocks get the kwargs without "scale".
- `disable_lora()`/`enable_lora()` flip `_disable_adapters` on every peft layer.
- `fuse_lora(lora_scale=s)` multiplies `scaling` of the active adapters by s (kept after `unfuse_lora()`),
  appends to `merged_adapters` and edits `base_layer.weight` through `.data +=`: same tensor, same storage,
  no version-counter bump. At s=1 the output is unchanged (to ~1e-5). It also sets `unet.lora_scale`.
- `unload_lora_weights()` puts the original `nn.Linear` objects back.
- `enable_freeu(...)` adds `s1, s2, b1, b2` to `up_blocks[i]` (absent before); `disable_freeu()` sets them to
  None.
"""

from __future__ import annotations

from pathlib import Path

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def build_sd_lora(pipeline_folder: str | Path, out_folder: str | Path, seed: int, rank: int = 4) -> Path:
    """Create a LoRA adapter for the UNet of the SD pipeline in `pipeline_folder`; return `out_folder`."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    unet = UNet2DConditionModel.from_pretrained(Path(pipeline_folder) / "unet")
    config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=LORA_TARGETS)
    torch.manual_seed(seed)
    unet.add_adapter(config, adapter_name="default")
    layers = get_peft_model_state_dict(unet, adapter_name="default")
    StableDiffusionPipeline.save_lora_weights(out_folder, unet_lora_layers=layers)
    return Path(out_folder)
