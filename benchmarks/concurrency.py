"""Latency that tuning adds to concurrent requests (issue 8): the small SD pipeline served from N threads,
eager, while its blocks tune inside the requests (the blocking lock), and after tuning.

    python benchmarks/concurrency.py                         # 4 request threads x 25 requests per phase
    python benchmarks/concurrency.py --threads 4 --requests 10

Only the blocking mechanism exists: tuning runs inside the caller's request under a process-wide lock, and
callers of the block being tuned wait for it (docs/serving.md). Tuning in the background is not built, so
there is no "background" column to measure.

The server, as tests/hf/test_threads.py builds it: one `StableDiffusionPipeline` object per request thread,
sharing the components of one `AITunePipeline` (loaded with `from_pretrained`), each with its own scheduler;
the prompt is encoded once up front (Diffusers' prompt encoding is not thread-safe with a shared text
encoder and tokenizer), so requests run the UNet and the VAE decoder. torch: 1 intra-op thread per request
thread (checked inside a worker); ONNX Runtime: 1 intra-op thread, 1 inter-op thread.

Phases, each `--threads` threads x `--requests` requests, all threads released at once by a barrier:

A. eager: a plain pipeline (no aitune_hf), after one single-thread call, which is the reference output;
B. tuning under traffic: a fresh pipeline, `enable_aitune("blocks", backends=["onnxruntime"], progress=False)`
   (ONNX Runtime only: Inductor never won a block on this CPU and its compiles take minutes), one whole
   single-thread call that records and arms every block it runs, then the traffic: the blocks tune inside
   those requests (a poller records when each one decided);
C. after tuning: the same traffic on the same pipeline, every block the traffic runs decided.
(A2. eager again, unless --no-eager-again: the same traffic as A, to show how much the machine drifted.)

Per request: latency by `aitune_hf.Stopwatch` around the call (the project's timer; its interleaved
rounds time functions, and a live server's per-request latencies are a different quantity).
Every output of every phase is compared with the single-thread eager reference; a max abs diff above 1e-3
fails the run (after the results are written).

Results: benchmarks/results/concurrency.json and concurrency.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import onnxruntime
import torch
import transformers
from diffusers import StableDiffusionPipeline
from machine import cpu_model  # benchmarks/ is on sys.path: the scripts run as files

import aitune_hf
from aitune_hf import AITunePipeline, Stopwatch, clock, testing

# Tuning is measured from scratch: aitune_hf's persistent cache (on by default) stays off unless AITUNE_HF_CACHE
# is set (a folder, to measure a warm start) or a run passes its own cache_dir.
os.environ.setdefault("AITUNE_HF_CACHE", "off")

RESULTS = Path(__file__).resolve().parent / "results"
ATOL = 1e-3
PERCENTILES = (50, 90, 99)


def _load(folder: Path) -> Any:
    pipe = AITunePipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _workers(pipe: Any, n: int) -> list[Any]:
    """One pipeline object per request thread, sharing `pipe`'s components, each with its own scheduler."""
    out = []
    for _ in range(n):
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        worker = StableDiffusionPipeline(**{**pipe.components, "scheduler": scheduler})
        worker.set_progress_bar_config(disable=True)
        out.append(worker)
    return out


def traffic(
    call: Callable[[Any], np.ndarray],
    workers: list[Any],
    requests: int,
    on_release: Callable[[float], None] | None = None,
) -> tuple[list[dict[str, Any]], list[np.ndarray], float, list[int]]:
    """Each worker's thread makes `requests` calls back to back, all released at once (`on_release(t0)` is
    called at the release).

    Returns per-request rows (thread, index, start s from release, latency s), the outputs in the same order,
    the phase's wall seconds, and torch.get_num_threads() as each worker thread saw it."""
    rows: list[dict[str, Any]] = []
    outputs: list[np.ndarray] = []
    errors: list[BaseException] = []
    seen_threads: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(workers) + 1)

    def run(index: int) -> None:
        with lock:
            seen_threads.append(torch.get_num_threads())
        barrier.wait()
        for i in range(requests):
            try:
                with Stopwatch() as watch:
                    out = call(workers[index])
            except BaseException as error:  # reported after the phase; a failed request is a finding
                with lock:
                    errors.append(error)
                continue
            with lock:
                rows.append({"thread": index, "request": i, "start_s": watch.start, "latency_s": watch.seconds})
                outputs.append(out)

    threads = [threading.Thread(target=run, args=(n,), name=f"request-{n}") for n in range(len(workers))]
    for thread in threads:
        thread.start()
    barrier.wait()
    with Stopwatch() as watch:
        if on_release:
            on_release(watch.start)
        for thread in threads:
            thread.join()
    t0, wall = watch.start, watch.seconds
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) raised; first: {errors[0]!r}") from errors[0]
    for row in rows:
        row["start_s"] = round(row["start_s"] - t0, 4)
        row["latency_s"] = round(row["latency_s"], 5)
    return rows, outputs, wall, seen_threads


class Poller:
    """Records, every `period` s, when each target of a registration first reached a decision."""

    def __init__(self, registration: Any, period: float = 0.05) -> None:
        self.registration = registration
        self.period = period
        self.decided_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poller", daemon=True)

    def start(self, t0: float) -> Poller:
        self.t0 = t0
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            now = clock() - self.t0  # a moment, not a duration: on the clock of Stopwatch.start
            for name, target in self.registration.targets.items():
                if name not in self.decided_at and target.decided:
                    self.decided_at[name] = round(now, 3)
            self._stop.wait(self.period)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return dict(self.decided_at)


def summarize(rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    lat = np.array([r["latency_s"] for r in rows]) * 1e3
    stats = {f"p{p}_ms": float(np.percentile(lat, p)) for p in PERCENTILES}
    stats.update(
        max_ms=float(lat.max()),
        mean_ms=float(lat.mean()),
        min_ms=float(lat.min()),
        requests=len(rows),
        wall_s=wall,
        requests_per_s=len(rows) / wall,
    )
    return stats


def max_diff(outputs: list[np.ndarray], reference: np.ndarray) -> float:
    return max(float(np.abs(out.astype(np.float64) - reference).max()) for out in outputs)


def run(args: argparse.Namespace, folder: Path, log: Callable[[str], None]) -> dict[str, Any]:
    kwargs = {**testing.default_call_kwargs("sd", "small"), "output_type": "np"}
    prompt = kwargs.pop("prompt")
    phases: dict[str, Any] = {}

    # -- A: eager -----------------------------------------------------------------------------------------
    pipe_a = _load(folder)
    with torch.no_grad():
        embeds, negative = pipe_a.encode_prompt(prompt, "cpu", 1, True)
    kwargs.update(prompt_embeds=embeds, negative_prompt_embeds=negative)

    def call(p: Any) -> np.ndarray:
        return p(**kwargs, generator=torch.Generator().manual_seed(0)).images

    with Stopwatch() as first:
        reference = call(pipe_a)  # the single-thread eager reference (and the first call: loads, allocates)
    with Stopwatch() as single:
        again = call(pipe_a)
    first_call_s, single_s = first.seconds, single.seconds
    if not np.array_equal(again, reference):
        raise SystemExit("eager single-thread calls differ from each other: no usable reference")
    log(f"reference: single-thread eager call {single_s * 1e3:.0f} ms (first call {first_call_s * 1e3:.0f} ms)")

    def phase(name: str, pipe: Any, poll: Any = None, warmup: int = 0) -> tuple[list[np.ndarray], dict[str, float]]:
        workers = _workers(pipe, args.threads)
        if warmup:  # unrecorded concurrent round(s): the process's first concurrent requests pay for warm-up
            traffic(call, workers, warmup)
        poller = Poller(poll) if poll is not None else None
        rows, outputs, wall, seen = traffic(call, workers, args.requests, poller.start if poller else None)
        decided = poller.stop() if poller else {}
        stats = summarize(rows, wall)
        stats["max_abs_diff"] = max_diff(outputs, reference)
        stats["torch_threads_in_workers"] = sorted(set(seen))
        phases[name] = {"stats": stats, "requests": rows}
        log(
            f"{name}: p50 {stats['p50_ms']:.0f} ms, p90 {stats['p90_ms']:.0f}, p99 {stats['p99_ms']:.0f}, "
            f"max {stats['max_ms']:.0f}, {stats['requests_per_s']:.2f} req/s, max diff {stats['max_abs_diff']:.1e}"
        )
        return outputs, decided

    phase("A", pipe_a, warmup=args.warmup)

    # -- B: tuning under traffic --------------------------------------------------------------------------
    pipe_b = _load(folder)
    registration = pipe_b.enable_aitune("blocks", backends=["onnxruntime"], progress=False)
    with Stopwatch() as recording:
        recorded = call(pipe_b)  # records every block it runs and arms them (tune_after_calls=1)
    record_call_s = recording.seconds
    record_diff = float(np.abs(recorded.astype(np.float64) - reference).max())
    armed = {name: str(t.state) for name, t in registration.targets.items()}
    log(f"B: record+arm call {record_call_s * 1e3:.0f} ms; states {registration.state_counts}")
    calls_armed = {name: dict(r.calls) for name, r in registration.reports.items()}
    _, decided = phase("B", pipe_b, registration)
    report_b = registration.report()
    eager_in_b = sum(  # calls of blocks that ended TUNED, run eager in B: while another block held the lock
        r.calls.get("eager", 0) - calls_armed[name].get("eager", 0)
        for name, r in report_b.modules.items()
        if str(registration.targets[name].state) == "tuned"
    )
    states_after_b = {name: str(t.state) for name, t in registration.targets.items()}
    log(f"B: tuning {report_b.tuning_seconds:.1f} s in total; states {registration.state_counts}")

    # -- C: after tuning ----------------------------------------------------------------------------------
    calls_before = {name: dict(r.calls) for name, r in registration.reports.items()}
    phase("C", pipe_b)
    report_c = registration.report()
    served_in_c = {
        name: {k: v - calls_before[name].get(k, 0) for k, v in r.calls.items() if v - calls_before[name].get(k, 0)}
        for name, r in report_c.modules.items()
    }

    if args.eager_again:  # the plain pipeline of A again: how much the machine drifted meanwhile
        phase("A2", pipe_a)

    targets = []
    for name, r in report_c.modules.items():
        targets.append(
            {
                "target": name,
                "class": r.module_class,
                "armed_after_record_call": armed[name],
                "state_after_B": states_after_b[name],
                "backend": r.backend,
                "tuning_s": round(r.tuning_seconds, 3),
                "decided_at_s_into_B": decided.get(name),
                "speedup_at_tuning": r.speedup,
                "calls_in_C": served_in_c[name],
            }
        )
    a, b, c = (phases[k]["stats"] for k in ("A", "B", "C"))
    last_decision = max((v for v in decided.values()), default=None)
    rows_b = phases["B"]["requests"]
    inside = [r["latency_s"] * 1e3 for r in rows_b if last_decision is not None and r["start_s"] < last_decision]
    window = {"requests": len(inside), "min_ms": min(inside, default=0.0), "max_ms": max(inside, default=0.0)}
    after_window = [r for r in rows_b if last_decision is None or r["start_s"] >= last_decision]
    if after_window:
        window["after_window"] = summarize(after_window, 1.0)
        del window["after_window"]["wall_s"], window["after_window"]["requests_per_s"]
    return {
        "reference": {
            "single_thread_eager_ms": single_s * 1e3,
            "first_call_ms": first_call_s * 1e3,
            "record_arm_call_ms": record_call_s * 1e3,
            "record_call_max_abs_diff": record_diff,
        },
        "added_B_vs_A": {
            "p50_ms": b["p50_ms"] - a["p50_ms"],
            "p99_ms": b["p99_ms"] - a["p99_ms"],
            "p50_pct": 100 * (b["p50_ms"] / a["p50_ms"] - 1),
            "p99_pct": 100 * (b["p99_ms"] / a["p99_ms"] - 1),
        },
        "C_vs_A": {
            "p50_ms": c["p50_ms"] - a["p50_ms"],
            "p99_ms": c["p99_ms"] - a["p99_ms"],
            "p50_pct": 100 * (c["p50_ms"] / a["p50_ms"] - 1),
            "p99_pct": 100 * (c["p99_ms"] / a["p99_ms"] - 1),
        },
        "tuning": {
            "tuning_seconds_total": report_b.tuning_seconds,
            "last_decision_s_into_B": last_decision,
            "requests_started_before_last_decision": len(inside),
            "window": window,
            "eager_calls_while_armed": eager_in_b,
            "state_counts_after_B": dict(Counter(states_after_b.values())),
        },
        "phases": phases,
        "targets": targets,
    }


# -- output -----------------------------------------------------------------------------------------------------

PHASE_NAMES = {
    "A": "A: eager",
    "B": "B: tuning under traffic (blocking)",
    "C": "C: after tuning",
    "A2": "A2: eager again (drift check)",
}


def markdown(result: dict[str, Any]) -> str:
    setting, ref, tuning = result["setting"], result["reference"], result["tuning"]
    added, after = result["added_B_vs_A"], result["C_vs_A"]
    window = tuning["window"]
    n = setting["request threads"]
    lines = [
        "# Latency that tuning adds to concurrent requests (issue 8)",
        "",
        f"Command: `{result['command']}`",
        "",
        "Setting: " + ", ".join(f"{k} {v}" for k, v in setting.items()) + ".",
        "",
        "**Blocking only.** Background tuning is not built (docs/serving.md says why), so only the blocking",
        "mechanism is measured: tuning runs inside a request under the process-wide tuning lock.",
        "",
        f"Workload: {setting['workload']}; {n} request threads, one `StableDiffusionPipeline` per thread sharing",
        "the components (own scheduler each), prompt embeddings computed once up front (so requests run the",
        "UNet and the VAE decoder; the 4 CLIP text-encoder blocks are registered but never called).",
        "Latency: `aitune_hf.Stopwatch` around each request (not its interleaved rounds, which time",
        "functions: a live server's per-request latencies are a different quantity). Percentiles are",
        f"numpy's linear ones over all {setting['requests per phase']} requests of a phase (p99 of so few requests",
        "is close to the max).",
        "",
        "| phase | requests | p50 ms | p90 ms | p99 ms | max ms | mean ms | requests/s | wall s "
        "| max abs diff vs eager |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, phase in result["phases"].items():
        s = phase["stats"]
        lines.append(
            f"| {PHASE_NAMES[key]} | {s['requests']} | {s['p50_ms']:.0f} | {s['p90_ms']:.0f} | {s['p99_ms']:.0f} "
            f"| {s['max_ms']:.0f} | {s['mean_ms']:.0f} | {s['requests_per_s']:.2f} | {s['wall_s']:.1f} "
            f"| {s['max_abs_diff']:.1e} |"
        )
    lines += [
        "",
        f"- Added by tuning under traffic (B vs A): p50 {added['p50_ms']:+.0f} ms ({added['p50_pct']:+.0f}%), "
        f"p99 {added['p99_ms']:+.0f} ms ({added['p99_pct']:+.0f}%).",
        f"- After tuning (C vs A): p50 {after['p50_ms']:+.0f} ms ({after['p50_pct']:+.0f}%), "
        f"p99 {after['p99_ms']:+.0f} ms ({after['p99_pct']:+.0f}%).",
        f"- Tuning: {tuning['tuning_seconds_total']:.1f} s in total (sum of the targets' tuning seconds from the "
        f"report); the last block decided {tuning['last_decision_s_into_B']} s into phase B; "
        f"{tuning['requests_started_before_last_decision']} of {result['phases']['B']['stats']['requests']} "
        f"requests of B started before that. States after B: {tuning['state_counts_after_B']}.",
        f"- B split at the last decision: {window['requests']} request(s) started before it took "
        f"{window['min_ms']:.0f}-{window['max_ms']:.0f} ms"
        + (
            f"; the {window['after_window']['requests']} after it: p50 {window['after_window']['p50_ms']:.0f} ms, "
            f"p99 {window['after_window']['p99_ms']:.0f} ms."
            if "after_window" in window
            else "."
        ),
        f"- Calls of a still-armed block that ran eager in B because another block held the tuning lock: "
        f"{tuning['eager_calls_while_armed']}.",
        f"- Single-thread eager call: {ref['single_thread_eager_ms']:.0f} ms; the single-thread record+arm call "
        f"before B: {ref['record_arm_call_ms']:.0f} ms (not part of B's requests).",
        f"- Every output of every phase matched the single-thread eager reference within {ATOL:g}: "
        f"{'yes' if result['outputs_ok'] else 'NO'}.",
        "",
        "| target | class | after record call | after B | backend | tuning s | decided at s into B | calls in C |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in result["targets"]:
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(t["calls_in_C"].items())) or "-"
        at = "-" if t["decided_at_s_into_B"] is None else f"{t['decided_at_s_into_B']:.1f}"
        lines.append(
            f"| {t['target']} | {t['class']} | {t['armed_after_record_call']} | {t['state_after_B']} "
            f"| {t['backend']} | {t['tuning_s']:.1f} | {at} | {calls} |"
        )
    lines += ["", "## What it means", "", result["meaning"], ""]
    return "\n".join(lines)


def meaning(result: dict[str, Any]) -> str:
    a, b, c = (result["phases"][k]["stats"] for k in ("A", "B", "C"))
    tuning, window = result["tuning"], result["tuning"]["window"]
    cores, threads = result["setting"]["cores"], result["setting"]["request threads"]
    text = (
        "With the blocking mechanism, one block tunes at a time in the whole process, inside whichever request "
        "reached it first, and that request pays for the tuning (export, build, checks, timing against eager). "
        "Every other request runs eager through a block that is being tuned (the ONNX exporter traces a private "
        "copy of the block, so nothing waits for it), and eager through any still-armed block while the lock is "
        f"held: {tuning['eager_calls_while_armed']} such block calls in B. So the requests that tuned blocks "
        "make the tail, and the others run at eager speed until the blocks are served: here the "
        f"{window['requests']} requests that started before the last block decided took "
        f"{window['min_ms'] / 1e3:.1f} to {window['max_ms'] / 1e3:.1f} s (tuning: "
        f"{tuning['tuning_seconds_total']:.1f} s summed over blocks, the last block decided "
        f"{tuning['last_decision_s_into_B'] or 0:.1f} s into B). "
        f"That is B's tail: p99 {b['p99_ms']:.0f} ms against eager's {a['p99_ms']:.0f} ms"
    )
    if 2 * window["requests"] < b["requests"]:
        text += (
            f", while B's p50 ({b['p50_ms']:.0f} ms) is set by the requests after the window, which are served "
            f"like C's ({c['p50_ms']:.0f} ms)"
        )
    text += (
        ". What one request can add is the tuning of the blocks it happened to tune (here several, since one "
        "thread often reaches the next armed block first); only tuning in the background, not built, would take "
        "it off the requests' path. An earlier version made callers of a block being tuned wait for it; every "
        "request then queued behind the tuning thread block after block (p99 43 s in the same setting). "
    )
    text += (
        f"The machine has {cores} cores shared with other engineers' jobs, so {threads} request threads "
        "oversubscribe it and absolute numbers are noisy (the single-thread eager call took "
        f"{result['reference']['single_thread_eager_ms']:.0f} ms here); the tuning's timing runs were "
        "measured on this loaded machine too, so a block's keep-or-drop decision may differ from a quiet "
        "machine's."
    )
    if "A2" in result["phases"]:
        a2 = result["phases"]["A2"]["stats"]
        text += (
            f" The same eager traffic run again at the end (A2) had p50 {a2['p50_ms']:.0f} ms vs A's "
            f"{a['p50_ms']:.0f} ms: differences between phases of that size are the machine's drift, not aitune_hf."
        )
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4, help="request threads (each a pipeline object)")
    parser.add_argument("--requests", type=int, default=25, help="requests per thread per phase")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads; ONNX Runtime the same")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded requests per thread before phase A")
    parser.add_argument("--no-eager-again", dest="eager_again", action="store_false", help="skip phase A2")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads < 1 or args.requests < 1:
        raise SystemExit("--threads and --requests must be >= 1")

    torch.set_num_threads(args.torch_threads)
    torch.set_num_interop_threads(1)
    kwargs = testing.default_call_kwargs("sd", "small")
    setting = {
        "workload": f"sd small pipeline, {kwargs['height']}x{kwargs['width']}, {kwargs['num_inference_steps']} "
        "steps, guidance 7.5 (batch 2 through the UNet), fp32",
        "request threads": args.threads,
        "requests per phase": args.threads * args.requests,
        "torch threads": f"{torch.get_num_threads()} intra-op per request thread, 1 inter-op",
        "ONNX Runtime threads": f"{torch.get_num_threads()} intra-op, 1 inter-op",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load average at start": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "aitune_hf": getattr(aitune_hf, "__version__", "?"),
    }
    command = "python benchmarks/concurrency.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"setting: {setting}", flush=True)
    with Stopwatch() as wall, tempfile.TemporaryDirectory(prefix="aitune_concurrency_") as folder:
        built = testing.build_pipeline("sd", Path(folder) / "sd", size="small")
        body = run(args, built, lambda text: print(text, flush=True))
    setting["load average at end"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    setting["benchmark wall s"] = round(wall.seconds, 1)
    diffs = {k: p["stats"]["max_abs_diff"] for k, p in body["phases"].items()}
    result = {"command": command.strip(), "setting": setting, "outputs_ok": max(diffs.values()) <= ATOL, **body}
    result["meaning"] = meaning(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "concurrency.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (args.out / "concurrency.md").write_text(text)
    print(text)
    if not result["outputs_ok"]:
        bad = {k: v for k, v in diffs.items() if v > ATOL}
        raise SystemExit(f"FAILED: outputs differ from the single-thread eager reference by more than {ATOL}: {bad}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
