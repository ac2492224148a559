"""targets=: blocks, components, dotted names, callables, and the errors for bad selections."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline

from aitune_hf import AITuneModel
from aitune_hf.hf.targets import as_modules, find_targets
from aitune_hf.testing import minilm_path
from tests.hf.conftest import unpatched


@pytest.fixture(scope="module")
def pipes(pipeline_folders):
    return {family: DiffusionPipeline.from_pretrained(folder) for family, folder in pipeline_folders.items()}


def _names(obj, targets="blocks") -> list[str]:
    return [t.name for t in find_targets(obj, targets)]


def _assert_not_nested(names: list[str]) -> None:
    for a in names:
        assert not any(b.startswith(a + ".") for b in names), f"{a} contains another target"


def test_sd_blocks_are_unet_stages_vae_stages_and_clip_layers(pipes) -> None:
    names = _names(pipes["sd"])
    assert [n for n in names if n.startswith("unet.")] == [
        "unet.down_blocks.0", "unet.down_blocks.1", "unet.mid_block", "unet.up_blocks.0", "unet.up_blocks.1",
    ]  # fmt: skip
    assert [n for n in names if n.startswith("vae.")] == [
        "vae.encoder.down_blocks.0", "vae.encoder.down_blocks.1", "vae.encoder.down_blocks.2", "vae.encoder.mid_block",
        "vae.decoder.mid_block", "vae.decoder.up_blocks.0", "vae.decoder.up_blocks.1", "vae.decoder.up_blocks.2",
    ]  # fmt: skip
    assert [n for n in names if n.startswith("text_encoder.")] == [
        "text_encoder.encoder.layers.0", "text_encoder.encoder.layers.1",
    ]  # fmt: skip
    _assert_not_nested(names)


def test_flux_blocks_use_repeated_blocks(pipes) -> None:
    names = _names(pipes["flux"])
    assert "transformer.transformer_blocks.0" in names
    assert "transformer.single_transformer_blocks.0" in names
    assert any(n.startswith("text_encoder_2.encoder.block.") for n in names)  # T5 blocks
    assert any(n.startswith("text_encoder.encoder.layers.") for n in names)  # CLIP layers
    assert not any(".attn" in n or "transformer_blocks.0." in n for n in names)
    _assert_not_nested(names)


def test_pixart_blocks_fall_back_to_no_split_modules_in_module_lists(pipes) -> None:
    names = _names(pipes["pixart"])
    transformer = [n for n in names if n.startswith("transformer.")]
    assert transformer == [f"transformer.transformer_blocks.{i}" for i in range(len(transformer))]
    assert "transformer.pos_embed" not in names  # PatchEmbed is in _no_split_modules but not in a ModuleList
    _assert_not_nested(names)


def test_minilm_blocks_are_bert_layers() -> None:
    model = AITuneModel.from_pretrained(minilm_path(), local_files_only=True)
    assert _names(model) == [f"encoder.layer.{i}" for i in range(6)]
    assert _names(model, "components") == ["model"]
    assert find_targets(model, ["model", "encoder.layer.5"])[0].module is model


def test_components_mode(pipes) -> None:
    assert _names(pipes["sd"], "components") == ["vae.encoder", "vae.decoder", "text_encoder", "unet"]


def test_dotted_names_and_callables(pipes) -> None:
    sd = pipes["sd"]
    found = find_targets(sd, ["unet.mid_block", "vae.decoder.up_blocks.1", "text_encoder"])
    assert [t.module for t in found] == [sd.unet.mid_block, sd.vae.decoder.up_blocks[1], sd.text_encoder]
    assert found[1].component is sd.vae and found[1].path == "decoder.up_blocks.1"
    by_callable = find_targets(sd, lambda pipe: [pipe.unet.up_blocks[0], pipe.unet.down_blocks[1]])
    assert [t.name for t in by_callable] == ["unet.up_blocks.0", "unet.down_blocks.1"]
    named = as_modules(find_targets(sd, lambda pipe: {"first": pipe.unet.down_blocks[0]}))
    assert named == {"first": sd.unet.down_blocks[0]}


def test_bad_selections_say_what_is_valid(pipes) -> None:
    sd = pipes["sd"]
    with pytest.raises(ValueError, match=r"unknown targets 'layers'; valid: 'blocks', 'components'"):
        find_targets(sd, "layers")
    with pytest.raises(ValueError, match=r"'unet.down_block.0' does not name a module.*'unet.down_blocks.0'"):
        find_targets(sd, ["unet.down_block.0"])
    with pytest.raises(ValueError, match=r"'tokenizer.x' does not name a module.*Components: 'vae'"):
        find_targets(sd, ["tokenizer.x"])
    with pytest.raises(TypeError, match=r"must return nn\.Module instances"):
        find_targets(sd, lambda pipe: [pipe.unet.mid_block, "unet.up_blocks.0"])
    with pytest.raises(ValueError, match="not part of this object"):
        find_targets(sd, lambda pipe: [torch.nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="Diffusers pipeline"):
        find_targets(object(), "blocks")


def test_nested_selection_is_refused_at_enable(pipes, pipeline_folders) -> None:
    from aitune_hf import AITunePipeline

    pipe = AITunePipeline.from_pretrained(pipeline_folders["sd"])
    with pytest.raises(ValueError, match=r"targets may not nest: 'unet.mid_block' is inside 'unet'"):
        pipe.enable_aitune(["unet", "unet.mid_block"])
    assert pipe.aitune is None
    assert "forward" not in pipe.unet.__dict__


def test_compare_whole_names_the_components_to_measure_and_refuses_others(pipeline_folders) -> None:
    """`compare_whole=["unet"]`: the UNet is kept over its blocks to be measured (a measure-only target), the other
    components' blocks are targets as with "blocks" and no other component is; a name that is no component holding
    blocks, an empty list or another type is a `ConfigError` naming the value and what is valid, nothing patched."""
    from aitune_hf import AITunePipeline
    from aitune_hf.errors import ConfigError

    pipe = AITunePipeline.from_pretrained(pipeline_folders["sd"])
    with pytest.raises(ConfigError, match=r"names 'tokenizer', not a component that holds blocks here; valid: 'vae"):
        pipe.enable_aitune("blocks", compare_whole=["unet", "tokenizer"])
    for bad in ([], 3, [None]):
        with pytest.raises(ConfigError, match="compare_whole must be True, False or component names"):
            pipe.enable_aitune("blocks", compare_whole=bad)
    assert pipe.aitune is None and unpatched(pipe.unet.modules()) and unpatched(pipe.text_encoder.modules())
    registration = pipe.enable_aitune("blocks", compare_whole="unet", progress=False)
    try:
        blocks = {t.name for t in find_targets(pipe, "blocks")}
        assert set(registration.targets) == blocks | {"unet"}
        assert registration.targets["unet"].measure_only
        assert not any(registration.targets[name].measure_only for name in blocks)
    finally:
        pipe.disable_aitune()
    assert unpatched(pipe.unet.modules()) and unpatched(pipe.text_encoder.modules())


# --------------------------------------------------------------------------------------------------------------
# Components that declare no blocks: ControlNet's stages, the structural fallback, errors with real names
# --------------------------------------------------------------------------------------------------------------


def test_controlnet_stages_are_its_down_blocks_and_mid_block() -> None:
    """A ControlNet has a UNet's down_blocks and mid_block but no up_blocks; its 1x1 output convolutions
    (`controlnet_down_blocks`, a ModuleList of leaves) are never targets."""
    from diffusers import ControlNetModel

    controlnet = ControlNetModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        cross_attention_dim=8,
        norm_num_groups=4,
        attention_head_dim=2,
        conditioning_embedding_out_channels=(4, 8),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        in_channels=4,
    )
    assert _names(controlnet) == ["down_blocks.0", "down_blocks.1", "mid_block"]


def test_hunyuan_dit_declares_nothing_and_gets_its_repeated_blocks() -> None:
    from diffusers import HunyuanDiT2DModel

    model = HunyuanDiT2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, sample_size=8, hidden_size=16, num_layers=3,
        cross_attention_dim=16, cross_attention_dim_t5=16, pooled_projection_dim=8, text_len=4, text_len_t5=4,
        patch_size=2,
    )  # fmt: skip
    assert not getattr(model, "_repeated_blocks", None) and not getattr(model, "_no_split_modules", None)
    assert _names(model) == ["blocks.0", "blocks.1", "blocks.2"]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)


class _Custom(torch.nn.Module):
    """No declarations: a list of leaves (never targets), a mixed list searched inside, a list of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])  # tiny leaves
        self.stack = torch.nn.ModuleList(
            [torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.ModuleList([_Block(), _Block()]))]
        )
        self.trunk = torch.nn.Sequential(torch.nn.ModuleList([_Block(), _Block(), _Block()]))
        self.single = torch.nn.ModuleList([_Block()])  # one instance is not a repetition


def test_structural_fallback_takes_outermost_lists_of_repeated_blocks_only() -> None:
    assert _names(_Custom()) == ["stack.1.0.0", "stack.1.0.1", "trunk.0.0", "trunk.0.1", "trunk.0.2"]


def test_nothing_found_names_real_modules_of_the_object() -> None:
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
            self.head = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"found nothing to tune in this Plain.*targets=\['encoder', 'encoder.0'"):
        find_targets(Plain(), "blocks")
