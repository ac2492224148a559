"""Real traffic through a real client: all-MiniLM-L6-v2 (real weights) with sentence-transformers, varied lengths.

    python benchmarks/minilm_traffic.py            # writes benchmarks/results/minilm_traffic.md
    python benchmarks/minilm_traffic.py --quick
    python benchmarks/minilm_traffic.py --targets auto --out benchmarks/results/minilm_traffic_targets_auto.md

One torch thread (ONNX Runtime gets the same). A corpus of 256 sentences of 6-130 tokens; single-sentence queries.

- **Tuning** (a fresh `SentenceTransformer`, `enable_aitune(model, backends=["onnxruntime", "openvino"])` on the
  wrapper as the docs' recipe says; `--backends onnxruntime,openvino,inductor` for the default candidates;
  `--targets auto`: the whole model first, its layers beneath it where it stays eager on a shape family, the whole
  serving the families where it beats them): `encode(corpus[:128], batch_size=32)` twice (records, then tunes at the
  start of the second call), then eight queries of lengths from set A, one by one (the first records the query
  family, the next tunes it); sent again while anything is left armed (`warm_up`; with `--targets auto` the layers
  come after the batches). Tuning
  seconds are the report's; memory is the process's RSS, after `gc` and `malloc_trim`, before enabling, after
  tuning and serving, and after `disable_aitune()`.
- **Throughput**: `encode(corpus, batch_size=32)`, sentences per second.
- **Latency**: the mean time of one `encode(query)` over 32 queries whose token lengths (set B) were never seen
  while tuning: aitune serves them after a one-time check per new length, timed once every one is checked
  (`settle`; with `precision="auto"` the checks run off the caller's thread, a few at a time).
- **The first sight** (issue 32): right after tuning, rounds of a fresh corpus of 64 sentences (batches of 32) and
  16 single queries of lengths no earlier call met, served by the tuned model once (its first sight; the checks of the
  new shapes run off the caller's thread beside it, `precision="auto"`: `hf/gate.py`) between two timed passes of a
  plain model over the same inputs, the checks waited for before the second; the medians of the rounds' ratios to the
  plain passes' mean (`first_sight`), and the median seconds the checks went on. The steady-state rows are timed
  after all of them.
- The peer a CPU user picks: OpenVINO converting the Hugging Face model whole (`openvino.convert_model` with every
  input dimension dynamic, compiled for the CPU with one thread), served in place of the model's forward as
  sentence-transformers' `backend="openvino"` serves it: `OpenVINO f32` (precision hint f32) and, where the CPU computes
  bf16 natively, `OpenVINO bf16` (OpenVINO's own default there). Its one-off cost is the conversion and compile.
- Variants, models in one process, timed in interleaved rounds (rotating order, medians): eager; aitune (fp32);
  with `--precision auto`, aitune with `precision="auto"` too (every reduced precision this CPU computes natively,
  gated end to end on the embeddings' min cosine); `torch.compile(model.forward, dynamic=True)` on the Hugging Face
  model inside (compiled on first use, before timing).
- Quality beside every speed-up: the min cosine of the corpus embeddings against eager's, and the Spearman rank
  correlation of the pair similarities of the first 64 sentences (2016 pairs) against eager's: a ranking kept.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

# Inductor's on-disk caches start empty (before torch is imported: Inductor reads it then), so the cold tuning
# figures pay the compiles a first run pays.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="aitune_traffic_inductor_")

import torch

from aitune_hf import Stopwatch, enable_aitune, hardware
from aitune_hf.backends import forget_exports
from aitune_hf.session import describe_machine
from aitune_hf.testing import minilm_path

atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

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
    for words in range(1, 250):
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


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two 1-d tensors (ranks by argsort; the similarities here have no ties)."""

    def ranks(x: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(x)
        out = torch.empty_like(order, dtype=torch.float64)
        out[order] = torch.arange(len(x), dtype=torch.float64)
        return out

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra @ rb) / (ra.norm() * rb.norm()))


def pair_similarities(embeddings: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of every pair (upper triangle) of the embeddings."""
    normed = torch.nn.functional.normalize(embeddings.double(), dim=1)
    sims = normed @ normed.T
    rows, cols = torch.triu_indices(len(normed), len(normed), offset=1)
    return sims[rows, cols]


def openvino_whole(path: str, precision: str):
    """A SentenceTransformer whose Hugging Face model runs as one OpenVINO model (see the module docstring), and the
    seconds its conversion and compile took."""
    import openvino
    from sentence_transformers import SentenceTransformer
    from transformers.modeling_outputs import BaseModelOutput

    model = SentenceTransformer(path, device="cpu")
    inner = model[0].auto_model
    example = model.tokenize(["a short example sentence", "and another one, a little longer than the first"])
    names = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in example]
    with Stopwatch() as preparing:
        converted = openvino.convert_model(inner, example_input={name: example[name] for name in names})
        converted.reshape({port.get_any_name(): openvino.PartialShape([-1, -1]) for port in converted.inputs})
        config = {
            "INFERENCE_PRECISION_HINT": {"f32": "f32", "bf16": "bf16"}[precision],
            "INFERENCE_NUM_THREADS": torch.get_num_threads(),
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
        }
        compiled = openvino.Core().compile_model(converted, "CPU", config)
    request = compiled.create_infer_request()
    inputs = [port.get_any_name() for port in compiled.inputs]

    def forward(**kwargs):
        feeds = {name: kwargs[name].numpy() for name in inputs if name in kwargs}
        out = request.infer(feeds, share_outputs=False)
        return BaseModelOutput(last_hidden_state=torch.from_numpy(out[compiled.output(0)]))

    inner.forward = forward
    return model, preparing.seconds


def warm_up(model, registration, texts: list[str], queries: list[str]) -> None:
    """The tuning traffic: `encode(texts[:128], batch_size=32)` twice (records, then tunes at the start of the second
    call), then the queries one by one (the first records the query family, the next tunes it). With
    `targets="auto"` the layers of a model that stayed eager whole on the batches are added after them, so the mix is
    sent again until nothing is left armed (twice more at most): each tuning the timed rounds would otherwise pay."""
    for attempt in range(3):
        if attempt and all(t.decided and not t.samples for t in registration.targets.values()):
            break
        for _ in range(2 if attempt == 0 else 1):
            model.encode(texts[:128], batch_size=32)
        for query in queries:
            model.encode(query)


def first_sight(model, registration, plain, rounds: int) -> tuple[float, float, float]:
    """Right after tuning, `rounds` rounds of first sights: each round a fresh corpus of 64 sentences (batches of 32)
    and 16 single queries of token lengths no earlier call met (`first_sight_lengths`). In a round the plain model
    serves the inputs once (untimed: its own first sight), then once timed; the tuned model serves them once (its
    first sight, with the checks of its new shapes running off the caller's thread beside it: `hf/gate.py`); the
    checks are waited for (`Registration.wait`, untimed: they never run beside a plain call), and the plain model
    serves them once more, timed. The tuned pass is compared with the mean of the two plain passes around it: on a
    shared host the same plain pass drifts by 20-30% within seconds (0.6-0.8 s for 16 queries; per-thread CPU time
    showed the checks taking 0.02-0.09 s of the other core during a 0.5 s pass, the rest was the host), and a
    sandwich cancels a drift that is linear over the round. Returns the medians of the rounds' ratios (batch 32,
    single queries) and the median seconds the checks went on after a tuned pass."""
    batches, singles, checks = [], [], []
    for r, lengths in enumerate(first_sight_lengths(rounds)):
        texts = corpus(64, 4, 120, seed=1000 + r)
        queries = queries_with_lengths(model, lengths)

        def passes(m, texts=texts, queries=queries):
            with Stopwatch() as batch:
                m.encode(texts, batch_size=32)
            with Stopwatch() as single:
                for query in queries:
                    m.encode(query)
            return batch.seconds, single.seconds

        passes(plain)
        before = passes(plain)
        tuned_batch, tuned_single = passes(model)
        with Stopwatch() as after:
            registration.wait()
        behind = passes(plain)
        batches.append(tuned_batch / statistics.mean([before[0], behind[0]]))
        singles.append(tuned_single / statistics.mean([before[1], behind[1]]))
        checks.append(after.seconds)
        print(
            f"first sight, round {r}: batch 32 {batches[-1]:.2f}x, single queries {singles[-1]:.2f}x of a plain "
            f"call, checks {checks[-1]:.1f} s after",
            file=sys.stderr,
            flush=True,
        )
    return statistics.median(batches), statistics.median(singles), statistics.median(checks)


def settle(model, registration, queries: list[str]) -> int:
    """Serve `queries` one by one until a pass runs nothing eager for want of a check, and return the passes it took
    (at most 5). With `precision="auto"` a new length runs eager at its first sight and is checked off the caller's
    thread, with at most `MAX_CHECKS` checks queued (`core/background.py`): a burst of 32 new lengths leaves most of
    them to a later sight. Without this the first timed rounds would serve some queries eager while checks ran beside
    them, which is the first sight (its own row), not the steady state."""

    def eager_calls() -> int:  # served eager, the replays of checks included: a pass that checks something adds some
        return sum(target.calls_served.get("eager", 0) for target in registration.targets.values())

    for passes in range(1, 6):
        registration.wait()
        before = eager_calls()
        for query in queries:
            model.encode(query)
        registration.wait()
        if eager_calls() == before:
            return passes
    return passes


def first_sight_lengths(rounds: int) -> list[list[int]]:
    """16 token lengths per round, none met by tuning (set A is 8-36) or by another round: odd lengths from 41 up,
    spread over the rounds (round r takes every `rounds`-th one from the r-th)."""
    pool = list(range(41, 41 + 2 * 16 * rounds, 2))
    return [pool[r::rounds] for r in range(rounds)]


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
        "--backends",
        default="onnxruntime,openvino",
        help="aitune's candidates, comma-separated (docs' CPU recipe: onnxruntime,openvino)",
    )
    parser.add_argument(
        "--targets",
        choices=("blocks", "auto"),
        default="blocks",
        help="aitune's targets: the encoder layers, or 'auto' (the whole model first, its layers where it stays eager)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "auto"),
        default="fp32",
        help="auto: also an aitune variant with precision='auto' (and the inductor candidate for bf16)",
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
        eager = SentenceTransformer(path, device="cpu")  # the plain model: the first sights' peer, and the reference
        lengths = sorted({len(ids) for ids in tuned.tokenizer(texts)["input_ids"]})
        set_a = [n for n in range(8, 40, 4)]
        set_b = [n for n in range(41, 105, 2)]  # 32 lengths, none in set A
        queries_a, queries_b = queries_with_lengths(tuned, set_a), queries_with_lengths(tuned, set_b)
        # What any ONNX-exporting tool pays once per process: importing the exporter and a first export.
        imported = rss_mb()
        warm_up_export()
        before = rss_mb()
        with Stopwatch() as prepare:
            registration = enable_aitune(tuned, args.targets, backends=args.backends.split(","))
            warm_up(tuned, registration, texts, queries_a)
        prepare_s = prepare.seconds
        tuning_s = registration.report().tuning_seconds
        first = {"aitune": first_sight(tuned, registration, eager, rounds)}
        after = rss_mb()

        variants = {"aitune": tuned}
        tunings = {"aitune": (tuning_s, prepare_s)}
        registrations = {"aitune": registration}
        if args.precision == "auto":  # reduced precision, gated end to end on the embeddings
            reduced = SentenceTransformer(path, device="cpu")
            # Its tuning is timed as cold as the fp32 one: without the exports the fp32 tuning left in this process
            # for reuse (docs/backends.md, "One export per module state per process").
            forget_exports()
            backends = sorted({*args.backends.split(","), "inductor"})  # the bf16 candidate is a compile
            with Stopwatch() as prepare_auto:
                registrations["aitune auto"] = enable_aitune(reduced, args.targets, backends=backends, precision="auto")
                warm_up(reduced, registrations["aitune auto"], texts, queries_a)
            tunings["aitune auto"] = (registrations["aitune auto"].report().tuning_seconds, prepare_auto.seconds)
            first["aitune auto"] = first_sight(reduced, registrations["aitune auto"], eager, rounds)
            variants["aitune auto"] = reduced

        peers, peer_seconds = {}, {}
        for precision in ("f32", "bf16") if hardware.cpu_bf16_reason() is None else ("f32",):
            peers[f"OpenVINO {precision}"], peer_seconds[f"OpenVINO {precision}"] = openvino_whole(path, precision)
        compiled = SentenceTransformer(path, device="cpu")
        inner = compiled[0].auto_model
        inner.forward = torch.compile(inner.forward, dynamic=True)
        with Stopwatch() as compiling:
            compiled.encode(texts, batch_size=32)
            for query in queries_a + queries_b:
                compiled.encode(query)
        compile_s = compiling.seconds

        reference = eager.encode(texts, batch_size=32, convert_to_tensor=True)
        reference_pairs = pair_similarities(reference[:64])
        reference_queries = torch.stack([eager.encode(q, convert_to_tensor=True) for q in queries_b])
        models = {"eager": eager, **variants, **peers, "torch.compile": compiled}
        quality = {}
        for name, model in models.items():
            embeddings = model.encode(texts, batch_size=32, convert_to_tensor=True)
            cosine = float(torch.nn.functional.cosine_similarity(embeddings, reference).min())
            singles = torch.stack([model.encode(q, convert_to_tensor=True) for q in queries_b])
            query_cosine = float(torch.nn.functional.cosine_similarity(singles, reference_queries).min())
            quality[name] = (cosine, spearman(pair_similarities(embeddings[:64]), reference_pairs), query_cosine)
        settled = {name: settle(variants[name], reg, queries_b) for name, reg in registrations.items()}
        throughput = interleaved({n: (lambda m=m: m.encode(texts, batch_size=32)) for n, m in models.items()}, rounds)
        latency = interleaved({n: (lambda m=m: [m.encode(q) for q in queries_b]) for n, m in models.items()}, rounds)
        served: dict[str, dict[str, int]] = {}
        for name, reg in registrations.items():
            for target in reg.targets.values():
                for backend, calls in target.calls_served.items():
                    served.setdefault(name, {})[backend] = served.get(name, {}).get(backend, 0) + calls
        reports = {name: str(reg.report()) for name, reg in registrations.items()}
        for model in variants.values():
            model.disable_aitune()
        del registration, registrations
        released = rss_mb()

    sps = {name: len(texts) / seconds for name, seconds in throughput.items()}
    ms = {name: seconds / len(queries_b) * 1e3 for name, seconds in latency.items()}
    names = list(models)
    header = " | ".join("torch.compile(dynamic=True)" if n == "torch.compile" else n for n in names)

    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(n) for n in names) + " |"

    def one_off(name: str) -> str:
        if name == "eager":
            return "-"
        if name == "torch.compile":
            return f"{compile_s:.1f} compiling (first calls)"
        if name in peer_seconds:
            return f"{peer_seconds[name]:.1f} converting and compiling"
        tuning, prepare_all = tunings[name]
        return f"{tuning:.1f} tuning ({prepare_all:.1f} s for the tuning calls in all)"

    lines = [
        "# sentence-transformers: all-MiniLM-L6-v2, real traffic",
        "",
        f"`python benchmarks/{Path(__file__).name}{' --quick' if args.quick else ''}"
        f"{' --precision auto' if args.precision == 'auto' else ''}"
        f"{' --targets auto' if args.targets == 'auto' else ''}` on {describe_machine()} "
        f"({platform.machine()}), 1 thread, torch {torch.__version__}, Python {sys.version.split()[0]}; "
        f"{rounds} interleaved rounds, medians; Inductor's on-disk cache empty at the start (cold compiles).",
        "",
        f"Corpus: {len(texts)} sentences, {lengths[0]}-{lengths[-1]} tokens ({len(lengths)} distinct lengths). "
        f"Queries timed: {len(queries_b)} single sentences of {set_b[0]}-{set_b[-1]} tokens, lengths never seen "
        f"while tuning (tuning saw the corpus' first 128 sentences and queries of {set_a[0]}-{set_a[-1]} tokens), "
        "timed once every one of them is checked (`settle`: passes of them until none runs eager, "
        + ", ".join(f"{name} {count}" for name, count in settled.items())
        + ").",
        "",
        f"aitune: `enable_aitune(model, {args.targets!r}, backends={args.backends.split(',')})` on the "
        "`SentenceTransformer`"
        + ('; aitune auto: the same with `precision="auto"` and the inductor candidate.' if len(variants) > 1 else "."),
        "",
        f"| | {header} |",
        "|---|" + "---|" * len(names),
        row(
            "batch-32 throughput, sentences/s",
            lambda n: f"{sps[n]:.1f}" + ("" if n == "eager" else f" ({sps[n] / sps['eager']:.2f}x)"),
        ),
        row(
            "batch-1 latency, ms (unseen lengths)",
            lambda n: f"{ms[n]:.2f}" + ("" if n == "eager" else f" ({ms['eager'] / ms[n]:.2f}x)"),
        ),
        row("one-off cost, s", one_off),
        row(
            "first sight after tuning, unseen lengths: batch 32 / batch 1, x a plain call of the same inputs (medians "
            f"of {rounds} rounds, `first_sight`; checks after, s)",
            lambda n: "-" if n not in first else (f"{first[n][0]:.2f}x / {first[n][1]:.2f}x ({first[n][2]:.1f})"),
        ),
        row("min cosine vs eager (corpus)", lambda n: f"{quality[n][0]:.6f}"),
        row("pair-similarity ranking vs eager (Spearman, 2016 pairs)", lambda n: f"{quality[n][1]:.6f}"),
        row("min cosine vs eager (unseen single queries)", lambda n: f"{quality[n][2]:.6f}"),
        "",
        f"Memory (RSS after gc and malloc_trim): {imported:.0f} MB with the model loaded, {before:.0f} MB once the "
        f"ONNX exporter is imported and has run once on a Linear (+{before - imported:.0f} MB, paid once per "
        f"process by any ONNX export), {after:.0f} MB after tuning and serving the fp32 variant (+{after - before:.0f} "
        "MB: sessions, and ONNX Runtime's shared arena at its largest block call), "
        f"{released:.0f} MB after `disable_aitune()` and the other variants' timing (the eager and compiled models "
        "stay loaded).",
        "",
        f"Calls served per backend over the run (all layers): {served}.",
        "",
    ]
    for name, text in reports.items():
        lines += [f"The {name} report after tuning and the unseen queries:", "", "```", text, "```", ""]
    text = "\n".join(lines)
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
