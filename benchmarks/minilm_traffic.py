"""Real traffic through a real client: all-MiniLM-L6-v2 (real weights) with sentence-transformers, varied lengths.

    python benchmarks/minilm_traffic.py            # writes benchmarks/results/minilm_traffic.md
    python benchmarks/minilm_traffic.py --quick

One torch thread (ONNX Runtime gets the same). A corpus of 256 sentences of 6-130 tokens; single-sentence queries.

- **Tuning** (a fresh `SentenceTransformer`, `enable_aitune(model, backends=["onnxruntime"])` on the wrapper as
  the docs' recipe says; `--backends onnxruntime,inductor` for the default candidates):
  `encode(corpus[:128], batch_size=32)` twice (records, then tunes at the start of the second call), then eight
  queries of lengths from set A, one by one (the first records the query family, the next tunes it). Tuning
  seconds are the report's; memory is the process's RSS, after `gc` and `malloc_trim`, before enabling, after
  tuning and serving, and after `disable_aitune()`.
- **Throughput**: `encode(corpus, batch_size=32)`, sentences per second.
- **Latency**: the mean time of one `encode(query)` over 32 queries whose token lengths (set B) were never seen
  while tuning: aitune serves them after a one-time check per new length (the first pass, not timed).
- Variants, three models in one process, timed in interleaved rounds (rotating order, medians): eager; aitune;
  `torch.compile(model.forward, dynamic=True)` on the Hugging Face model inside (compiled on first use, before
  timing).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
from machine import cpu_model  # benchmarks/ is on sys.path: the scripts run as files

from aitune_hf import enable_aitune
from aitune_hf.core.timing import Stopwatch
from aitune_hf.testing import minilm_path

# Tuning is measured from scratch: aitune_hf's persistent cache (on by default) stays off unless AITUNE_HF_CACHE
# is set (a folder, to measure a warm start) or a run passes its own cache_dir.
os.environ.setdefault("AITUNE_HF_CACHE", "off")

RESULTS = Path(__file__).resolve().parent / "results"
_TEXT = (
    "the quick brown fox jumps over a lazy dog while seven small birds sing in tall green trees near an old stone "
    "bridge where children play games and tell long stories about ships sailing across wide blue seas"
)
WORDS = tuple(_TEXT.split())


def sentence(words: int, offset: int) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))


def corpus(count: int, low: int, high: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [sentence(int(n), i) for i, n in enumerate(torch.randint(low, high, (count,), generator=g))]


def queries_with_lengths(model, lengths: list[int]) -> list[str]:
    """One sentence per token length in `lengths` (the tokenizer's count, special tokens included)."""
    found: dict[int, str] = {}
    for words in range(1, 140):
        text = sentence(words, 3)
        n = len(model.tokenizer(text)["input_ids"])
        if n in lengths and n not in found:
            found[n] = text
    return [found[n] for n in lengths if n in found]


def rss_mb() -> float:
    gc.collect()
    with contextlib.suppress(OSError):  # glibc: give freed heap back, so that RSS shows what is held
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def warm_up_export() -> None:
    """Imports the ONNX exporter and runs it once on a Linear, so that RSS deltas show what tuning holds."""
    import io

    torch.onnx.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),), io.BytesIO(), dynamo=True, verbose=False)


def interleaved(fns: dict[str, callable], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            with Stopwatch() as watch:
                fns[name]()
            times[name].append(watch.seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--out", type=Path, default=RESULTS / "minilm_traffic.md")
    parser.add_argument(
        "--backends", default="onnxruntime", help="aitune's candidates, comma-separated (docs' CPU recipe: onnxruntime)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 3 if args.quick else 7
    from sentence_transformers import SentenceTransformer

    path = str(minilm_path())
    texts = corpus(256, 4, 120, seed=0)
    with torch.inference_mode():
        # aitune: tuning cost and memory first, in a process that has not compiled anything yet.
        tuned = SentenceTransformer(path, device="cpu")
        lengths = sorted({len(ids) for ids in tuned.tokenizer(texts)["input_ids"]})
        set_a = [n for n in range(8, 40, 4)]
        set_b = [n for n in range(41, 105, 2)]  # 32 lengths, none in set A
        queries_a, queries_b = queries_with_lengths(tuned, set_a), queries_with_lengths(tuned, set_b)
        # What any ONNX-exporting tool pays once per process: importing the exporter and a first export.
        imported = rss_mb()
        warm_up_export()
        before = rss_mb()
        with Stopwatch() as prepare:
            registration = enable_aitune(tuned, backends=args.backends.split(","))
            tuned.encode(texts[:128], batch_size=32)
            tuned.encode(texts[:128], batch_size=32)
            for query in queries_a:
                tuned.encode(query)
        prepare_s = prepare.seconds
        tuning_s = registration.report().tuning_seconds
        for query in queries_b:  # each new length is checked once against eager, then served
            tuned.encode(query)
        tuned.encode(texts, batch_size=32)
        after = rss_mb()
        report = str(registration.report())

        eager = SentenceTransformer(path, device="cpu")
        compiled = SentenceTransformer(path, device="cpu")
        inner = compiled[0].auto_model
        inner.forward = torch.compile(inner.forward, dynamic=True)
        with Stopwatch() as compiling:
            compiled.encode(texts, batch_size=32)
            for query in queries_a + queries_b:
                compiled.encode(query)
        compile_s = compiling.seconds

        reference = eager.encode(texts, batch_size=32, convert_to_tensor=True)
        cosine = {
            name: float(
                torch.nn.functional.cosine_similarity(
                    model.encode(texts, batch_size=32, convert_to_tensor=True), reference
                ).min()
            )
            for name, model in (("aitune", tuned), ("torch.compile", compiled))
        }
        models = {"eager": eager, "aitune": tuned, "torch.compile": compiled}
        throughput = interleaved({n: (lambda m=m: m.encode(texts, batch_size=32)) for n, m in models.items()}, rounds)
        latency = interleaved({n: (lambda m=m: [m.encode(q) for q in queries_b]) for n, m in models.items()}, rounds)
        served = {}
        for target in registration.targets.values():
            for backend, calls in target.calls_served.items():
                served[backend] = served.get(backend, 0) + calls
        tuned.disable_aitune()
        del registration
        released = rss_mb()

    sps = {name: len(texts) / seconds for name, seconds in throughput.items()}
    ms = {name: seconds / len(queries_b) * 1e3 for name, seconds in latency.items()}
    lines = [
        "# sentence-transformers: all-MiniLM-L6-v2, real traffic",
        "",
        f"`python benchmarks/{Path(__file__).name}{' --quick' if args.quick else ''}` on {cpu_model()} "
        f"({platform.machine()}), 1 thread, torch {torch.__version__}, Python {sys.version.split()[0]}; "
        f"{rounds} interleaved rounds, medians.",
        "",
        f"Corpus: {len(texts)} sentences, {lengths[0]}-{lengths[-1]} tokens ({len(lengths)} distinct lengths). "
        f"Queries timed: {len(queries_b)} single sentences of {set_b[0]}-{set_b[-1]} tokens, lengths never seen "
        f"while tuning (tuning saw the corpus' first 128 sentences and queries of {set_a[0]}-{set_a[-1]} tokens).",
        "",
        f"aitune: `enable_aitune(model, backends={args.backends.split(',')})` on the `SentenceTransformer`.",
        "",
        "| | eager | aitune | torch.compile(dynamic=True) |",
        "|---|---|---|---|",
        f"| batch-32 throughput, sentences/s | {sps['eager']:.1f} | {sps['aitune']:.1f} "
        f"({sps['aitune'] / sps['eager']:.2f}x) | {sps['torch.compile']:.1f} "
        f"({sps['torch.compile'] / sps['eager']:.2f}x) |",
        f"| batch-1 latency, ms (unseen lengths) | {ms['eager']:.2f} | {ms['aitune']:.2f} "
        f"({ms['eager'] / ms['aitune']:.2f}x) | {ms['torch.compile']:.2f} "
        f"({ms['eager'] / ms['torch.compile']:.2f}x) |",
        f"| one-off cost, s | - | {tuning_s:.1f} tuning ({prepare_s:.1f} s for the tuning calls in all) | "
        f"{compile_s:.1f} compiling (first calls) |",
        f"| min cosine vs eager | 1 | {cosine['aitune']:.6f} | {cosine['torch.compile']:.6f} |",
        "",
        f"Memory (RSS after gc and malloc_trim): {imported:.0f} MB with the model loaded, {before:.0f} MB once the "
        f"ONNX exporter is imported and has run once on a Linear (+{before - imported:.0f} MB, paid once per "
        f"process by any ONNX export), {after:.0f} MB after tuning and serving (+{after - before:.0f} MB: sessions, "
        "and ONNX Runtime's shared arena at its largest block call), "
        f"{released:.0f} MB after `disable_aitune()` and the other variants' timing (the eager and compiled models "
        "stay loaded).",
        "",
        f"Calls served per backend over the run (all layers): {served}.",
        "",
        "The aitune report after tuning and the unseen queries:",
        "",
        "```",
        report,
        "```",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
