"""Per-call cost of guards (issue 7): how much of a tuned end-to-end call the per-call guard checks take.

    python benchmarks/guards.py                                   # sd and minilm_b1_s32, 1 thread
    python benchmarks/guards.py --workloads minilm_b1_s32 --modes blocks,auto,blocks-forced --rounds 31

Every call a tuned block serves first runs `route.guard.check()`: a C-level comparison of the block's
submodules' `__dict__`s with snapshots (the module-state part) and, for a backend that baked the weights
(ONNX Runtime by default), a `torch._foreach_norm` over every parameter and buffer (the weight-value part).

Per workload and mode (ONNX Runtime only; `enable_aitune("blocks")`, or "auto", or "blocks" with min_speedup 0
so that every correct ONNX Runtime build serves; called until every target decided):

1. whole calls, eager (`bypass()`), tuned, and tuned with every guard check short-circuited (`check -> None`;
   a cross-check of the micro-timing below, in the same interleaved rounds: its difference to tuned is the
   guards' cost as the whole call sees it, cold caches included, but within the noise of the machine);
2. target calls per whole call (`calls_served` deltas) and guard checks per whole call (counted);
3. per guard, the median cost of `check()`, of the weight part (`_weights.holds()`) and of the state part
   (`_frozen == _live`), each timed in a warm loop with the project's timer (`time_interleaved`), and with the
   caches evicted before each check (`_time_guard_cold`: what a check pays after an engine call that left none of
   it cached);
4. guard cost per whole call = sum over the checks of one call of that guard's cost; as % of tuned e2e, warm and
   evicted. The goal is judged on the evicted figure.

Results: benchmarks/results/guards.json and guards.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipelines  # noqa: I001  (first: sets TORCHINDUCTOR_CACHE_DIR before torch; Inductor is not used here)
import numpy as np
import onnxruntime
import torch

from aitune_hf import Stopwatch, time_interleaved
from aitune_hf.core.guards import ModuleGuard  # internal on purpose: this benchmark times the guards themselves
from machine import cpu_model

RESULTS = pipelines.RESULTS
GOALS = {"sd": 1.0, "minilm_b1_s32": 3.0}  # the ceilings: guard cost as % of end to end


def _places(guard: Any) -> list[tuple[str, dict[str, Any], str]]:
    """The (name, table, key) of the tensors a guard's weight check reads (none without a weight check)."""
    return guard.weights.places if guard.weights is not None else []


def _commit() -> str:
    """The checked-out commit, and whether the package's files differ from it (read-only git)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "aitune_hf"], cwd=root, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes in aitune_hf/" if dirty.stdout.strip() else "")


def _routes(obj: Any) -> Iterator[tuple[str, Any]]:
    for name, target in obj.aitune.targets.items():
        for route in target.routes:
            yield name, route


@contextmanager
def _guards_off(obj: Any) -> Iterator[None]:
    """Every route's guard holds without checking (instance attribute shadows ModuleGuard.check)."""
    guards = [route.guard for _, route in _routes(obj)]
    for guard in guards:
        guard.check = _holds
    try:
        yield
    finally:
        for guard in guards:
            del guard.check


def _holds() -> None:
    return None


def _count_checks(obj: Any, call: Callable[[], Any]) -> Counter[int]:
    """id(guard) -> how often one whole call checks it."""
    counts: Counter[int] = Counter()
    guards = [route.guard for _, route in _routes(obj)]

    def counting(guard: ModuleGuard) -> Callable[[], str | None]:
        def check() -> str | None:
            counts[id(guard)] += 1
            return ModuleGuard.check(guard)

        return check

    for guard in guards:
        guard.check = counting(guard)
    try:
        call()
    finally:
        for guard in guards:
            del guard.check
    return counts


def _parts(guard: ModuleGuard) -> dict[str, Callable[[], Any]]:
    """What is timed of a guard: `check()`, its state part and, where it checks weights, its weight part."""
    parts: dict[str, Callable[[], Any]] = {"check": guard.check, "state": guard.state_holds}
    if guard.weights is not None:
        parts["weights"] = guard.weights.holds
    return parts


def _time_guard(guard: ModuleGuard, repeats: int) -> dict[str, float]:
    """Median seconds of check(), of its state part and of its weight part (warm loop, interleaved; each
    candidate runs about 10 ms per round)."""
    candidates = _parts(guard)
    with torch.inference_mode():
        one, _ = time_interleaved({"check": guard.check}, [((), {})] * 5, warmup=1, repeats=3)
        loop = max(
            3, min(500, int(0.01 / max(one["check"], 1e-7)))
        )  # as in a served call (pipelines run under no_grad / inference_mode)
        latencies, failures = time_interleaved(candidates, [((), {})] * loop, warmup=2, repeats=repeats)
    if failures:
        raise RuntimeError(f"guard timing failed: {failures}")
    latencies.setdefault("weights", 0.0)
    return latencies


#: Bytes read between two cold checks: more than any of these CPUs' last-level cache (32 MB an AMD EPYC CCD, up to
#: about 112 MB a Sapphire Rapids socket), so that a check finds none of what it reads cached.
_EVICT_BYTES = 256 * 2**20


def _time_guard_cold(guard: ModuleGuard, repeats: int, evict: Any) -> dict[str, float]:
    """Median seconds of check(), of its state part and of its weight part with the caches evicted before each (a pass
    over `evict`, a NumPy buffer of `_EVICT_BYTES` made once per run): what a check pays when the call before it (a
    block's engine, hundreds of MB of weights and activations) left nothing of the guard cached. The warm loop
    (`_time_guard`) is the other bound."""
    parts = _parts(guard)
    times: dict[str, list[float]] = {name: [] for name in parts}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, part in parts.items():
                evict += 1.0  # reads and writes every line of the buffer
                with Stopwatch() as watch:
                    part()
                times[name].append(watch.seconds)
    cold = {name: statistics.median(values) for name, values in times.items()}
    cold.setdefault("weights", 0.0)
    return cold


#: mode -> (targets, extra enable_aitune options). "blocks-forced": every correct ONNX Runtime build serves
#: (min_speedup 0), so the guards of served blocks are measured even where the tuner keeps eager.
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "blocks": ("blocks", {}),
    "auto": ("auto", {}),
    "blocks-forced": ("blocks", {"min_speedup": 0.0}),
}


def run(workload: pipelines.Workload, mode: str, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    targets_kind, options = MODES[mode]
    obj = workload.make()
    workload.call(obj)  # first call of this copy: loads, allocates, warms up (as pipelines.py does)
    obj.enable_aitune(targets_kind, backends=["onnxruntime"], progress=False, **options)
    tuning_calls = 0
    while not obj.aitune.all_tuned:
        workload.call(obj)
        tuning_calls += 1
        if tuning_calls > 8:
            raise RuntimeError(f"not all tuned after {tuning_calls} calls: {obj.aitune.state_counts}")
    targets = obj.aitune.targets
    chosen = Counter(r.report.chosen for _, r in _routes(obj))
    log(f"  tuned after {tuning_calls} calls: {len(targets)} targets {obj.aitune.state_counts}; routes {dict(chosen)}")
    workload.call(obj)  # one more tuned call before counting (settles anything lazy)

    # 2. target calls and guard checks per whole call
    before = {name: Counter(t.calls_served) for name, t in targets.items()}
    workload.call(obj)
    served = {name: Counter(t.calls_served) - before[name] for name, t in targets.items()}
    per_target_calls = {name: sum(c.values()) for name, c in served.items()}
    served_by = sum(served.values(), Counter())
    checks = _count_checks(obj, lambda: workload.call(obj))

    # 1. whole calls
    def eager() -> Any:
        with obj.aitune.bypass():
            return workload.call(obj)

    def unguarded() -> Any:
        with _guards_off(obj):
            return workload.call(obj)

    candidates = {"tuned": lambda: workload.call(obj), "eager": eager, "tuned_no_guards": unguarded}
    e2e, failures = time_interleaved(candidates, [((), {})], warmup=2, repeats=rounds, baseline="tuned")
    if failures:
        raise RuntimeError(f"whole-call timing failed: {failures}")
    log(f"  e2e: eager {e2e['eager'] * 1e3:.2f} ms, tuned {e2e['tuned'] * 1e3:.2f} ms, "
        f"tuned without guard checks {e2e['tuned_no_guards'] * 1e3:.2f} ms")  # fmt: skip

    # 3. per guard
    changes = sorted({change for t in targets.values() for change in t.changes})
    if changes:
        log(f"  GUARD FAILURES while measuring (each runs eager and re-arms tuning): {changes[:3]}")
    rows = []
    total = {"check": 0.0, "state": 0.0, "weights": 0.0}
    total_cold = 0.0
    evict = np.ones(_EVICT_BYTES // 8)
    for name, route in _routes(obj):
        guard = route.guard
        n = checks.get(id(guard), 0)
        holds = guard.check()
        cost = _time_guard(guard, repeats=31)
        cold = _time_guard_cold(guard, repeats=31, evict=evict)
        total_cold += n * cold["check"]
        rows.append(
            {
                "target": name,
                "module": type(targets[name].module).__name__,
                "backend": route.report.chosen,
                "calls_served_per_call": per_target_calls[name],
                "checks_per_call": n,
                "holds": holds is None,
                "failure": holds,
                "guarded_dicts": guard.guarded_dicts,
                "weight_tensors": len(_places(guard)),
                "weight_mb": round(sum(t[k].numel() * t[k].element_size() for _, t, k in _places(guard)) / 1e6, 3),
                "check_us": cost["check"] * 1e6,
                "state_us": cost["state"] * 1e6,
                "weights_us": cost["weights"] * 1e6,
                "check_cold_us": cold["check"] * 1e6,
                "state_cold_us": cold["state"] * 1e6,
                "weights_cold_us": cold["weights"] * 1e6,
            }
        )  # fmt: skip
        # Split of what the check costs per call: its weight part only runs when the state part holds.
        weights_part = cost["weights"] if holds is None else 0.0
        total["check"] += n * cost["check"]
        total["weights"] += n * weights_part
        total["state"] += n * max(cost["check"] - weights_part, 0.0)
    tuned = e2e["tuned"]
    n_checks = sum(r["checks_per_call"] for r in rows)
    result = {
        "workload": workload.name,
        "mode": mode,
        "enable_aitune": {"targets": targets_kind, "backends": ["onnxruntime"], **options},
        "describe": workload.describe,
        "rounds": rounds,
        "targets": len(targets),
        "routes": dict(chosen),
        "eager_ms": e2e["eager"] * 1e3,
        "tuned_ms": tuned * 1e3,
        "tuned_no_guards_ms": e2e["tuned_no_guards"] * 1e3,
        "speedup": e2e["eager"] / tuned,
        "target_calls_per_call": sum(per_target_calls.values()),
        "target_calls_served_by": dict(served_by),
        "routes_after_measuring": sum(len(t.routes) for t in targets.values()),
        "guard_failures": changes,
        "guard_checks_per_call": n_checks,
        "guard_us_per_target_call": {
            "total": total["check"] * 1e6 / max(n_checks, 1),
            "state": total["state"] * 1e6 / max(n_checks, 1),
            "weights": total["weights"] * 1e6 / max(n_checks, 1),
        },
        "guard_ms_per_call": {k: v * 1e3 for k, v in total.items()},
        "guard_pct_of_e2e": {
            "total": 100 * total["check"] / tuned,
            "state": 100 * total["state"] / tuned,
            "weights": 100 * total["weights"] / tuned,
        },
        "guard_pct_of_e2e_cold": 100 * total_cold / tuned,
        "e2e_pct_tuned_vs_no_guards": 100 * (tuned - e2e["tuned_no_guards"]) / tuned,
        "goal_pct": GOALS.get(workload.name),
        "per_route": rows,
    }
    pct = result["guard_pct_of_e2e"]
    delta = result["e2e_pct_tuned_vs_no_guards"]
    log(f"  [{mode}] {result['target_calls_per_call']} target calls, {n_checks} guard checks per call; guards "
        f"{total['check'] * 1e3:.3f} ms = {pct['total']:.2f}% of e2e (state {pct['state']:.2f}%, "
        f"weights {pct['weights']:.2f}%), {result['guard_pct_of_e2e_cold']:.2f}% with the caches evicted; e2e tuned "
        f"vs no guards {delta:+.2f}%")  # fmt: skip
    obj.disable_aitune()
    return result


def markdown(results: list[dict[str, Any]], setting: dict[str, Any], command: str) -> str:
    lines = [
        "# Per-call cost of guards",
        "",
        f"Command: `{command}`",
        "",
        f"Setting: {', '.join(f'{k} {v}' for k, v in setting.items())}.",
        "",
        'ONNX Runtime only; mode: `enable_aitune("blocks")`, `"auto"`, or blocks-forced (blocks, min_speedup 0: every',
        "correct ONNX Runtime build serves). E2E: medians of interleaved whole calls. Guard cost: for",
        "each guard, the median of `check()` (state part: `_frozen == _live`; weight part: `_weights.holds()`)",
        "in a warm loop, and with the caches evicted before each check (a pass over 256 MB: what a check pays when",
        "the engine call before it left nothing of it cached), times how often one whole call checks it. The two",
        "bound what a served call pays: warm below, evicted above (small blocks called back to back keep part of",
        "what their guards read cached). The goal is MET when the evicted figure meets it, MET warm only when only",
        "the warm one does. *No-guard delta*: tuned e2e vs tuned with every check short-circuited, same rounds",
        "(noisy cross-check; includes cold-cache effects).",
        "",
        "| workload | mode | target calls served by (one call) | eager ms | tuned ms | speed-up | target calls / call "
        "| guard µs / target call, warm (state / weights) | guard % of e2e, warm (state / weights) "
        "| guard % of e2e, caches evicted | goal | no-guard delta |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        us, pct = r["guard_us_per_target_call"], r["guard_pct_of_e2e"]
        goal = r["goal_pct"]
        cold = r["guard_pct_of_e2e_cold"]
        verdict = "-"
        if goal is not None:
            verdict = f"≤ {goal:g}%: " + (
                "MET" if cold <= goal else "MET warm only" if pct["total"] <= goal else "NOT MET"
            )
        served = ", ".join(f"{k} x{v}" for k, v in r["target_calls_served_by"].items())
        lines.append(
            f"| {r['workload']} | {r['mode']} | {served} "
            f"| {r['eager_ms']:.2f} | {r['tuned_ms']:.2f} | {r['speedup']:.3f}x "
            f"| {r['target_calls_per_call']} | {us['total']:.1f} ({us['state']:.1f} / {us['weights']:.1f}) "
            f"| {pct['total']:.2f}% ({pct['state']:.2f}% / {pct['weights']:.2f}%) | {cold:.2f}% | {verdict} "
            f"| {r['e2e_pct_tuned_vs_no_guards']:+.2f}% |"
        )
    lines.append("")
    for r in results:
        if r["guard_failures"]:
            lines.append(
                f"- {r['workload']} ({r['mode']}): guards failed while measuring ({r['routes_after_measuring']} routes "
                f"after): {'; '.join(r['guard_failures'][:3])}{' ...' if len(r['guard_failures']) > 3 else ''}"
            )
    lines.append("")
    for r in results:
        lines += [f"## {r['workload']} ({r['mode']}): {r['describe']}", ""]
        lines += [
            "| target | module | route | holds | weights MB | checks / call | check µs: warm / evicted "
            "| state µs: warm / evicted | weights µs: warm / evicted |"
        ]
        lines += ["|---|---|---|---|---|---|---|---|---|"]
        for row in r["per_route"]:
            lines.append(
                f"| {row['target']} | {row['module']} | {row['backend']} | {'yes' if row['holds'] else 'NO'} "
                f"| {row['weight_mb']:.2f} | {row['checks_per_call']} "
                f"| {row['check_us']:.1f} / {row['check_cold_us']:.1f} | {row['state_us']:.1f} / "
                f"{row['state_cold_us']:.1f} | {row['weights_us']:.1f} / {row['weights_cold_us']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="sd,minilm_b1_s32")
    parser.add_argument("--modes", default="blocks", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds of whole calls")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads; ONNX Runtime uses the same")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(set(modes) - set(MODES))}; valid: {', '.join(MODES)}")

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    setting = {
        "torch threads": torch.get_num_threads(),
        "ONNX Runtime threads": f"{torch.get_num_threads()} intra-op, 1 inter-op",
        "rounds": args.rounds,
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "commit": _commit(),
    }
    command = "python benchmarks/guards.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"setting: {setting}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="aitune_guards_") as folder:
        for workload in pipelines.build_workloads(args.workloads.split(","), Path(folder)):
            print(f"== {workload.name}: {workload.describe}", flush=True)
            for mode in modes:
                print(f"-- {mode}", flush=True)
                results.append(run(workload, mode, args.rounds, lambda text: print(text, flush=True)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "guards.json").write_text(
        json.dumps({"command": command.strip(), "setting": setting, "workloads": results}, indent=2)
    )
    text = markdown(results, setting, command.strip())
    (args.out / "guards.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
