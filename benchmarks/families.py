"""What aitune_hf finds and chooses, per block, across model families (the tiny models of aitune_hf.testing).

    python benchmarks/families.py                          # every family; writes benchmarks/results/families.md
    python benchmarks/families.py --families unet,llama --quick

For each family of `aitune_hf.testing.MODEL_FAMILIES`: build the tiny model, load it with its class's real
`from_pretrained`, `enable_aitune(model, "blocks")` with the default backends (ONNX Runtime and Inductor), make
whole calls (`forward`, `vae.decode(z)` or `generate()`) until every block has a decision (bounded), then
report the blocks found, the backend chosen per block (and why eager was kept), the block-level speed-up
range from the tuning report, the tuning seconds, and a whole-call speed-up (rounds of eager then tuned calls,
median of the per-round ratios of median call times). One torch thread (ONNX Runtime uses the same), a cold
Inductor cache.

The models are tiny (hidden sizes 16-32): per-block numbers say what each backend does to such blocks
(mostly Python and dispatch overhead), not what it does at production sizes.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Tuning is measured from scratch: aitune_hf's persistent cache (on by default) stays off unless AITUNE_HF_CACHE
# is set (a folder, to measure a warm start) or a run passes its own cache_dir.
os.environ.setdefault("AITUNE_HF_CACHE", "off")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="aitune_families_inductor_"))

import torch  # after the Inductor cache folder is chosen
from machine import cpu_model  # benchmarks/ is on sys.path: the scripts run as files

from aitune_hf import Stopwatch, TargetState, enable_aitune
from aitune_hf.testing import MODEL_FAMILIES, build_family, call_family, family_inputs, load_family

RESULTS = Path(__file__).resolve().parent / "results"
MAX_CALLS = 6  # whole calls allowed to reach a decision for every block (record, tune, then a margin)


@dataclass
class FamilyResult:
    family: str
    model_class: str
    call: str
    blocks: list[str] = field(default_factory=list)
    chosen: Counter[str] = field(default_factory=Counter)
    eager_reasons: Counter[str] = field(default_factory=Counter)
    block_speedups: list[float] = field(default_factory=list)
    tuning_seconds: float | None = None  # the tuning report's sum over blocks
    calls_to_decide: int | None = None
    end_to_end: float | None = None  # median over rounds of eager / tuned whole-call time
    error: str | None = None


def _short(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    # The reason's own cause is what matters here, not the "no candidate backend is available: " lead-in.
    for lead in ("no candidate backend is available: ",):
        text = text.removeprefix(lead)
    text = text.split("; decision and timings shared with")[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _whole_call_speedup(name: str, model: Any, registration: Any, rounds: int, calls: int) -> float:
    """Median over rounds of (eager / tuned) median whole-call time; each round times `calls` eager calls, then
    `calls` tuned ones, after one untimed call of each (the first served call of a backend can be slow)."""
    inputs = family_inputs(name)

    def median_call() -> float:
        times = []
        for _ in range(calls):
            with Stopwatch() as watch:
                call_family(name, model, inputs)
            times.append(watch.seconds)
        return statistics.median(times)

    with registration.bypass():
        call_family(name, model, inputs)
    call_family(name, model, inputs)
    ratios = []
    for _ in range(rounds):
        with registration.bypass():
            eager = median_call()
        ratios.append(eager / median_call())
    return statistics.median(ratios)


def run_family(name: str, folder: Path, config: dict[str, Any], rounds: int, calls: int, log: Any) -> FamilyResult:
    family = MODEL_FAMILIES[name]
    result = FamilyResult(name, family.model_class, family.call)
    torch._dynamo.reset()  # each family compiles as in a fresh process (Transformers' layers share code objects)
    try:
        model = load_family(name, build_family(name, folder / name))
        registration = enable_aitune(model, "blocks", progress=False, **config)
        result.blocks = list(registration.targets)
        for calls in range(1, MAX_CALLS + 1):
            call_family(name, model, family_inputs(name))
            if registration.all_tuned:
                result.calls_to_decide = calls
                break
        report = registration.report()
        result.tuning_seconds = report.tuning_seconds
        for target_name, target in registration.targets.items():
            module_report = registration.reports[target_name]
            backend = module_report.backend if target.state is TargetState.TUNED else target.state.value
            result.chosen[backend] += 1
            if target.state is not TargetState.TUNED and target.reason:
                result.eager_reasons[_short(target.reason)] += 1
            if target.state is TargetState.TUNED and module_report.speedup is not None:
                result.block_speedups.append(module_report.speedup)
        if registration.all_tuned:
            result.end_to_end = _whole_call_speedup(name, model, registration, rounds, calls)
        log(str(report))
        model.disable_aitune()
    except Exception as error:  # a failing family is a row of the table, not the end of the run
        result.error = f"{type(error).__name__}: {_short(str(error), 200)}"
    return result


def _blocks_cell(blocks: list[str]) -> str:
    if not blocks:
        return "-"
    shown = blocks[0] if len(blocks) == 1 else f"{blocks[0]} … {blocks[-1]}"
    return f"{len(blocks)}: `{shown}`"


def _chosen_cell(result: FamilyResult) -> str:
    parts = [f"{backend} x{count}" for backend, count in result.chosen.most_common()]
    reasons = "; ".join(f"{reason} (x{n})" for reason, n in result.eager_reasons.items())
    return ", ".join(parts) + (f" — eager because: {reasons}" if reasons else "")


def markdown(results: list[FamilyResult], header: dict[str, str]) -> str:
    lines = [
        "# aitune_hf across model families",
        "",
        *[f"- {key}: {value}" for key, value in header.items()],
        "",
        'Blocks: targets of `targets="blocks"` (count: first … last). Chosen: the backend serving each block after',
        "tuning (the default candidates, ONNX Runtime and Inductor; a block stays eager when no candidate was faster",
        "by `min_speedup` or none could run, with the reason). Block speed-up: eager / chosen latency per block,",
        "from the tuning report (tuned blocks only). Whole call: median over interleaved rounds of eager / tuned",
        "median time of the family's whole call. Tuning s: the report's tuning seconds (cold Inductor cache).",
        "Calls: whole calls until every block had a decision.",
        "",
        "| family | model class | call | blocks | chosen | block speed-up | whole call | tuning s | calls |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.family} | {r.model_class} | {r.call} | {_blocks_cell(r.blocks)} | failed: {r.error} "
                         f"| - | - | - | - |")  # fmt: skip
            continue
        speedups = f"{min(r.block_speedups):.2f}x to {max(r.block_speedups):.2f}x" if r.block_speedups else "-"
        whole = f"{r.end_to_end:.2f}x" if r.end_to_end is not None else "-"
        tuning = f"{r.tuning_seconds:.1f}" if r.tuning_seconds is not None else "-"
        calls = str(r.calls_to_decide) if r.calls_to_decide is not None else f">{MAX_CALLS} (undecided)"
        lines.append(
            f"| {r.family} | {r.model_class} | {r.call} | {_blocks_cell(r.blocks)} | {_chosen_cell(r)} | {speedups} "
            f"| {whole} | {tuning} | {calls} |"
        )
    return "\n".join(lines) + "\n"


def _versions() -> str:
    import diffusers
    import onnxruntime
    import transformers

    return (
        f"python {platform.python_version()}, torch {torch.__version__}, diffusers {diffusers.__version__}, "
        f"transformers {transformers.__version__}, onnxruntime {onnxruntime.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(MODEL_FAMILIES), help="comma-separated family names")
    parser.add_argument(
        "--quick", action="store_true", help="fewer timing repeats (warmup 1, repeats 3), 3 rounds of 3 whole calls"
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved whole-call rounds (3 with --quick)")
    parser.add_argument("--calls", type=int, default=5, help="whole calls per method and round (3 with --quick)")
    parser.add_argument("--out", type=Path, default=RESULTS / "families.md")
    args = parser.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in MODEL_FAMILIES]
    if unknown:
        parser.error(f"unknown families {', '.join(unknown)}; valid: {', '.join(MODEL_FAMILIES)}")

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    # torch 2.13's ONNX exporter warns this from inside torch on every export (as tests/conftest.py notes).
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
    config: dict[str, Any] = {"warmup": 1, "repeats": 3} if args.quick else {}
    rounds, calls = (3, 3) if args.quick else (args.rounds, args.calls)
    header = {
        "CPU": f"{cpu_model()} ({os.cpu_count()} cores visible), 1 torch thread",
        "versions": _versions(),
        "command": "python benchmarks/families.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "tuning settings": ", ".join(f"{k}={v}" for k, v in config.items()) or "TuningConfig defaults",
        "date": time.strftime("%Y-%m-%d"),
    }
    print("\n".join(f"{k}: {v}" for k, v in header.items()), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="aitune_families_") as folder:
        for name in names:
            print(f"== {name}", flush=True)
            with Stopwatch() as watch:
                result = run_family(name, Path(folder), config, rounds, calls, lambda text: print(text, flush=True))
            print(f"   {name}: {watch.seconds:.1f} s{' ' + result.error if result.error else ''}")
            results.append(result)
    text = markdown(results, header)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
