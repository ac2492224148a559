"""Greedy generation tokens/s (issue 9, item 2; issue 47): a small Llama-like, a small Qwen3-like and a small BART-like
(encoder-decoder) model, eager vs torch.compile as Transformers documents it vs OpenVINO through optimum-intel vs
aitune_hf.

    python benchmarks/generation.py --models llama qwen3 bart --rounds 5 --optimum-python ~/ovenv/bin/python
    python benchmarks/generation.py --quick          # smoke run: llama, 16 new tokens, 2 rounds

optimum-intel installs in a venv of its own (it pins Transformers below this project's, and its default torch is a
CUDA build): `python -m venv ~/ovenv && ~/ovenv/bin/pip install -c constraints.txt "optimum-intel[openvino]"
&& ~/ovenv/bin/pip uninstall -y torchvision` (PyPI's torchvision, which it pulls, fails beside the pinned CPU torch:
"operator torchvision::nms does not exist", and Transformers then cannot import `AutoProcessor`), then pass its Python
as `--optimum-python` (or `AITUNE_OPTIMUM_PYTHON`); without it the openvino_* rows say "not run". Its workers import
this checkout's aitune_hf for the timer only. To time every row with the peer's own Transformers (its `generate()`
loop is not ours), run the whole benchmark in that venv: `~/ovenv/bin/pip install -c constraints.txt platformdirs onnx
onnxscript accelerate`, then `PYTHONPATH=$PWD ~/ovenv/bin/python benchmarks/generation.py ... --optimum-python
~/ovenv/bin/python` (benchmarks/results/generation_icelake.md, "The same Transformers as the peer").

Models: built from `LlamaConfig` / `Qwen3Config` / `BartConfig` with random weights (seed 0; hidden 256, 4 layers
(BART: 4 encoder and 4 decoder layers), 4 heads, 2 KV heads (BART: 4), intermediate 512, vocabulary 1024,
`initializer_range` 0.1 so that greedy tokens vary and the top-2 logit gaps stay far above float32 noise), written
with `save_pretrained` and loaded with the real `AutoModelForCausalLM` / `AutoModelForSeq2SeqLM.from_pretrained`
(`AITuneModel.from_pretrained(..., auto_class=...)` for aitune_hf). The default run: llama and qwen3.
Call: batch 1, a 16-token prompt, `generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`, N = 64.
`--batch B --padding P`: B prompts, every one after the first left-padded by P pad ids (their attention mask 0 there),
as a tokenizer with `padding_side="left"` gives a batch of prompts of different lengths; decode tok/s then counts
steps (each makes a token for every row), and every row's tokens are compared.

Variants (each in its own worker process, with its own empty Inductor cache and Dynamo state, so that no
variant's compiles or recompile counts leak into another's; the decoder layers of a model share one code
object, and Dynamo's recompile limit is per code object):

- eager: default dynamic cache (the reference tokens);
- eager_static: `generation_config.cache_implementation = "static"`;
- compile_forward: Transformers' documented recipe: static cache, then
  `model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`;
- hf_autocompile: Transformers' own compile inside `generate()` (static cache; it compiles `__call__` for the
  decode steps only, prefill stays eager). `_valid_auto_compile_criteria` allows it on cuda/xpu/neuron/tpu
  only, so it is forced here on CPU through the private `CompileConfig._compile_all_devices = True`
  (`CompileConfig()` defaults otherwise: inductor, "reduce-overhead", fullgraph False). Not a documented CPU
  path: reported beside the documented baselines, not among them;
- aitune_blocks: static cache, `enable_aitune("blocks", backends=["inductor", "onnxruntime"])`;
- aitune_components: static cache, `enable_aitune("components", backends=["inductor"])` (the whole model);
- aitune_openvino_decoder: dynamic cache, `enable_aitune("components", backends=["inductor", "openvino_decoder"])`:
  the whole model by Inductor or by OpenVINO's stateful form (the KV cache kept in the engine), the faster per step
  kind;
- aitune_openvino_decoder_bf16: dynamic cache, `enable_aitune("components", backends=["openvino_decoder"],
  precision=["fp32", "bf16"])`: OpenVINO's stateful form in f32 and bf16 (the bf16 engine first run in the build
  process), the faster per step kind; bf16 serves only after the end-to-end gate (every token eager's on the call it
  replays, the default budget); compared with openvino_bf16, its gate's figure beside it;
- aitune_components_dynamic: the same as aitune_components with generate()'s default dynamic cache (no 4D mask
  built per step by generate(); the growing cache makes Dynamo's graph symbolic in its length);
- aitune_auto: static cache, `enable_aitune("auto")` with the default backends (a generative model is tried
  whole with Inductor as well as ONNX Runtime).
- eager_optimum_venv: eager in optimum-intel's venv, its own (older) Transformers: the generate() loop the
  openvino rows run in, so that a difference of Transformers versions is not read as the engine's;
- openvino_f32 / openvino_bf16: `OVModelForCausalLM` (BART: `OVModelForSeq2SeqLM`)`.from_pretrained(folder,
  export=True)`, optimum-intel's stateful model (the KV cache kept inside the engine, reset per generate()), with
  `INFERENCE_PRECISION_HINT` f32 / bf16 and OpenVINO's threads as torch's. One-off: the export and compile plus the
  first generate() call. openvino_f32 is among the documented baselines (issue 47's target); openvino_bf16 is
  reduced precision and stands beside them. A worker that dies (an engine's SIGFPE) is a row that says so.

Static-cache variants set `generation_config.max_cache_len` = prompt + N, so that `max_new_tokens=1` calls reuse
the same cache shape as N-token calls (no new shapes, no recompiles). Each worker loads its model, times 3
eager calls of its own copy, applies its variant, then warms up: compiled variants make two N-token calls
(the second settles recompiles), aitune_hf variants call `generate` until `aitune.all_tuned` (at most 6
calls) and once more; then one 1-token call. One-off seconds = that warm-up's wall time less the eager time of
the same calls. Dynamo's counters (graphs, graph breaks, recompile-limit hits) are read after the warm-up and
again after timing (any growth during timing is reported). For aitune_hf, which backend served the blocks'
calls in the decode steps is counted from `calls_served` (an N-token call less a 1-token call).

Timing: after warm-up every worker pins itself to one core (`--cpu`) and runs 1 torch thread (`--threads`).
Workers are driven one at a time from this process: each round runs every variant once (order rotating), and
a variant's turn is a 1-token call (prefill) then an N-token call, each timed with `aitune_hf.Stopwatch`
(CPU only: nothing to synchronise). Per round: decode tokens/s = (N - 1) / (t_N - t_1), end-to-end tokens/s = N / t_N.
Reported values are medians over rounds; "vs best" is the median over rounds of aitune_hf's decode tokens/s
over the best documented baseline's in the same round (± interquartile range). Every N-token call's tokens are
compared with the eager reference (`torch.equal`).

Results: benchmarks/results/generation.md (or --out).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from aitune_hf import Stopwatch  # the project's one timer (imports torch, none of Hugging Face)

# Tuning is measured from scratch: aitune_hf's persistent cache (on by default) stays off unless AITUNE_HF_CACHE
# is set (a folder, to measure a warm start) or a run passes its own cache_dir.
os.environ.setdefault("AITUNE_HF_CACHE", "off")

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE_MARGIN = 0.97  # as benchmarks/pipelines.py: "matches" = no slower than the best baseline within 3%
PROMPT_TOKENS = 16
WARMUP_LIMIT = 6  # generate calls allowed until aitune.all_tuned

#: the architecture shared by both models; per model: config class and its own extra fields
COMMON = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,  # default 0.02 gives near-ties between top logits and a few repeated tokens
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
#: the same sizes in an encoder-decoder's own field names (BART: as many encoder as decoder layers, no grouped KV heads)
SEQ2SEQ = {
    "d_model": COMMON["hidden_size"],
    "encoder_attention_heads": COMMON["num_attention_heads"],
    "decoder_attention_heads": COMMON["num_attention_heads"],
    "encoder_ffn_dim": COMMON["intermediate_size"],
    "decoder_ffn_dim": COMMON["intermediate_size"],
    "init_std": COMMON["initializer_range"],
    "decoder_start_token_id": COMMON["bos_token_id"],
    "forced_eos_token_id": None,
    **{k: COMMON[k] for k in ("vocab_size", "max_position_embeddings", "pad_token_id", "eos_token_id", "bos_token_id")},
}
#: per model: config class, its fields (the layer count is added), auto class, optimum-intel's class
MODELS: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "llama": ("LlamaConfig", {**COMMON}, "AutoModelForCausalLM", "OVModelForCausalLM"),
    # Qwen3Config defaults head_dim to 128
    "qwen3": ("Qwen3Config", {**COMMON, "head_dim": 64}, "AutoModelForCausalLM", "OVModelForCausalLM"),
    "bart": ("BartConfig", SEQ2SEQ, "AutoModelForSeq2SeqLM", "OVModelForSeq2SeqLM"),
}
DEFAULT_MODELS = ("llama", "qwen3")


#: --size: "tiny" is the sizes above; "medium" a model whose decode step is engine time more than Python (about 0.3 B
#: parameters with 8 layers): what a generate() loop's own overhead per step weighs at a size users serve.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "medium": {
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 2816,
        "vocab_size": 32000,
    },
}
_SEQ2SEQ_NAMES = {
    "hidden_size": ("d_model",),
    "num_attention_heads": ("encoder_attention_heads", "decoder_attention_heads"),
    "intermediate_size": ("encoder_ffn_dim", "decoder_ffn_dim"),
    "vocab_size": ("vocab_size",),
}


def _sized(kind: str, fields: dict[str, Any], size: str) -> dict[str, Any]:
    """`fields` with `size`'s overrides, in the model's own field names."""
    changes = SIZES[size]
    if kind != "bart":
        return {**fields, **changes}
    return {**fields, **{name: v for k, v in changes.items() for name in _SEQ2SEQ_NAMES.get(k, ())}}


def _layers(kind: str, layers: int) -> dict[str, int]:
    return {"encoder_layers": layers, "decoder_layers": layers} if kind == "bart" else {"num_hidden_layers": layers}


@dataclass(frozen=True)
class Variant:
    name: str
    static: bool  # static cache
    documented_baseline: bool  # one of the baselines that the target names
    describe: str
    precision: str = "fp32"  # what it computes in: a reduced-precision row is compared with its own kind
    optimum: bool = False  # runs under optimum-intel's Python (--optimum-python), not this one


#: OpenVINO's own generation runtime: optimum-intel's stateful model (the KV cache kept as engine state, reset per
#: generate()), exported from the saved folder and compiled with this CPU-precision hint.
_OPTIMUM = "optimum-intel {cls}.from_pretrained(folder, export=True), stateful, INFERENCE_PRECISION_HINT={hint}"


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("eager", False, True, "eager, dynamic cache (reference tokens)"),
        Variant("eager_static", True, True, "eager, static cache"),
        Variant(
            "compile_forward",
            True,
            True,
            'static cache + model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)',
        ),
        Variant(
            "hf_autocompile",
            True,
            False,
            "static cache + generate()'s own compile of the decode steps, forced on CPU "
            "(private CompileConfig._compile_all_devices)",
        ),
        Variant("aitune_blocks", True, False, 'static cache + enable_aitune("blocks", inductor + onnxruntime)'),
        Variant("aitune_components", True, False, 'static cache + enable_aitune("components", inductor)'),
        Variant("aitune_auto", True, False, 'static cache + enable_aitune("auto"), default backends'),
        Variant(
            "aitune_openvino_decoder",
            False,
            False,
            'dynamic cache + enable_aitune("components", backends=["inductor", "openvino_decoder"])',
        ),
        Variant(
            "aitune_openvino_decoder_bf16",
            False,
            False,
            'dynamic cache + enable_aitune("components", backends=["openvino_decoder"], precision=["fp32", "bf16"]) '
            "(the default tokens budget: every token eager's on the call the gate replays)",
            precision="bf16",
        ),
        Variant(
            "aitune_components_dynamic",
            False,
            False,
            'dynamic cache (generate()\'s default) + enable_aitune("components", inductor)',
        ),
        Variant(
            "eager_optimum_venv",
            False,
            False,
            "eager, dynamic cache, in optimum-intel's venv (its own Transformers: the generate() loop of the openvino "
            "rows)",
            optimum=True,
        ),
        Variant("openvino_f32", False, True, _OPTIMUM.format(cls="OVModelFor...", hint="f32"), optimum=True),
        Variant(
            "openvino_bf16",
            False,
            False,
            _OPTIMUM.format(cls="OVModelFor...", hint="bf16"),
            precision="bf16",
            optimum=True,
        ),
    )
}


# -- models (parent) --------------------------------------------------------------------------------------------


def build_model(kind: str, folder: Path, layers: int, size: str = "tiny") -> Path:
    """A random-weight causal LM of `kind` written to `folder` with a GenerationConfig for greedy decoding."""
    import torch
    import transformers
    from transformers import GenerationConfig

    config_class, fields, auto_class, _ = MODELS[kind]
    config = getattr(transformers, config_class)(**_layers(kind, layers), **_sized(kind, fields, size))
    torch.manual_seed(0)
    model = getattr(transformers, auto_class).from_config(config).eval()
    ids = {k: COMMON[k] for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    if kind == "bart":
        ids["decoder_start_token_id"] = COMMON["bos_token_id"]
    model.generation_config = GenerationConfig(**ids, do_sample=False)  # as aitune_hf.testing.build_lm
    model.save_pretrained(str(folder))
    return folder


def prompt_ids(batch: int = 1, padding: int = 0) -> tuple[Any, Any]:
    """The prompts (`batch` rows of `PROMPT_TOKENS` ids, every row after the first left-padded by `padding` pad ids)
    and their attention mask."""
    import torch

    ids = torch.randint(3, COMMON["vocab_size"], (batch, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    ids[1:, :padding] = COMMON["pad_token_id"]
    mask = ids.new_ones(ids.shape)
    mask[1:, :padding] = 0
    return ids, mask


# -- worker (one process per variant) ---------------------------------------------------------------------------


def _dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    limit_hits = sum(n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason.lower())
    return {
        "frames": int(counters["frames"]["total"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "limit_hits": int(limit_hits),
    }


def _served(model: Any) -> Counter[str]:
    total: Counter[str] = Counter()
    for target in model.aitune.targets.values():
        total.update(target.calls_served)
    return total


def _kv_cache_precision(model: Any) -> str | None:
    """The element type OpenVINO keeps a stateful model's KV cache in (its `KV_CACHE_PRECISION`, read from the compiled
    decoder), or None where it cannot be read."""
    for owner in (model, getattr(model, "decoder", None)):
        request = getattr(owner, "request", None)
        if request is None:
            continue
        try:
            kept = request.get_compiled_model().get_property("KV_CACHE_PRECISION")
        except Exception:  # an OpenVINO without the property, or a request of another kind
            return None
        return kept.to_string() if hasattr(kept, "to_string") else str(kept)
    return None


class Worker:
    """One variant's model: prepared once, then one timed (1-token, N-token) pair per round."""

    def __init__(
        self, variant: Variant, folder: Path, new_tokens: int, kind: str, threads: int, batch: int, padding: int
    ) -> None:
        self.variant = variant
        self.folder = folder
        self.new_tokens = new_tokens
        self.kind = kind
        self.threads = threads
        self.ids, self.mask = prompt_ids(batch, padding)

    def generate(self, n: int) -> Any:
        return self.model.generate(
            self.ids, attention_mask=self.mask, do_sample=False, max_new_tokens=n, min_new_tokens=n
        )

    def timed(self, n: int) -> tuple[float, Any]:
        with Stopwatch() as watch:
            out = self.generate(n)
        return watch.seconds, out

    def prepare(self) -> dict[str, Any]:
        import torch
        import transformers

        name, n = self.variant.name, self.new_tokens
        _, _, auto_class, optimum_class = MODELS[self.kind]
        info: dict[str, Any] = {"variant": name}
        if name.startswith("openvino"):
            return self.prepare_optimum(optimum_class, info)
        if name.startswith("aitune"):
            from aitune_hf import AITuneModel

            self.model = AITuneModel.from_pretrained(self.folder, auto_class=auto_class, local_files_only=True).eval()
        else:
            self.model = getattr(transformers, auto_class).from_pretrained(self.folder, local_files_only=True).eval()
        config = self.model.generation_config
        if self.variant.static:
            config.cache_implementation = "static"
            config.max_cache_len = PROMPT_TOKENS + n
        self.generate(n)  # allocations, lazy inits
        eager_n = statistics.median(self.timed(n)[0] for _ in range(3))
        eager_1 = statistics.median(self.timed(1)[0] for _ in range(3))
        calls = 0
        with Stopwatch() as watch:  # until the first short call after the last preparing one
            if name in ("compile_forward", "hf_autocompile"):
                if name == "compile_forward":
                    self.model.forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)
                else:
                    from transformers import CompileConfig

                    compile_config = CompileConfig()
                    compile_config._compile_all_devices = True  # generate() compiles on cuda/xpu/neuron/tpu only
                    config.compile_config = compile_config
                for _ in range(2):
                    self.generate(n)
                    calls += 1
            elif name.startswith("aitune"):
                if name == "aitune_blocks":
                    self.model.enable_aitune("blocks", backends=["inductor", "onnxruntime"], progress=False)
                elif name == "aitune_auto":
                    self.model.enable_aitune("auto", progress=False)
                elif name == "aitune_openvino_decoder":
                    backends = ["inductor", "openvino_decoder"]
                    self.model.enable_aitune("components", backends=backends, progress=False)
                elif name == "aitune_openvino_decoder_bf16":
                    precision = ["fp32", "bf16"]
                    self.model.enable_aitune("components", backends=["openvino_decoder"], precision=precision,
                                             progress=False)  # fmt: skip
                else:  # aitune_components, with the static cache or generate()'s default dynamic one
                    self.model.enable_aitune("components", backends=["inductor"], progress=False)
                while not self.model.aitune.all_tuned and calls < WARMUP_LIMIT:
                    self.generate(n)
                    calls += 1
                info["tuned_after_calls"] = calls
                info["all_tuned"] = bool(self.model.aitune.all_tuned)
                self.generate(n)
                calls += 1
            if calls:
                self.generate(1)
        if calls:
            info["one_off_s"] = max(watch.seconds - calls * eager_n - eager_1, 0.0)
        info["eager_call_ms"] = {"1": eager_1 * 1e3, str(n): eager_n * 1e3}
        info["dynamo"] = _dynamo_counts()
        if name.startswith("aitune"):
            registration = self.model.aitune
            info["report"] = str(registration.report())
            info["state_counts"] = dict(registration.state_counts)
            info["chosen"] = dict(Counter(r.backend for r in registration.reports.values()))
            before = _served(self.model)
            self.generate(1)
            prefill = _served(self.model) - before
            before = _served(self.model)
            self.generate(n)
            info["decode_served"] = dict((_served(self.model) - before) - prefill)
            info["prefill_served"] = dict(prefill)
        if name == "eager":
            out = self.model.generate(
                self.ids,
                attention_mask=self.mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                output_scores=True,
                return_dict_in_generate=True,
            )
            info["min_top2_gap"] = min(float(s.topk(2).values.diff().abs().min()) for s in out.scores)
        return info

    def prepare_optimum(self, optimum_class: str, info: dict[str, Any]) -> dict[str, Any]:
        """optimum-intel's model, exported and compiled from the folder (its one-off seconds: that, less nothing: it
        has no eager calls to subtract), with OpenVINO's threads as the torch variants' and the precision hint named."""
        import openvino
        import optimum.intel
        import transformers

        hint = "bf16" if self.variant.precision == "bf16" else "f32"
        config = {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": str(self.threads)}
        with Stopwatch() as watch:
            self.model = getattr(optimum.intel, optimum_class).from_pretrained(
                self.folder, export=True, compile=True, ov_config=config, local_files_only=True
            )
            self.generate(self.new_tokens)  # its first call (the state's allocations), as the others' warm-up
        info["one_off_s"] = watch.seconds
        info["stateful"] = bool(getattr(self.model, "stateful", False))
        info["versions"] = {
            "optimum-intel": importlib.metadata.version("optimum-intel"),
            "openvino": openvino.__version__,
            "transformers": transformers.__version__,
        }
        info["describe"] = _OPTIMUM.format(cls=optimum_class, hint=hint)
        # OpenVINO's CPU plugin keeps the fused attention's cache in f16 unless told, even under the f32 hint
        kept = _kv_cache_precision(self.model)
        if kept is not None:
            info["describe"] += f", KV cache {kept} (read back)"
        return info

    def round(self) -> dict[str, Any]:
        t1, _ = self.timed(1)
        tn, out = self.timed(self.new_tokens)
        new = (
            out[:, 1:] if MODELS[self.kind][2] == "AutoModelForSeq2SeqLM" else out[:, PROMPT_TOKENS:]
        )  # after the start, every row
        return {"t1": t1, "tn": tn, "tokens": new.tolist()}


def worker_main(args: argparse.Namespace) -> int:
    """Prepare one variant, then answer "round" lines on stdin with JSON lines (anything else on stdout is
    sent to stderr, so that library prints cannot corrupt the protocol)."""
    protocol: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    worker = Worker(
        VARIANTS[args.worker], args.folder, args.new_tokens, args.kind, args.threads, args.batch, args.padding
    )
    try:
        info = worker.prepare()
    except Exception as error:  # a variant that fails is a finding for the table
        text = str(error).splitlines()[0][:300] if str(error) else ""
        protocol.write(json.dumps({"error": f"{type(error).__name__}: {text}"}) + "\n")
        raise
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})
    protocol.write(json.dumps(info) + "\n")
    for line in sys.stdin:
        command = line.strip()
        if command == "round":
            protocol.write(json.dumps(worker.round()) + "\n")
        elif command == "finish":
            protocol.write(json.dumps({"dynamo": _dynamo_counts()}) + "\n")
            return 0
    return 0


# -- parent -----------------------------------------------------------------------------------------------------


@dataclass
class Result:
    variant: str
    info: dict[str, Any] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    final_dynamo: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    def decode_tps(self, new_tokens: int) -> list[float]:
        return [(new_tokens - 1) / (r["tn"] - r["t1"]) for r in self.rounds]


class Process:
    def __init__(self, variant: str, kind: str, folder: Path, args: argparse.Namespace, log_path: Path) -> None:
        python = args.optimum_python if VARIANTS[variant].optimum else sys.executable
        command = [python, __file__, "--worker", variant, "--kind", kind, "--folder", str(folder)]
        command += ["--threads", str(args.threads), "--new-tokens", str(args.new_tokens), "--cpu", str(args.cpu)]
        command += ["--batch", str(args.batch), "--padding", str(args.padding)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        if VARIANTS[variant].optimum:  # its venv has torch and optimum-intel; aitune_hf (the timer) from this checkout
            env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
        # cold: an empty Inductor cache per worker, inside the run's temporary folder (removed at the end)
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"inductor_{variant}_", dir=folder.parent)
        self.log_path = log_path
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env, text=True, bufsize=1
        )

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            tail = self.log_path.read_text().strip().splitlines()[-5:]
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return {"error": f"worker died ({how}): {' | '.join(tail)[-300:]}"}
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_model(kind: str, folder: Path, args: argparse.Namespace, say: Any) -> dict[str, Result]:
    results = {name: Result(name) for name in args.variants}
    live: dict[str, Process] = {}
    try:
        for name in args.variants:  # one at a time: compiles and tuning are not timed under contention
            if VARIANTS[name].optimum and not args.optimum_python:
                results[name].error = "not run: no --optimum-python (optimum-intel installs in a venv of its own)"
                say(f"  {name}: {results[name].error}")
                continue
            process = Process(name, kind, folder, args, folder.parent / f"{kind}_{name}.log")
            info = process.read()
            if "error" in info:
                results[name].error = info["error"]
                say(f"  {name}: FAILED {info['error']} (log {process.log_path})")
                process.close()
                continue
            results[name].info = info
            live[name] = process
            one_off = f", one-off {info['one_off_s']:.1f} s" if "one_off_s" in info else ""
            say(f"  {name}: prepared{one_off}; dynamo {info.get('dynamo', '-')}")
            if "report" in info:
                say(f"  {name}: served in decode {info['decode_served']}; aitune report:")
                say("    " + info["report"].replace("\n", "\n    "))
        names = list(live)
        for r in range(args.rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                answer = live[name].ask("round")
                if "error" in answer:
                    results[name].error = answer["error"]
                    say(f"  {name}: FAILED in round {r}: {answer['error']}")
                    live.pop(name).close()
                    names.remove(name)
                    continue
                results[name].rounds.append(answer)
            say(f"  round {r + 1}/{args.rounds} done")
        for name, process in live.items():
            results[name].final_dynamo = process.ask("finish").get("dynamo", {})
    finally:
        for process in live.values():
            process.close()
    return results


def summarize(results: dict[str, Result], n: int) -> tuple[list[dict[str, Any]], list[str]]:
    reference = results["eager"].rounds[0]["tokens"] if results.get("eager") and results["eager"].rounds else None
    rows = []
    tps = {name: r.decode_tps(n) for name, r in results.items() if r.rounds and not r.error}
    eager_tps = statistics.median(tps["eager"]) if "eager" in tps else None
    for name, result in results.items():
        variant = VARIANTS[name]
        describe = result.info.get("describe", variant.describe)
        row: dict[str, Any] = {"variant": name, "describe": describe, "error": result.error}
        if name in tps:
            rounds = result.rounds
            row["prefill_ms"] = statistics.median(r["t1"] for r in rounds) * 1e3
            row["decode_tps"] = statistics.median(tps[name])
            row["e2e_tps"] = statistics.median(n / r["tn"] for r in rounds)
            row["vs_eager"] = row["decode_tps"] / eager_tps if eager_tps else None
            if reference is not None:
                row["tokens_equal"] = all(r["tokens"] == reference for r in rounds)
        info = result.info
        row["one_off_s"] = info.get("one_off_s")
        before, after = info.get("dynamo"), result.final_dynamo
        row["dynamo"] = before
        row["dynamo_growth"] = (
            {k: after[k] - before[k] for k in before if after.get(k, before[k]) != before[k]}
            if before and after
            else {}
        )
        rows.append(row)
    verdicts = []
    equal = {row["variant"]: row.get("tokens_equal") for row in rows}

    def against(name: str, peer: str) -> tuple[float, float]:
        """`name` against `peer` in the same rounds: the median of the rounds' ratios, and their IQR."""
        ratios = [a / b for a, b in zip(tps[name], tps[peer], strict=True)]
        return statistics.median(ratios), _iqr(ratios)

    baselines = [k for k in tps if VARIANTS[k].documented_baseline]
    ours = [k for k in tps if k.startswith("aitune") and VARIANTS[k].precision == "fp32"]
    if baselines and ours:
        best = max(baselines, key=lambda k: statistics.median(tps[k]))
        mine = max(ours, key=lambda k: statistics.median(tps[k]))
        ratio, spread = against(mine, best)
        ok = ratio >= BASELINE_MARGIN and equal[mine]
        verdicts.append(
            f"{'MET' if ok else 'NOT MET'}: {mine} decode {statistics.median(tps[mine]):.0f} tok/s vs best documented "
            f"baseline {best} {statistics.median(tps[best]):.0f} tok/s: {ratio:.3f}x ± {spread:.3f} "
            f"(target >= {BASELINE_MARGIN}); tokens equal to eager: {_yes(equal[mine])}"
        )

        def beside(peer: str, head: str, after: str = "") -> None:
            """A verdict line: `mine` against `peer` in the same rounds."""
            ratio, spread = against(mine, peer)
            verdicts.append(
                f"beside it: {mine} {head} {statistics.median(tps[peer]):.0f} tok/s: {ratio:.3f}x ± {spread:.3f}{after}"
            )

        if best != "compile_forward" and "compile_forward" in tps:  # Transformers' documented recipe
            one_off = f"; one-off {_one_off(results, mine)} s against {_one_off(results, 'compile_forward')} s"
            beside("compile_forward", "vs compile_forward (Transformers' compile recipe)", one_off)
        if "openvino_bf16" in tps:  # reduced precision: the peer in bf16 beside our fp32 (tokens may differ in bf16)
            after = f" (bf16 tokens equal to eager's: {_yes(equal['openvino_bf16'])})"
            beside("openvino_bf16", "(fp32) vs openvino_bf16", after)
        if "hf_autocompile" in tps:
            beside("hf_autocompile", "vs hf_autocompile (generate's compile forced on CPU)")
    elif not ours:
        verdicts.append("aitune_hf: no measurement")
    reduced = [k for k in tps if k.startswith("aitune") and VARIANTS[k].precision != "fp32"]
    if "openvino_bf16" in tps:  # reduced precision against its own kind, the quality beside the speed
        for name in reduced:
            ratio, spread = against(name, "openvino_bf16")
            lines = results[name].info.get("report", "").splitlines()
            gate = next((line for line in lines if line.startswith("quality")), "quality: no gate ran")
            verdicts.append(
                f"reduced precision: {name} decode {statistics.median(tps[name]):.0f} tok/s vs openvino_bf16 "
                f"{statistics.median(tps['openvino_bf16']):.0f} tok/s: {ratio:.3f}x ± {spread:.3f}; tokens equal to "
                f"eager: ours {_yes(equal[name])}, openvino_bf16 {_yes(equal['openvino_bf16'])}; our end-to-end "
                f"gate: {gate.removeprefix('quality: ')}"
            )
    return rows, verdicts


def _yes(flag: Any) -> str:
    return "yes" if flag else "NO"


def _one_off(results: dict[str, Result], name: str) -> str:
    seconds = results[name].info.get("one_off_s")
    return "-" if seconds is None else f"{seconds:.1f}"


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q3 - q1


def markdown(
    setting: dict[str, Any], models: dict[str, tuple[list[dict[str, Any]], list[str], dict[str, Result]]], n: int
) -> str:
    lines = [
        "# Greedy generation tokens/s: eager vs torch.compile vs aitune_hf",
        "",
        *[f"- {k}: {v}" for k, v in setting.items()],
        "",
        f"Prefill: median ms of `generate(max_new_tokens=1)`. Decode: median over rounds of ({n} - 1) / (t{n} - t1),",
        f"t1 and t{n} timed back to back in the same round. End to end: median of {n} / t{n} (prefill included).",
        "One-off: seconds of compiling / tuning (the warm-up's wall time less the eager time of its calls; each",
        "worker's Inductor cache starts empty). Tokens: every timed call's tokens equal the eager dynamic-cache",
        "tokens (`torch.equal`). Dynamo: graphs / graph breaks / recompile-limit hits after warm-up (+ growth while",
        "timed). Each variant runs in its own process; see the docstring of benchmarks/generation.py.",
        "",
        "Transformers' `generate()` does not compile by itself on CPU: `_valid_auto_compile_criteria` requires a",
        "cuda/xpu/neuron/tpu device unless the private `CompileConfig._compile_all_devices` is set (hf_autocompile).",
        "",
    ]
    for kind, (rows, verdicts, results) in models.items():
        eager = results.get("eager")
        gap = eager.info.get("min_top2_gap") if eager else None
        lines += [f"## {kind}", ""]
        if gap is not None:
            lines += [f"Smallest top-2 logit gap along the eager reference: {gap:.2g}.", ""]
        lines += [
            "| variant | prefill ms | decode tok/s | decode vs eager | e2e tok/s | one-off s | tokens = eager "
            "| dynamo graphs/breaks/limit hits | setup |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            if row["error"] or "decode_tps" not in row:
                lines.append(f"| {row['variant']} | - | - | - | - | - | - | - | failed: {row['error']} |")
                continue
            dyn = row["dynamo"]
            dynamo = f"{dyn['graphs']}/{dyn['graph_breaks']}/{dyn['limit_hits']}" if dyn and dyn["graphs"] else "-"
            if row["dynamo_growth"]:
                dynamo += " (+" + ", ".join(f"{k} {v}" for k, v in row["dynamo_growth"].items()) + " timed)"
            one_off = f"{row['one_off_s']:.1f}" if row["one_off_s"] is not None else "-"
            equal = {True: "yes", False: "NO", None: "-"}[row.get("tokens_equal")]
            lines.append(
                f"| {row['variant']} | {row['prefill_ms']:.2f} | {row['decode_tps']:.0f} | {row['vs_eager']:.2f}x "
                f"| {row['e2e_tps']:.0f} | {one_off} | {equal} | {dynamo} | {row['describe']} |"
            )
        lines += ["", *[f"- {v}" for v in verdicts], ""]
        for name, result in results.items():
            info = result.info
            if "report" not in info:
                continue
            lines += [
                f"{name}: tuned after {info['tuned_after_calls']} generate calls (all tuned: {info['all_tuned']}); "
                f"block calls per 1-token call served by {info['prefill_served']}, per decode "
                f'({n - 1} steps) by {info["decode_served"]}. Its report (the "end to end" line is aitune_hf\'s own '
                "record of the calls it counted, not this benchmark's timing):",
                "",
                "```",
                info["report"],
                "```",
                "",
            ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="default: llama qwen3 (--quick: llama)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 7; --quick: 2)")
    parser.add_argument("--new-tokens", type=int, help="max_new_tokens = min_new_tokens (default 64; --quick: 16)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of each model")
    parser.add_argument("--size", choices=list(SIZES), default="tiny", help="the models' widths (SIZES)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    parser.add_argument("--batch", type=int, default=1, help="prompts per generate() call")
    parser.add_argument("--padding", type=int, default=0, help="pad ids left of every prompt after the first")
    parser.add_argument("--cpu", type=int, help="core every worker pins itself to for timing (-1: no pinning)")
    parser.add_argument("--out", type=Path, default=RESULTS / "generation.md")
    parser.add_argument("--quick", action="store_true", help="smoke run: llama, 16 new tokens, 2 rounds")
    parser.add_argument(
        "--optimum-python",
        default=os.environ.get("AITUNE_OPTIMUM_PYTHON"),
        help="the Python of a venv with optimum-intel[openvino] (default: $AITUNE_OPTIMUM_PYTHON); without it the "
        "openvino_* rows are not run",
    )
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpu is None:
        args.cpu = max(os.sched_getaffinity(0))
    if args.worker:
        return worker_main(args)

    args.models = args.models or (["llama"] if args.quick else list(DEFAULT_MODELS))
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.new_tokens = args.new_tokens or (16 if args.quick else 64)
    if "eager" not in args.variants:
        args.variants.insert(0, "eager")
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_model

    torch.set_num_threads(args.threads)
    command = "python benchmarks/generation.py " + " ".join(sys.argv[1:] if argv is None else argv)
    setting = {
        "command": f"`{command}`",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "pinned core": args.cpu if args.cpu >= 0 else "none",
        "torch threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rounds": args.rounds,
        "call": f"batch {args.batch}, prompt {PROMPT_TOKENS} tokens"
        + (f" (rows after the first left-padded by {args.padding})" if args.padding else "")
        + f", greedy, {args.new_tokens} new tokens",
        "models": f"{args.layers} layers, "
        + ", ".join(f"{k} {v}" for k, v in {**COMMON, **SIZES[args.size]}.items() if "token_id" not in k),
    }
    print(f"setting: {setting}", flush=True)
    models = {}
    with Stopwatch() as wall, tempfile.TemporaryDirectory(prefix="aitune_gen_") as root:
        for kind in args.models:
            folder = build_model(kind, Path(root) / kind, args.layers, args.size)
            print(f"== {kind}", flush=True)
            results = run_model(kind, folder, args, lambda text: print(text, flush=True))
            rows, verdicts = summarize(results, args.new_tokens)
            for line in verdicts:
                print(f"  {line}", flush=True)
            models[kind] = (rows, verdicts, results)
            for result in results.values():
                if "versions" in result.info:
                    versions = ", ".join(f"{k} {v}" for k, v in result.info["versions"].items())
                    setting["optimum-intel's venv"] = f"{versions} ({args.optimum_python})"
    setting["wall time"] = f"{wall.seconds:.0f} s"
    text = markdown(setting, models, args.new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
