"""Copies of an object with aitune enabled (copy.deepcopy, copy.copy, pickle, torch.save) are untuned and eager.

A copy gets the concrete class (never the dynamic aitune subclass), no `_aitune_state`, and each block's
eager forward: the original's compiled code and ONNX Runtime sessions never serve a copy.
"""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from transformers import AutoTokenizer, BertModel

from aitune_hf import AITuneModel, AITunePipeline, enable_aitune
from aitune_hf.errors import UsageError
from aitune_hf.hf.copies import concrete_class, is_dynamic_class
from aitune_hf.hf.loading import with_aitune
from aitune_hf.testing import minilm_path
from tests.hf.conftest import run, unpatched
from tests.quick import QUICK

SD_TARGETS = ["unet.mid_block", "unet.up_blocks.0"]


def _modules(obj):
    if isinstance(obj, torch.nn.Module):
        return list(obj.modules())
    return [m for c in vars(obj).values() if isinstance(c, torch.nn.Module) for m in c.modules()]


def _assert_untuned(duplicate, concrete: type) -> None:
    assert type(duplicate) is concrete
    assert getattr(duplicate, "aitune", None) is None and "_aitune_state" not in vars(duplicate)
    modules = _modules(duplicate)
    assert modules and unpatched(modules)
    for module in modules:  # whatever forward is left on an instance runs that very module, eagerly
        forward = module.__dict__.get("forward")
        assert forward is None or getattr(forward, "__self__", module) is module


def _served(registration) -> int:
    return sum(sum(t.calls_served.values()) for t in registration.targets.values())


def _close(got, want) -> None:
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def tuned_sd(pipeline_folders):
    folder = pipeline_folders["sd"]
    pipe = AITunePipeline.from_pretrained(str(folder))
    eager = run(pipe, "sd")
    registration = pipe.enable_aitune(
        SD_TARGETS, backends=["inductor"], min_speedup=0, progress=False, warmup=1, repeats=2
    )
    run(pipe, "sd")  # records
    run(pipe, "sd")  # tunes
    assert registration.state_counts == {"tuned": 2}, registration.report()
    yield pipe, registration, eager, folder
    pipe.disable_aitune()


def test_deepcopy_of_an_inductor_tuned_pipeline_is_eager_and_follows_its_own_weights(tuned_sd) -> None:
    pipe, registration, eager, folder = tuned_sd
    duplicate = copy.deepcopy(pipe)
    _assert_untuned(duplicate, StableDiffusionPipeline)
    assert "forward" not in duplicate.unet.mid_block.__dict__  # exactly the concrete class's own state
    assert type(pipe.unet.mid_block.__dict__["forward"]).__name__ == "_ForwardRouter"  # the original is untouched
    _close(run(duplicate, "sd"), eager)

    # The measured bug: the copy's weights edited, its output must follow them (never the original's build).
    reference = StableDiffusionPipeline.from_pretrained(str(folder))
    original_weight = pipe.unet.mid_block.resnets[0].conv1.weight.detach().clone()
    for target in (duplicate, reference):
        with torch.no_grad():
            target.unet.mid_block.resnets[0].conv1.weight.add_(0.05)
    edited = run(duplicate, "sd")
    assert np.abs(edited - eager).max() > 1e-3
    _close(edited, run(reference, "sd"))

    # The original keeps its weights and keeps serving tuned, correctly.
    assert torch.equal(pipe.unet.mid_block.resnets[0].conv1.weight, original_weight)
    served = _served(registration)
    np.testing.assert_allclose(run(pipe, "sd"), eager, atol=1e-4, rtol=1e-4)
    assert _served(registration) > served and registration.state_counts == {"tuned": 2}


def test_shallow_copy_is_the_concrete_class_sharing_the_components(tuned_sd) -> None:
    pipe, _, _, _ = tuned_sd
    duplicate = copy.copy(pipe)
    assert type(duplicate) is StableDiffusionPipeline and "_aitune_state" not in vars(duplicate)
    assert duplicate.unet is pipe.unet  # the same module objects: what serves them is the original's business
    assert pipe.aitune is not None


@pytest.mark.parametrize("how", ["pickle2", f"pickle{pickle.HIGHEST_PROTOCOL}", "torch.save"])
def test_pickle_and_torch_save_of_a_tuned_pipeline_load_untuned(tuned_sd, how) -> None:
    pipe, registration, eager, _ = tuned_sd
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(pipe, buffer)
        data = buffer.getvalue()
        loaded = torch.load(io.BytesIO(data), weights_only=False)
    else:
        data = pickle.dumps(pipe, protocol=int(how.removeprefix("pickle")))
        loaded = pickle.loads(data)
    assert b"aitune_hf." not in data  # a plain Diffusers install loads it
    _assert_untuned(loaded, StableDiffusionPipeline)
    _close(run(loaded, "sd"), eager)
    assert pipe.aitune is registration and registration.state_counts == {"tuned": 2}


@pytest.fixture(scope="module")
def batch():
    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    return dict(tokenizer(["a cat sat on the mat", "copies run eager"], padding=True, return_tensors="pt"))


@pytest.fixture(scope="module")
def tuned_bert(batch):
    model = AITuneModel.from_pretrained(str(minilm_path()), local_files_only=True).eval()
    with torch.no_grad():
        eager = model(**batch).last_hidden_state
    registration = model.enable_aitune("blocks", backends=["onnxruntime"], min_speedup=0, **QUICK)
    with torch.no_grad():
        model(**batch)  # records
        model(**batch)  # tunes
    assert registration.state_counts == {"tuned": 6}, registration.report()
    yield model, registration, eager
    model.disable_aitune()


def _hidden(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).last_hidden_state


def test_copies_of_an_ort_tuned_model_are_eager_bert_models(tuned_bert, batch) -> None:
    model, registration, eager = tuned_bert
    with pytest.raises(Exception):  # noqa: B017 - the state holds ONNX Runtime sessions; it never pickles
        pickle.dumps(model.__dict__["_aitune_state"])
    copies = {"deepcopy": copy.deepcopy(model)}
    for protocol in (1, 2, pickle.HIGHEST_PROTOCOL):
        copies[f"pickle{protocol}"] = pickle.loads(pickle.dumps(model, protocol=protocol))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    copies["torch.save"] = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    for how, duplicate in copies.items():
        _assert_untuned(duplicate, BertModel)
        torch.testing.assert_close(_hidden(duplicate, batch), eager, atol=1e-6, rtol=1e-6, msg=how)
    assert "forward" not in copies["deepcopy"].encoder.layer[0].__dict__

    duplicate = copies["deepcopy"]
    with torch.no_grad():  # one output feature (a shift of every feature would vanish in the LayerNorm)
        duplicate.encoder.layer[5].output.dense.weight[0].add_(0.05)
    edited = _hidden(duplicate, batch)
    assert (edited - eager).abs().max() > 1e-3
    weight = model.encoder.layer[5].output.dense.weight
    saved = weight.detach().clone()
    with registration.bypass(), torch.no_grad():  # the original's own eager path, same edit, then undone
        weight[0].add_(0.05)
        try:
            torch.testing.assert_close(edited, _hidden(model, batch), atol=1e-6, rtol=1e-6)
        finally:
            weight.copy_(saved)
    torch.testing.assert_close(_hidden(model, batch), eager, atol=1e-4, rtol=1e-4)
    assert registration.state_counts == {"tuned": 6}


def test_after_disable_aitune_the_model_pickles_as_its_concrete_class(tuned_bert, batch) -> None:
    model, _, eager = tuned_bert
    model.disable_aitune()
    assert is_dynamic_class(type(model)) and type(model).__name__ == "BertModel"
    data = pickle.dumps(model)
    assert b"aitune_hf." not in data
    loaded = pickle.loads(data)
    _assert_untuned(loaded, BertModel)
    assert "forward" not in loaded.encoder.layer[0].__dict__
    torch.testing.assert_close(_hidden(loaded, batch), eager, atol=1e-6, rtol=1e-6)


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _OddState(_Toy):
    def __getstate__(self):  # a state form that aitune_hf cannot rewrite
        return [dict(self.__dict__)]

    def __setstate__(self, state) -> None:
        super().__setstate__(state[0])


def test_concrete_class_helpers() -> None:
    dynamic = with_aitune(_Toy)
    assert is_dynamic_class(dynamic) and concrete_class(dynamic) is _Toy
    assert not is_dynamic_class(_Toy) and concrete_class(_Toy) is _Toy


def test_a_state_that_cannot_be_rewritten_names_disable_aitune() -> None:
    toy = _OddState()
    enable_aitune(toy, ["inner"], backends=[])
    with pytest.raises(UsageError, match=r"disable_aitune\(\)"):
        copy.deepcopy(toy)
    toy.disable_aitune()  # nothing to drop then: the copy is made as the concrete class, state and all
    duplicate = copy.deepcopy(toy)
    assert type(duplicate) is _OddState and unpatched(duplicate.modules())
