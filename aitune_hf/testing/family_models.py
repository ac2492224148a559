"""What each model family of `aitune_hf.testing.families` is made of: a tiny config per architecture (hidden sizes
16-32, two layers or stages), random weights.

`families.family_inputs` feeds these models; the sizes below are shared with it. The generative families are not
here: they are `build_lm`'s models (`aitune_hf.testing.lm`). Imports torch, diffusers and transformers only inside
its functions.
"""

from __future__ import annotations

from typing import Any

from aitune_hf.testing import parts
from aitune_hf.testing.lm import LM_BOS, LM_EOS, LM_PAD, LM_VOCAB

BATCH = 2  # every family's inputs have batch 2: a batch dimension that is not 1 is exported / compiled as such
TEXT = 8  # text tokens of the conditioning sequences
COND = 16  # width of the text conditioning fed to the diffusion transformers


def family_model(name: str) -> Any:
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
            cross_attention_dim=COND,
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
            cross_attention_dim=COND,
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
            joint_attention_dim=COND,
            pooled_projection_dim=COND,
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
            joint_attention_dim=COND,
            caption_projection_dim=16,
            pooled_projection_dim=COND,
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
            caption_channels=COND,
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
            cross_attention_dim=COND,
            cross_attention_dim_t5=COND,
            pooled_projection_dim=16,
            text_len=TEXT,
            text_len_t5=TEXT,
            use_style_cond_and_image_meta_size=False,
        )
    if name == "cogvideox":
        return diffusers.CogVideoXTransformer3DModel(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            time_embed_dim=16,
            text_embed_dim=COND,
            num_layers=2,
            sample_width=8,
            sample_height=8,
            sample_frames=5,  # 2 latent frames
            patch_size=2,
            max_text_seq_length=TEXT,
        )
    if name == "wan":
        return diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            text_dim=COND,
            freq_dim=16,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=32,
        )
    if name == "vae":
        return parts.vae((8, 16), 4, 4, 0, sample_size=16)
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=LM_VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            pad_token_id=LM_PAD,
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
            vocab_size=LM_VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
            projection_dim=32,
            pad_token_id=LM_PAD,
            bos_token_id=LM_BOS,
            eos_token_id=LM_EOS,
        )
        return transformers.CLIPTextModel(config)
    raise AssertionError(name)
