"""Anytime tuning under traffic (issue 45): seconds from `enable_aitune` to the first tuned call and to the final plan,
and the worst call while the search goes on, against a plain model's calls of the same inputs and against the peer's
one-off cost (OpenVINO converting and compiling the model whole).

    python benchmarks/anytime.py                                   # both workloads, the docs' recipes
    python benchmarks/anytime.py --workloads minilm --precision fp32 --out /tmp/anytime.md
    python benchmarks/anytime.py --workloads minilm --timeline /tmp/t --stalls /tmp/s   # every call; every GIL stall

Traffic, one call after another in one thread, from `enable_aitune` on, until the final plan (no search left, every
target decided, nothing waiting on the worker) and 10 more calls, or `--seconds`:
- `minilm`: all-MiniLM-L6-v2 (real weights) under sentence-transformers, `enable_aitune(model, targets, precision=...)`
  on the `SentenceTransformer`: batches of 32 sentences of varied lengths (a corpus of 256, 6-130 tokens) and single
  queries of lengths the batches never had, in turns (three batches, then four queries).
- `sd`: the small SD pipeline (128 x 128, 4 steps), `pipe.enable_aitune(targets, precision=...)`, whole calls.
Each call's seconds are set against the same inputs' call of a plain copy (medians of 3, timed before): `x plain` below
1 is slower than eager. The figures: the report's `plans` (first call a tuned backend served, and the final plan,
seconds from `enable_aitune`), the first call of the traffic that ran at least 1.2x its plain call, the worst call
while the search went on (x plain) and after it, and the peer's convert-and-compile seconds (`openvino.convert_model`
of the model whole, or of the UNet, text encoder and VAE decoder for SD) in the precision asked (f32, or bf16 for
precision="auto" where the CPU computes it natively). Cold: aitune_hf's cache off, one process per workload, 1 thread.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("AITUNE_HF_CACHE", "off")

import torch
from machine import cpu_model  # benchmarks/ is on sys.path: the scripts run as files

from aitune_hf import AITunePipeline, Stopwatch, clock, enable_aitune, hardware, testing
from aitune_hf.session import format_counts

RESULTS = Path(__file__).resolve().parent / "results"
#: A call counts as tuned-fast from this ratio to its plain call.
FAST = 1.2


def _words(count: int, offset: int) -> str:
    text = (
        "the quick brown fox jumps over a lazy dog while seven small birds sing in tall green trees near an old stone "
        "bridge where children play games and tell long stories about ships sailing across wide seas"
    )
    words = text.split(" ")
    return " ".join(words[(offset + i) % len(words)] for i in range(count))


def minilm_traffic() -> tuple[Callable[[], Any], list[Callable[[Any], Any]], Callable[[str], float]]:
    """(a fresh model, the traffic's calls in turn, the peer's convert-and-compile seconds by precision)."""
    from sentence_transformers import SentenceTransformer

    path = str(testing.minilm_path())
    corpus = [_words(4 + (i * 37) % 100, i) for i in range(256)]
    batches = [corpus[i : i + 32] for i in range(0, 256, 32)]
    queries = [_words(n, n) for n in range(41, 105, 3)]
    calls: list[Callable[[Any], Any]] = []
    for turn in range(24):
        batch = batches[turn % len(batches)]
        calls += [lambda m, batch=batch: m.encode(batch, batch_size=32)] * 1
        if turn % 3 == 2:
            calls += [lambda m, q=q: m.encode(q) for q in queries[(turn // 3) * 4 % len(queries) :][:4]]

    def make() -> Any:
        return SentenceTransformer(path, device="cpu")

    def peer(hint: str) -> float:
        import openvino

        model = make()
        example = model.tokenize(["a short example sentence", "and another one, a little longer than the first"])
        names = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in example]
        with Stopwatch() as watch:
            converted = openvino.convert_model(model[0].auto_model, example_input={n: example[n] for n in names})
            converted.reshape({port.get_any_name(): openvino.PartialShape([-1, -1]) for port in converted.inputs})
            openvino.Core().compile_model(converted, "CPU", {"INFERENCE_PRECISION_HINT": hint,
                                                             "INFERENCE_NUM_THREADS": 1})  # fmt: skip
        return watch.seconds

    return make, calls, peer


def sd_traffic(folder: Path) -> tuple[Callable[[], Any], list[Callable[[Any], Any]], Callable[[str], float]]:
    path = testing.build_pipeline("sd", folder / "sd", size="small")
    kwargs = {**testing.default_call_kwargs("sd", "small"), "output_type": "np"}

    def make() -> Any:
        pipe = AITunePipeline.from_pretrained(path, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def call(pipe: Any) -> Any:
        return pipe(**kwargs, generator=torch.Generator().manual_seed(0))

    def peer(hint: str) -> float:
        import openvino

        pipe = make()
        recorded: dict[str, tuple[tuple, dict]] = {}
        components = {"unet": pipe.unet, "text_encoder": pipe.text_encoder, "vae_decoder": pipe.vae.decoder}
        originals = {}
        for name, module in components.items():  # one call's inputs of each component, as example inputs
            originals[name] = module.forward

            def capture(*args: Any, name: str = name, **kw: Any) -> Any:
                recorded.setdefault(name, (args, kw))
                return originals[name](*args, **kw)

            module.forward = capture
        with torch.no_grad():
            call(pipe)
        for name, module in components.items():
            module.forward = originals[name]
        with Stopwatch() as watch:
            for name, module in components.items():
                args, kw = recorded[name]
                flat = _Flat(module, args, kw)
                converted = openvino.convert_model(flat, example_input=flat.example)
                openvino.Core().compile_model(converted, "CPU", {"INFERENCE_PRECISION_HINT": hint,
                                                                 "INFERENCE_NUM_THREADS": 1})  # fmt: skip
        return watch.seconds

    return make, [call], peer


class _Flat(torch.nn.Module):
    """A component called as the pipeline called it, its tensors positional (what `convert_model` traces), every other
    argument as it was; returns the first output tensor."""

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.module, self.args, self.kwargs = module, args, kwargs
        self.tensor_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.tensor_kwargs = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        self.example = tuple(args[i] for i in self.tensor_args) + tuple(kwargs[k] for k in self.tensor_kwargs)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        args, kwargs = list(self.args), dict(self.kwargs)
        for index, tensor in zip(self.tensor_args + self.tensor_kwargs, tensors, strict=True):
            if isinstance(index, int):
                args[index] = tensor
            else:
                kwargs[index] = tensor
        out = self.module(*args, **kwargs)
        if isinstance(out, tuple | list):
            return out[0]
        out = getattr(out, "sample", getattr(out, "last_hidden_state", out))
        return out


class StallProbe:
    """A thread that sleeps 1 ms again and again: a wake-up later than `STALL_S` is a stall of every thread that needs
    the GIL (or a core), a caller's included. Each is recorded with what aitune_hf's worker thread ran just after it
    (its innermost frames): what held the GIL, or the next step after it."""

    STALL_S = 0.015

    def __init__(self, origin: float) -> None:
        self.origin, self.stalls, self._stop = origin, [], threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            before = time.monotonic()
            time.sleep(0.001)
            late = time.monotonic() - before
            if late > self.STALL_S:
                frames = sys._current_frames()
                worker = next((t for t in threading.enumerate() if t.name.startswith("aitune_hf worker")), None)
                stack = traceback.extract_stack(frames[worker.ident]) if worker and worker.ident in frames else []
                where = " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in stack[::-1][:6])
                self.stalls.append((before - self.origin, late, where or "-"))

    def write(self, path: Path) -> None:
        self._stop.set()
        self._thread.join()
        with open(path, "w") as out:
            out.writelines(f"{t:.2f}\t{late * 1e3:.0f}\t{where}\n" for t, late, where in self.stalls)


def run(
    name: str,
    traffic: tuple,
    targets: str,
    precision: str,
    seconds: float,
    timeline_out: Path | None = None,
    stalls_out: Path | None = None,
) -> list[str]:
    make, calls, peer = traffic
    plain = make()
    with torch.inference_mode():
        for call in calls[: len(calls)]:  # the plain model's first sight of each input
            call(plain)
        plain_s = []
        for call in calls:
            samples = []
            for _ in range(3):
                with Stopwatch() as watch:
                    call(plain)
                samples.append(watch.seconds)
            plain_s.append(statistics.median(samples))
    del plain
    model = make()
    # (seconds since enable when it began, x plain, searching, what went on: seconds of tuning the targets' reports
    # gained during it, on the worker or in the call, and the states before and after it). A call that found a target
    # armed before every target was decided tunes inside itself: a shape family met for the first time.
    timeline: list[tuple[float, float, bool, str]] = []
    with torch.inference_mode(), Stopwatch() as since:
        probe = StallProbe(time.monotonic()) if stalls_out is not None else None
        registration = enable_aitune(model, targets, precision=precision, progress=False)
        after_final = 0
        index = 0
        while (clock() - since.start) < seconds:
            call = calls[index % len(calls)]
            before, states = _tuning_seconds(registration), dict(registration.state_counts)
            decided, ran = registration.all_tuned, registration.worker.status()["running"]
            with Stopwatch() as watch:
                call(model)
            searching = registration.searching > 0 or not registration.all_tuned
            # (when the call began, x plain, whether the search went on): a call that began before the first tuned
            # call is the tuning itself, not a call the search slowed.
            ratio = plain_s[index % len(calls)] / watch.seconds
            ended = registration.worker.status()["running"]
            went_on = (
                f"the worker ran {ran or 'nothing'} at its start, {ended or 'nothing'} at its end; "
                f"tuning {_tuning_seconds(registration) - before:.1f} s meanwhile; "
                f"states {format_counts(states)} -> {format_counts(registration.state_counts)}"
                + ("; a shape family may have tuned in it" if not decided and states.get("armed") else "")
            )
            timeline.append((watch.start - since.start, ratio, searching, went_on))
            index += 1
            if registration.plan_seconds["final_plan_s"] is not None and registration.background is None:
                status = registration.worker.status()
                if not status["pending"]:
                    after_final += 1
            if after_final >= 10:
                break
        registration.wait(timeout=60)
        report = registration.report()
    if probe is not None:  # seconds since enable, ms late, the worker's innermost frames
        probe.write(stalls_out.with_suffix(f".{name}.tsv"))
    plans = registration.plan_seconds
    if timeline_out is not None:  # every call: when it began, x plain, searching, what went on
        with open(timeline_out.with_suffix(f".{name}.tsv"), "w") as out:
            out.writelines("\t".join(map(str, row)) + "\n" for row in timeline)
    fast = next((t for t, ratio, *_ in timeline if ratio >= FAST), None)
    first = plans["first_tuned_s"]
    during = [row for row in timeline if row[2] and first is not None and row[0] > first]
    after = [ratio for _, ratio, searching, *_ in timeline if not searching]
    slowest = sorted(during, key=lambda row: row[1])[:5]
    worst_calls = [f"- at {t:.1f} s: {ratio:.2f}x plain; {went_on}" for t, ratio, _, went_on in slowest]
    timed = [
        f"- {target}: " + "; ".join(f"{c.backend} {c.speedup:.2f}x" for c in signature.candidates if c.speedup)
        for target, module in report.modules.items()
        for signature in module.signatures[:1]
        if signature.shared_from is None and any(c.speedup for c in signature.candidates)
    ]
    hint = "bf16" if precision == "auto" and hardware.cpu_bf16_reason() is None else "f32"
    peer_s = peer(hint)
    model.disable_aitune()
    worst = f"{min(row[1] for row in during):.2f}x" if during else "-"
    steady = f"{min(after):.2f}x / {statistics.median(after):.2f}x" if after else "-"
    lines = [
        f"| {name} | `{targets}`, precision `{precision}` | {_s(plans['first_tuned_s'])} | {_s(plans['final_plan_s'])} "
        f"| {_s(fast)} | {worst} | {steady} | {peer_s:.1f} ({hint}) | {len(timeline)} |"
    ]
    print(lines[0], file=sys.stderr, flush=True)
    print("\n".join(worst_calls), file=sys.stderr, flush=True)
    return [
        *lines,
        "",
        f"The {name} calls slowest against their plain calls while the search went on:",
        "",
        *worst_calls,
        "",
        f"The {name} candidates timed (speed-up over eager; in the search: its ratio to the plan that served, times "
        "that plan's):",
        "",
        *timed,
        "",
        f"The {name} report at the end:",
        "",
        "```",
        str(report),
        "```",
        "",
    ]


def _tuning_seconds(registration: Any) -> float:
    return sum(report.tuning_seconds for report in registration.reports.values())


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="minilm,sd")
    parser.add_argument("--targets", default=None, help="default: the docs' recipe (auto for minilm, blocks for sd)")
    parser.add_argument("--precision", default="auto", choices=("fp32", "auto"))
    parser.add_argument("--seconds", type=float, default=240.0, help="the traffic's longest run")
    parser.add_argument("--out", type=Path, default=RESULTS / "anytime.md")
    parser.add_argument("--timeline", type=Path, default=None, help="also write every call's row: FILE.<workload>.tsv")
    parser.add_argument(
        "--stalls",
        type=Path,
        default=None,
        help="also record the stalls of a thread that needs the "
        "GIL, with what the worker ran: FILE.<workload>.tsv (a probe thread: figures move a little)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, details = [], []
    with tempfile.TemporaryDirectory(prefix="aitune_anytime_") as folder:
        for name in args.workloads.split(","):
            traffic = minilm_traffic() if name == "minilm" else sd_traffic(Path(folder))
            targets = args.targets or ("auto" if name == "minilm" else "blocks")
            lines = run(name, traffic, targets, args.precision, args.seconds, args.timeline, args.stalls)
            rows.append(lines[0])
            details += lines[1:]
    text = "\n".join([
        "# Anytime tuning under traffic",
        "",
        f"`python benchmarks/{Path(__file__).name} --precision {args.precision}` on {cpu_model()} "
        f"({platform.machine()}), 1 thread, torch {torch.__version__}; cold (cache off).",
        "",
        "| workload | recipe | first tuned call, s | final plan, s | first call >= 1.2x plain, s | worst call while "
        "searching, x plain | after: worst / median, x plain | peer convert + compile, s | calls |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *details,
    ])  # fmt: skip
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
