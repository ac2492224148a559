"""The persistent cache (core/cache.py): a fresh process starts warm from decisions and ONNX models another one
wrote, and nothing stale, corrupt, foreign or unsafe is ever used. Every served output is compared with eager."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

from aitune_hf import register
from aitune_hf.core import keys as keys_module
from aitune_hf.core.cache import TuningCache
from tests.core.modules import MLPBlock

QUICK = {
    "progress": False,
    "warmup": 1,
    "repeats": 3,
    "min_speedup": 0.0,
    "backends": ["onnxruntime"],
    "anytime": False,
}


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(MLPBlock(32), MLPBlock(32)).eval()


def _tuned(model: torch.nn.Module, x: torch.Tensor, **config: Any) -> tuple[Any, torch.Tensor]:
    """Register the blocks, record one call, tune in the next; returns (registration, the served output)."""
    registration = register(model, {**QUICK, **config})
    with torch.no_grad():
        model(x)
        registration.tune()
        model(x)
        out = model(x)
    assert registration.all_tuned, registration.report()
    return registration, out


def _eager(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _signatures(registration: Any) -> list[Any]:
    return [s for target in registration.targets.values() for s in target.report().signatures]


def test_a_second_registration_starts_warm_from_the_cache(tmp_path: Path) -> None:
    x = torch.randn(4, 32)
    cold_model, warm_model = _model(), _model()
    expected = _eager(cold_model, x)
    cold, cold_out = _tuned(cold_model, x, cache_dir=tmp_path)
    assert cold.cache.stats.misses == 1 and cold.cache.stats.written == 3  # one decision, an artifact per block
    cold.detach()
    warm, warm_out = _tuned(warm_model, x, cache_dir=tmp_path)
    torch.testing.assert_close(cold_out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(warm_out, expected, atol=1e-4, rtol=1e-4)
    stats = warm.cache.stats
    assert (stats.hits, stats.misses, stats.written, stats.artifacts_loaded) == (2, 0, 0, 2), stats
    first = _signatures(warm)[0]
    assert first.from_cache and [c.backend for c in first.candidates] == ["onnxruntime"]
    assert sum(target.report().calls.get("onnxruntime", 0) for target in warm.targets.values()) == 4
    assert "2 decision(s) reused" in stats.line()  # the second block took the first's, from the cache
    text = str(warm.report())
    assert stats.line() in text and "decision and timings from the cache" in text


def test_read_only_reuses_and_writes_nothing(tmp_path: Path) -> None:
    x = torch.randn(4, 32)
    _tuned(_model(), x, cache_dir=tmp_path)[0].detach()
    before = sorted(str(p) for p in tmp_path.rglob("*") if "tmp" not in p.parts)
    model = _model()
    registration, out = _tuned(model, x, cache_dir=tmp_path, cache="ro")
    torch.testing.assert_close(out, _eager(model, x), atol=1e-4, rtol=1e-4)
    assert registration.cache.stats.hits == 2 and registration.cache.stats.written == 0
    assert "read-only: nothing written" in registration.cache.stats.line()
    assert sorted(str(p) for p in tmp_path.rglob("*") if "tmp" not in p.parts) == before
    # A read-only cache that does not exist is created by nobody, and tunes in full.
    empty = tmp_path / "none"
    registration, out = _tuned(_model(), x, cache_dir=empty, cache="ro")
    assert not empty.exists() and registration.cache.stats.misses == 1


def _entry(root: Path) -> Path:
    (entry,) = (root / "entries").iterdir()
    return entry


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda entry: (entry / "decision.json").write_text('{"format": 1, "key": "'), id="truncated-json"),
        pytest.param(lambda entry: (entry / "decision.json").write_bytes(os.urandom(64)), id="corrupt-json"),
        pytest.param(
            lambda entry: (entry / "decision.json").write_text(
                json.dumps({**json.loads((entry / "decision.json").read_text()), "format": 99})
            ),
            id="other-format",
        ),
    ],
)
def test_a_damaged_decision_is_ignored_with_a_warning_and_replaced(
    tmp_path: Path, damage: Any, caplog: pytest.LogCaptureFixture
) -> None:
    x = torch.randn(4, 32)
    _tuned(_model(), x, cache_dir=tmp_path)[0].detach()
    damage(_entry(tmp_path))
    model = _model()
    with caplog.at_level(logging.WARNING, logger="aitune_hf.core.cache"):
        registration, out = _tuned(model, x, cache_dir=tmp_path)
    torch.testing.assert_close(out, _eager(model, x), atol=1e-4, rtol=1e-4)
    stats = registration.cache.stats
    assert stats.misses == 1 and len(stats.problems) == 1 and "ignoring entry" in caplog.text
    # Replaced: a third process starts warm again.
    registration.detach()
    assert _tuned(_model(), x, cache_dir=tmp_path)[0].cache.stats.hits == 2


def test_a_truncated_or_changed_artifact_is_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(4, 32)
    _tuned(_model(), x, cache_dir=tmp_path)[0].detach()
    models = sorted(_entry(tmp_path).glob("*/model.onnx"))
    assert len(models) == 2
    data = models[0].read_bytes()
    models[0].write_bytes(data[: len(data) // 2])  # truncated
    flipped = bytearray(models[1].read_bytes())
    flipped[-10] ^= 0xFF  # same size, one byte changed
    models[1].write_bytes(bytes(flipped))
    model = _model()
    with caplog.at_level(logging.WARNING, logger="aitune_hf.core.cache"):
        registration, out = _tuned(model, x, cache_dir=tmp_path)
    torch.testing.assert_close(out, _eager(model, x), atol=1e-4, rtol=1e-4)
    stats = registration.cache.stats
    assert stats.hits == 2 and stats.artifacts_loaded == 0 and len(stats.problems) == 2, stats
    assert "truncated or changed" in caplog.text
    assert not [e for e in TuningCache(str(tmp_path)).entries(verify=True) if e.problem]  # rewritten whole


def test_another_torch_version_or_module_state_is_another_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(4, 32)
    _tuned(_model(), x, cache_dir=tmp_path)[0].detach()
    found = keys_module.versions()
    monkeypatch.setattr(keys_module, "versions", lambda: {**found, "torch": "9.9"})
    registration, _ = _tuned(_model(), x, cache_dir=tmp_path)
    assert registration.cache.stats.misses == 1
    registration.detach()
    monkeypatch.undo()
    model = _model()
    model[0].norm.eps = 1e-3  # a plain value the guard checks: another module state
    registration, out = _tuned(model, x, cache_dir=tmp_path)
    torch.testing.assert_close(out, _eager(model, x), atol=1e-4, rtol=1e-4)
    stats = registration.cache.stats
    assert (stats.hits, stats.misses) == (0, 1)  # the first block tunes afresh; the second takes its decision
    assert len(list((tmp_path / "entries").iterdir())) == 3


def test_changed_weights_never_load_a_baked_artifact(tmp_path: Path) -> None:
    """A real peft LoRA merged into the weights: the decision is reused, the ONNX model is exported afresh."""
    x = torch.randn(4, 32)
    _tuned(_model(), x, cache_dir=tmp_path)[0].detach()
    peft_model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["up", "down"], init_lora_weights=False))
    merged = peft_model.merge_and_unload().eval()
    expected = _eager(merged, x)
    assert not torch.allclose(expected, _eager(_model(), x), atol=1e-3)
    registration, out = _tuned(merged, x, cache_dir=tmp_path)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    stats = registration.cache.stats
    assert stats.hits == 2 and stats.artifacts_loaded == 0 and stats.written == 2, stats
    assert len(list(_entry(tmp_path).glob("*/model.onnx"))) == 4  # both weights' models are kept


def test_fsspec_memory_file_system(tmp_path: Path) -> None:
    import fsspec

    x = torch.randn(4, 32)
    url = "memory://aitune-hf-test-cache"
    try:
        cold, _ = _tuned(_model(), x, cache_dir=url)
        assert not cold.cache.local and cold.cache.stats.written == 3
        cold.detach()
        model = _model()
        warm, out = _tuned(model, x, cache_dir=url)
        torch.testing.assert_close(out, _eager(model, x), atol=1e-4, rtol=1e-4)
        assert (warm.cache.stats.hits, warm.cache.stats.artifacts_loaded) == (2, 2)
        assert [e.problem for e in TuningCache(url).entries(verify=True)] == [None]
    finally:
        fsspec.filesystem("memory").rm("/aitune-hf-test-cache", recursive=True)


def test_a_folder_others_may_write_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="aitune_hf.core.cache"):
        registration = register(_model(), {**QUICK, "cache_dir": shared})
    assert registration.cache is None and "may be written by other users" in caplog.text
    registration.detach()
    created = tmp_path / "new" / "cache"
    registration = register(_model(), {**QUICK, "cache_dir": created})
    assert registration.cache is not None and (created.stat().st_mode & 0o777) == 0o700
    registration.detach()


def test_the_environment_variable_and_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AITUNE_HF_CACHE", str(tmp_path / "env"))
    registration = register(_model(), QUICK)
    assert registration.cache is not None and registration.cache.location == str(tmp_path / "env")
    registration.detach()
    registration = register(_model(), {**QUICK, "cache": "off"})
    assert registration.cache is None
    registration.detach()


_WORKER = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from aitune_hf import register
    from tests.core.modules import MLPBlock
    torch.manual_seed(0)
    model = torch.nn.Sequential(MLPBlock(32), MLPBlock(32)).eval()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    config = {{"progress": False, "warmup": 1, "repeats": 3, "min_speedup": 0.0,
              "backends": {backends!r}, "cache_dir": sys.argv[1]}}
    registration = register(model, config)
    with torch.no_grad():
        expected = model(x); model(x); registration.tune(); model(x); out = model(x)
    stats = registration.cache.stats
    signatures = [s for t in registration.targets.values() for s in t.report().signatures]
    print(json.dumps({{
        "diff": float((out - expected).abs().max()), "hits": stats.hits, "loaded": stats.artifacts_loaded,
        "chosen": [s.chosen for s in signatures], "built": [[c.backend for c in s.candidates] for s in signatures],
        "frames": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "fx_hits": int(torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]),
    }}))
    """
)


def _worker(
    tmp_path: Path, cache: Path, backends: list[str], inductor_dir: Path | None = None
) -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(root=str(Path(__file__).parents[2]), backends=backends))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if inductor_dir is not None:  # Inductor's own local caches: empty, so that only ours can make a hit
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    return subprocess.Popen(
        [sys.executable, str(script), str(cache)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _result(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_fresh_process_builds_only_the_cached_winner(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cold = _result(_worker(tmp_path, cache, ["inductor", "onnxruntime"]))
    assert cold["diff"] < 1e-4 and cold["hits"] == 0 and sorted(cold["built"][0]) == ["inductor", "onnxruntime"]
    warm = _result(_worker(tmp_path, cache, ["inductor", "onnxruntime"]))
    assert warm["diff"] < 1e-4 and warm["hits"] == 2
    assert warm["chosen"] == cold["chosen"]
    winner = cold["chosen"][0]
    assert warm["built"][0] == [winner]  # no other candidate was built
    if winner != "inductor":
        assert warm["frames"] == 0 and warm["loaded"] == 2  # no compile at all; both ONNX models from the cache


def test_two_processes_writing_at_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first, second = (_worker(tmp_path, cache, ["onnxruntime"]) for _ in range(2))
    results = [_result(first), _result(second)]
    assert all(r["diff"] < 1e-4 for r in results)
    entries = TuningCache(str(cache)).entries(verify=True)
    assert len(entries) == 1 and entries[0].problem is None and len(entries[0].artifacts) == 2
    assert not list((cache / "tmp").iterdir())  # nothing half-written is left
    warm = _result(_worker(tmp_path, cache, ["onnxruntime"]))
    assert warm["hits"] == 2 and warm["loaded"] == 2 and warm["diff"] < 1e-4


def test_inductor_artifacts_make_a_fresh_process_compile_from_the_cache(tmp_path: Path) -> None:
    """Each process with its own empty Inductor cache folder: the warm one's compile hits only through the
    artifacts the cold one left in ours."""
    cache = tmp_path / "cache"
    cold = _result(_worker(tmp_path, cache, ["inductor"], tmp_path / "inductor-cold"))
    assert cold["diff"] < 1e-4 and cold["chosen"] == ["inductor", "inductor"] and cold["fx_hits"] == 0
    warm = _result(_worker(tmp_path, cache, ["inductor"], tmp_path / "inductor-warm"))
    assert warm["diff"] < 1e-4 and warm["hits"] == 2 and warm["loaded"] >= 1 and warm["fx_hits"] >= 1


def test_a_decision_cut_short_by_the_budget_is_not_kept(tmp_path: Path) -> None:
    x = torch.randn(4, 32)
    model = _model()
    registration = register(model, {**QUICK, "cache_dir": tmp_path, "budget_s": 1e-9})
    with torch.no_grad():
        model(x)
        registration.tune()
        torch.testing.assert_close(model(x), _eager(model, x), atol=0, rtol=0)
    assert all(s.chosen == "eager" for s in _signatures(registration))
    assert registration.cache.stats.written == 0 and not (tmp_path / "entries").exists()
    registration.detach()
    registration, _ = _tuned(_model(), x, cache_dir=tmp_path)  # without the budget: tuned, and kept
    assert registration.cache.stats.misses == 1 and registration.cache.stats.written == 3


# -- a negative result never poisons the cache (issue 18) --------------------------------------------------------


def _failing_export() -> Any:
    """ONNX Runtime whose builds fail here (as the export of a channels-last UNet once did), under the same name and
    description as the default one: its decisions go to the same cache entries."""
    from aitune_hf.backends import OnnxRuntimeBackend

    class FailingOnnxRuntime(OnnxRuntimeBackend):
        def build(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("self.stride(-1) must be 1 to view Float")

    return FailingOnnxRuntime()


def test_a_failed_retune_never_replaces_the_good_entry(tmp_path: Path) -> None:
    """The same blocks with other weights (no cached artifact fits them) and a build that fails: eager is kept in
    this process, and the good entry is neither replaced nor joined by a negative one; a fresh registration with
    the first weights is served by it."""
    x = torch.randn(4, 32)
    _tuned(_model(), x, cache_dir=tmp_path)[0].detach()
    good = sorted(p.name for p in _entry(tmp_path).iterdir())
    model = _model(seed=1)
    failing = register(model, {**QUICK, "cache_dir": tmp_path, "backends": [_failing_export()]})
    with torch.no_grad():
        model(x)
        failing.tune()
        torch.testing.assert_close(model(x), _eager(model, x), atol=0, rtol=0)
    signatures = _signatures(failing)
    # the cached winner failed to build here, so it tuned afresh: every candidate failed, eager kept
    assert [s.chosen for s in signatures] == ["eager", "eager"] and "every candidate failed" in signatures[0].reason
    failing.detach()
    assert sorted(p.name for p in _entry(tmp_path).iterdir()) == good  # no negative.json beside the positive one
    warm, out = _tuned(_model(), x, cache_dir=tmp_path)
    torch.testing.assert_close(out, _eager(_model(), x), atol=1e-4, rtol=1e-4)
    assert warm.cache.stats.hits == 2 and [s.chosen for s in _signatures(warm)] == ["onnxruntime", "onnxruntime"]


def test_an_eager_decision_is_kept_apart_and_expires(tmp_path: Path) -> None:
    x = torch.randn(4, 32)
    cold, _ = _tuned(_model(), x, cache_dir=tmp_path, backends=[_failing_export()])
    assert [s.chosen for s in _signatures(cold)] == ["eager", "eager"]
    cold.detach()
    entry = _entry(tmp_path)
    assert sorted(p.name for p in entry.iterdir()) == ["negative.json"]
    warm, _ = _tuned(_model(), x, cache_dir=tmp_path)  # reused while it holds: nothing is built
    assert warm.cache.stats.hits == 2 and all(not s.candidates for s in _signatures(warm))
    warm.detach()
    (listed,) = TuningCache(str(tmp_path)).entries(verify=True)  # what `aitune-hf cache ls|verify` print
    assert listed.negative and listed.problem is None  # a negative entry is whole, not a problem
    assert "-> eager, negative until" in listed.describe() and "every candidate failed" in listed.describe()
    record = json.loads((entry / "negative.json").read_text())
    (entry / "negative.json").write_text(json.dumps({**record, "expires": "2020-01-01T00:00:00+00:00"}))
    again, out = _tuned(_model(), x, cache_dir=tmp_path)  # expired: tuned again; the positive result replaces it
    torch.testing.assert_close(out, _eager(_model(), x), atol=1e-4, rtol=1e-4)
    assert again.cache.stats.misses == 1 and [s.chosen for s in _signatures(again)] == ["onnxruntime"] * 2
    again.detach()
    assert (entry / "decision.json").exists() and not (entry / "negative.json").exists()


def _siblings(seed: int = 0) -> torch.nn.Sequential:
    """Identical blocks that differ in a plain value, as Transformers layers do in `layer_idx`: they share one decision
    in a process, and each has a cache key of its own."""
    model = _model(seed)
    for index, block in enumerate(model):
        block.layer_idx = index
    return model


def _files(root: Path) -> dict[str, list[str]]:
    return {entry.name: sorted(p.name for p in entry.iterdir()) for entry in (root / "entries").iterdir()}


def test_a_shared_decision_leaves_whole_entries_that_a_later_process_reuses(tmp_path: Path) -> None:
    """The sibling that took its twin's decision gets that decision under its own key beside the artifact it built:
    `aitune-hf cache verify` finds every entry whole, and the sibling alone in a later process starts warm."""
    x = torch.randn(4, 32)
    model = _siblings()
    cold, out = _tuned(model, x, cache_dir=tmp_path)
    torch.testing.assert_close(out, _eager(model, x), atol=1e-4, rtol=1e-4)
    assert [s.shared_from for s in _signatures(cold)] == [None, "0"]
    assert cold.cache.stats.written == 4  # a decision and an artifact per block
    cold.detach()
    entries = TuningCache(str(tmp_path)).entries(verify=True)  # what `aitune-hf cache ls|verify` print
    assert len(entries) == 2 and [e.problem for e in entries] == [None, None], [e.describe() for e in entries]
    assert all(len(e.artifacts) == 1 and e.record["chosen"] == "onnxruntime" for e in entries)
    assert sum("(decision shared with 0)" in e.describe() for e in entries) == 1
    warm, out = _tuned(_siblings(), x, cache_dir=tmp_path)  # both from the cache, nothing written again
    stats = warm.cache.stats
    assert (stats.hits, stats.misses, stats.artifacts_loaded, stats.written) == (2, 0, 2, 0), stats
    warm.detach()
    model = _siblings()
    alone = register({"1": model[1]}, {**QUICK, "cache_dir": tmp_path})  # the sibling alone: its own entry serves it
    with torch.no_grad():
        model(x)
        alone.tune()
        model(x)
        torch.testing.assert_close(model(x), _eager(model, x), atol=1e-4, rtol=1e-4)
    stats = alone.cache.stats
    assert (stats.hits, stats.misses, stats.artifacts_loaded, stats.written) == (1, 0, 1, 0), stats
    assert alone.state_counts == {"tuned": 1}


def test_a_shared_decision_keeps_the_rules_of_negative_entries(tmp_path: Path) -> None:
    """A shared eager decision writes nothing under the sibling's key (it was not tuned), so it never joins or
    replaces the sibling's own positive entry; a shared positive decision replaces the sibling's negative one, as any
    positive decision does."""
    x = torch.randn(4, 32)
    model = _siblings()
    alone = register({"1": model[1]}, {**QUICK, "cache_dir": tmp_path})
    with torch.no_grad():
        model(x)
        alone.tune()
        model(x)
    alone.detach()
    ((sibling, own),) = _files(tmp_path).items()
    assert "decision.json" in own
    failing, _ = _tuned(_siblings(), x, cache_dir=tmp_path, backends=[_failing_export()])
    assert [(s.chosen, s.shared_from) for s in _signatures(failing)] == [("eager", None), ("eager", "0")]
    failing.detach()
    files = _files(tmp_path)
    assert files.pop(sibling) == own  # untouched
    ((first, negative),) = files.items()
    assert negative == ["negative.json"]  # the first block's own result
    # The other way round: the sibling's entry negative, the first block's decision positive and shared.
    shutil.rmtree(tmp_path / "entries" / sibling)
    shutil.rmtree(tmp_path / "entries" / first)
    model = _siblings()
    failing = register({"1": model[1]}, {**QUICK, "cache_dir": tmp_path, "backends": [_failing_export()]})
    with torch.no_grad():
        model(x)
        failing.tune()
        model(x)
    failing.detach()
    assert _files(tmp_path) == {sibling: ["negative.json"]}
    shared, _ = _tuned(_siblings(), x, cache_dir=tmp_path)
    assert [(s.chosen, s.shared_from) for s in _signatures(shared)] == [("onnxruntime", None), ("onnxruntime", "0")]
    shared.detach()
    assert [n for n in _files(tmp_path)[sibling] if n.endswith(".json")] == ["decision.json"]
    assert not [e.problem for e in TuningCache(str(tmp_path)).entries(verify=True) if e.problem]


def test_the_layout_of_the_inputs_is_part_of_the_key(tmp_path: Path) -> None:
    x = torch.randn(4, 32)
    transposed = torch.randn(32, 4).t()  # the same shape, another layout
    _tuned(_model(), x, cache_dir=tmp_path)[0].detach()
    registration, out = _tuned(_model(), transposed, cache_dir=tmp_path)
    torch.testing.assert_close(out, _eager(_model(), transposed), atol=1e-4, rtol=1e-4)
    assert registration.cache.stats.misses == 1 and len(list((tmp_path / "entries").iterdir())) == 2


_READ_ONLY = textwrap.dedent(
    """
    import json, logging, sys, torch
    sys.path.insert(0, {root!r})
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from aitune_hf import register
    from tests.core.modules import MLPBlock
    torch.manual_seed(0)
    model = torch.nn.Sequential(MLPBlock(32), MLPBlock(32)).eval()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    config = {{"progress": False, "warmup": 1, "repeats": 3, "min_speedup": 0.0, "backends": ["onnxruntime"],
              "cache_dir": sys.argv[1]}}
    registration = register(model, config)
    with torch.no_grad():
        expected = model(x); model(x); registration.tune(); model(x); out = model(x)
    stats = registration.cache.stats
    print(json.dumps({{"diff": float((out - expected).abs().max()), "states": registration.state_counts,
                      "line": stats.line(), "written": stats.written}}))
    """
)


def test_a_cache_on_a_read_only_file_system_is_read_and_tuning_goes_on(tmp_path: Path) -> None:
    """A read-only bind mount of a filled cache (as a fleet mounts a shared volume; root ignores file modes, a
    read-only mount does not), in a private mount namespace: blocks tune (from the cache, and afresh for what it
    lacks), nothing is written, one warning says why."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs unshare and mount (util-linux) for a private read-only bind mount")
    filled = tmp_path / "filled"
    _tuned(_model(), torch.randn(4, 32, generator=torch.Generator().manual_seed(1)), cache_dir=filled)[0].detach()
    for entry in (filled / "entries").iterdir():  # one decision is missing: that block tunes afresh, writing nothing
        (entry / "decision.json").unlink()
    before = sorted(str(p.relative_to(filled)) for p in filled.rglob("*"))
    mount = tmp_path / "ro"
    mount.mkdir()
    script = tmp_path / "read_only.py"
    script.write_text(_READ_ONLY.format(root=str(Path(__file__).parents[2])))
    shell = f"mount --bind {filled} {mount} && mount -o remount,bind,ro {mount} && {sys.executable} {script} {mount}"
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if result.returncode != 0 and "mount" in result.stderr and "Traceback" not in result.stderr:
        pytest.skip(f"no private read-only mount here: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts["states"] == {"tuned": 2} and facts["diff"] < 1e-4 and facts["written"] == 0
    assert "not writable: Read-only file system" in facts["line"]
    assert result.stderr.count("cannot be written (Read-only file system)") == 1  # one warning
    assert sorted(str(p.relative_to(filled)) for p in filled.rglob("*")) == before
