"""`aitune-hf`: the command line of aitune_hf.

    aitune-hf demo   [--family sd|flux|pixart|minilm] [--size tiny|small] [--backends inductor,onnxruntime] ...
    aitune-hf tune   FOLDER [--targets blocks] [--backends ...] [--prompt ...] [--steps N] [--report PATH] ...
    aitune-hf report PATH [--details]

`demo` builds a small pipeline with random weights (nothing is downloaded), tunes its blocks, measures
eager against tuned whole calls, and checks that the tuned output equals the eager output. `tune` does the
same for a local Diffusers pipeline or Transformers model folder and writes the report as JSON. `report`
prints a saved report as a table. `demo` and `tune` run `aitune_hf.session.run_session`, the session that the
benchmarks and notebooks run too; `--cache-dir` / `--cache` are passed to `enable_aitune(cache_dir=, cache=)`.

Exit codes: 0 success, 1 the tuned output differed from eager (FAIL), 2 a usage error (one line on stderr).
Only errors that are the user's to fix are one line: an `aitune_hf.errors.AITuneError` (a bad option, value or
folder), an OSError (a missing file or folder) and an ImportError (a missing optional extra). Anything else
is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import importlib
import inspect
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from tqdm.contrib.logging import logging_redirect_tqdm

from aitune_hf.backends.base import default_backend_names
from aitune_hf.core.config import TuningConfig
from aitune_hf.core.report import TuningReport
from aitune_hf.core.timing import Stopwatch
from aitune_hf.errors import AITuneError, PathError, UserInputError
from aitune_hf.session import details

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

DEMO_FAMILIES = ("sd", "flux", "pixart", "minilm")
SIZES = ("tiny", "small")
DEFAULT_BACKENDS = ",".join(default_backend_names())
DEFAULT_PROMPT = "a photo of an astronaut riding a horse"
_KINDS = {"diffusers": "pipeline", "transformers": "model"}
#: Sentences for Transformers models: `tiny` uses the first two, `small` all of them.
SENTENCES = (
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome and everyone should see it.",
    "A monkey is playing drums.",
    "Two men pushed carts through the woods.",
    "A woman is playing the violin.",
    "The cat sits outside on a sunny afternoon.",
    "Someone is slicing a tomato in the kitchen.",
)
#: Errors that are the user's to fix: reported as one line, exit code 2, no traceback. Anything else is a bug.
USER_ERRORS = (AITuneError, OSError, ImportError)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------------------------------------------------------
# What is tuned: a pipeline or a model, with a fixed-seed call and the kwargs for measure_aitune
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One object with the mixin, how to call it with fixed inputs, and the facts to print."""

    obj: Any
    kind: str  # "diffusers" or "transformers"
    call_kwargs: dict[str, Any]
    run: Callable[[], Any]  # one whole call with fixed inputs (fixed seed) -> output as a numpy array
    describe: str
    facts: dict[str, Any] = field(default_factory=dict)
    #: The command-line flags that shaped the call (`tune`): a call that rejects its inputs is then a usage
    #: error naming them. Empty for the demo's own calls, whose failures are bugs.
    call_flags: str = ""


def _diffusers_workload(folder: Path, call_kwargs: dict[str, Any], seed: int) -> Workload:
    import torch

    from aitune_hf.hf.loading import AITunePipeline

    pipe = AITunePipeline.from_pretrained(folder, local_files_only=True)
    if not hasattr(pipe, "set_progress_bar_config"):
        raise UserInputError(f"{folder} did not load as a Diffusers pipeline (got {type(pipe).__name__})")
    pipe.set_progress_bar_config(disable=True)
    kwargs = {**call_kwargs, "output_type": "np"}

    def run() -> Any:
        return pipe(**kwargs, generator=torch.Generator().manual_seed(seed)).images

    return Workload(pipe, "diffusers", kwargs, run, f"{type(pipe).__name__} from {folder}")


def _check_call_keys(obj: Any, given: dict[str, str], say: Callable[[str], None], method: str = "__call__") -> None:
    """The keys the user gave for the call (key -> the flag that gave it) against the signature of `method` of `obj`'s
    own class (`inspect.signature`), after loading and before any call. A key it cannot take is a usage error naming
    the key, a did-you-mean and the valid keys. A callee that takes **kwargs accepts any key, so none is rejected; a
    key that is none of its named parameters gets a warning line instead (StableDiffusionPipeline drops such keys
    without a word)."""
    from aitune_hf.hf.copies import concrete_class

    if not given:
        return
    cls = concrete_class(type(obj))
    callee = f"{cls.__name__}.{method}"
    try:
        signature = inspect.signature(getattr(cls, method).__get__(obj))
    except (AttributeError, TypeError, ValueError):  # no signature to read: the call itself will say
        return
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    valid = [name for name, parameter in signature.parameters.items() if parameter.kind in named]
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    for key, flag in given.items():
        if key in valid:
            continue
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        if open_ended:
            say(f"warning: {flag}: {key!r}{hint} is none of the named arguments of {callee}; it takes **kwargs, so "
                f"the call accepts it, and may ignore it")  # fmt: skip
            continue
        raise UserInputError(f"{flag}: {callee} takes no argument {key!r}{hint}; valid: {', '.join(valid)}")


def _transformers_workload(folder: Path, texts: Sequence[str]) -> Workload:
    import torch
    from transformers import AutoTokenizer

    from aitune_hf.hf.loading import AITuneModel

    model = AITuneModel.from_pretrained(folder, local_files_only=True).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UserInputError(
            f"{folder} holds a Transformers model but no usable tokenizer: {_first_line(error)}"
        ) from None
    batch = dict(tokenizer(list(texts), padding=True, return_tensors="pt"))

    def run() -> Any:
        with torch.inference_mode():
            output = model(**batch)
        return output[0].float().numpy()

    shape = "x".join(str(d) for d in batch["input_ids"].shape)
    describe = f"{type(model).__name__} from {folder}; a fixed batch of {len(texts)} sentence(s), tokens {shape}"
    return Workload(model, "transformers", batch, run, describe)


# --------------------------------------------------------------------------------------------------------------
# The shared flow of demo and tune
# --------------------------------------------------------------------------------------------------------------


def _pin_threads(threads: int) -> str:
    import torch

    if threads < 1:
        raise UserInputError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    n = torch.get_num_threads()
    return (
        f"threads: torch.set_num_threads({threads}) -> torch uses {n} intra-op thread(s); ONNX Runtime sessions "
        f"take intra_op_num_threads={n} from torch.get_num_threads() (machine has {os.cpu_count()} cores)"
    )


def _parse_backends(text: str) -> list[str]:
    from aitune_hf.backends.base import get_backend

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UserInputError("--backends needs at least one backend name, e.g. inductor,onnxruntime")
    for name in names:
        get_backend(name)  # UserInputError naming the valid backends
    return names


def _check_options(args: argparse.Namespace) -> list[str]:
    """The backends, after checking them, the tuning options as a TuningConfig (ConfigError) and the form of
    --targets, so that a bad value fails before anything is built or loaded."""
    backends = _parse_backends(args.backends)
    TuningConfig(backends=backends, **_config_fields(args))
    _parse_targets(args.targets)
    return backends


#: How the command line names modules in --targets (a callable, which the Python API also takes, it cannot).
_TARGET_NAMES = "comma-separated dotted module names"


def _parse_targets(text: str) -> str | list[str]:
    """--targets, before anything is loaded: a mode (`aitune_hf.hf.targets.MODES`), else dotted module names, each
    checked for its form here; whether they name modules is checked once the object is loaded (`_check_targets`)."""
    from aitune_hf.hf.targets import MODES

    text = text.strip()
    if text in MODES:
        return text
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UserInputError(f"--targets is empty; use {', '.join(map(repr, MODES))} or {_TARGET_NAMES}")
    for name in names:
        if any(char.isspace() for char in name) or "" in name.split("."):
            raise UserInputError(
                f"--targets {text!r}: {name!r} is not a dotted module name (e.g. unet.mid_block); valid: "
                f"{', '.join(map(repr, MODES))} or {_TARGET_NAMES}"
            )
    return names


def _check_targets(obj: Any, text: str) -> str | list[str]:
    """--targets on the loaded object, before any call: every name must name a module of it (as enable_aitune will
    resolve them). A bare word that is neither a mode nor a module gets the command line's own message."""
    from aitune_hf.hf.targets import components_of, find_targets, unknown_targets

    targets = _parse_targets(text)
    try:
        find_targets(obj, targets)
    except UserInputError as error:
        problem = _first_line(error)
        if isinstance(targets, list) and len(targets) == 1 and "." not in targets[0]:
            problem = str(unknown_targets(targets[0], components_of(obj), names=_TARGET_NAMES, callable_ok=False))
        raise UserInputError(f"--targets: {problem}") from None
    return targets


def _config_fields(args: argparse.Namespace) -> dict[str, Any]:
    # The tuning bar redraws its line with carriage returns: drawn on a terminal only, never into a log or a pipe.
    config: dict[str, Any] = {"progress": not args.no_progress and _is_terminal(sys.stderr)}
    for name in ("repeats", "warmup", "min_speedup", "strategy", "cache_dir", "cache"):
        value = getattr(args, name, None)
        if value is not None:
            config[name] = value
    precision = getattr(args, "precision", None)
    if precision is not None:
        names = [name.strip() for name in precision.split(",") if name.strip()]
        config["precision"] = names[0] if len(names) == 1 else names
    quality = getattr(args, "quality", None)
    if quality is not None:
        config["quality"] = _parse_quality(quality)
    return config


def _parse_quality(text: str) -> dict[str, float]:
    """ "psnr=40" or "cosine=0.995,argmax=1" -> {metric: budget} (TuningConfig checks the metric names)."""
    budgets = {}
    for part in (part.strip() for part in text.split(",") if part.strip()):
        metric, sep, value = part.partition("=")
        try:
            budgets[metric.strip()] = float(value) if sep else None
        except ValueError:
            budgets[metric.strip()] = None
        if budgets[metric.strip()] is None:
            raise UserInputError(f"--quality {text!r}: {part!r} is not METRIC=NUMBER, e.g. psnr=40 or cosine=0.995")
    if not budgets:
        raise UserInputError("--quality is empty; give METRIC=NUMBER, e.g. psnr=40")
    return budgets


def _tune_and_check(work: Workload, args: argparse.Namespace, out: Any) -> tuple[Any, dict[str, Any]]:
    """One `aitune_hf.session` run (eager call, enable_aitune, recording call, tuning call, tuned call,
    measurement, check), printed. Returns (report, facts)."""
    from aitune_hf.session import run_session

    say = _printer(out)
    backends = _parse_backends(args.backends)
    targets = _check_targets(work.obj, args.targets)
    say(f"model: {work.describe}")
    fixed = "fixed seed" if work.kind == "diffusers" else "fixed inputs"

    def run() -> Any:
        try:
            return work.run()
        except (TypeError, ValueError) as error:  # before enable_aitune: the library rejected the call's inputs
            if work.obj.aitune is not None or not work.call_flags or isinstance(error, AITuneError):
                raise
            flags = work.call_flags
            raise UserInputError(f"the eager call rejected its inputs (see {flags}): {_first_line(error)}") from error

    session = run_session(
        work.obj,
        run,
        targets,
        say=say,
        inputs=fixed,
        rounds=args.rounds,
        call_kwargs=work.call_kwargs,
        backends=backends,
        **_config_fields(args),
    )
    report = session.report
    say("")
    say(str(report))
    if args.details:
        say("")
        say(details(report.to_dict()))
    say("")
    plans = ""
    if session.first_tuned_seconds is not None:
        plans = f"; first tuned call {session.first_tuned_seconds:.1f} s after enable_aitune"
        if session.final_plan_seconds is not None:
            plans += f", final plan after {session.final_plan_seconds:.1f} s"
    say(
        f"tuning: {session.tuning_call_seconds:.1f} s wall in the tuning call; prepare {session.prepare_seconds:.1f} s "
        f"(enable_aitune, recording and tuning calls){plans}; {report.tuning_seconds:.1f} s summed over targets"
    )
    budget = session.quality or f"atol {session.atol:g}"  # reduced precision: its end-to-end quality budget
    say(
        f"check: tuned output vs eager output, {fixed}: max abs diff {session.max_abs_diff:.3g} "
        f"({budget}): {'PASS' if session.passed else 'FAIL'}"
    )
    config = session.registration.config
    facts = {
        **work.facts,
        "threads": args.threads,
        "backends": backends,
        "cache_dir": None if config.cache_dir is None else str(config.cache_dir),
        "cache_mode": config.cache,
        **session.facts(),
    }
    return report, facts


def _check_writable(path: str | Path | None) -> None:
    """Fail before tuning, not after it, when the JSON cannot be written where asked."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise UserInputError(f"{target} is a folder; give a file path for the JSON report")
    if not target.parent.is_dir():
        raise PathError(f"cannot write {target}: folder {target.parent} does not exist")


def _write_json(report: Any, facts: dict[str, Any], path: str | Path) -> Path:
    """The report's JSON with the run's facts after it (their names are none of `TuningReport.KEYS`)."""
    data = json.loads(report.to_json())
    data.update(facts)
    target = Path(path)
    target.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return target


# --------------------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace, out: Any) -> int:
    """Build a small pipeline with random weights (or load all-MiniLM-L6-v2), tune its blocks, measure eager
    against tuned whole calls, and check that the tuned output equals the eager output."""
    say = _printer(out)
    threads_line = _pin_threads(args.threads)
    _check_options(args)  # fail before building anything
    _check_writable(args.json)
    from aitune_hf import testing

    with Stopwatch() as watch:  # the whole demo
        say(f"aitune-hf demo: family {args.family}, size {args.size}, backends {args.backends}")
        say(threads_line)
        with tempfile.TemporaryDirectory(prefix="aitune_hf_demo_") as tmp:
            if args.family == "minilm":
                folder = testing.minilm_path()
                count = 2 if args.size == "tiny" else len(SENTENCES)
                work = _transformers_workload(folder, SENTENCES[:count])
                work.describe = f"real all-MiniLM-L6-v2 weights ({work.describe})"
            else:
                with Stopwatch() as build:
                    folder = testing.build_pipeline(args.family, Path(tmp) / args.family, args.size)
                say(f"built a random {args.family} pipeline ({args.size}) in {build.seconds:.1f} s at {folder}")
                work = _diffusers_workload(folder, testing.default_call_kwargs(args.family, args.size), 0)
                call = ", ".join(f"{k}={v!r}" for k, v in work.call_kwargs.items() if k != "output_type")
                say(f"call: {call}")
            work.facts = {"command": "demo", "family": args.family, "size": args.size}
            report, facts = _tune_and_check(work, args, out)
            if args.json:
                say(f"report JSON written to {_write_json(report, facts, args.json)}")
            work.obj.disable_aitune()
    from aitune_hf import hardware

    speedup = (report.end_to_end or {}).get("speedup")
    measured = f"end to end {speedup:.2f}x (measured)" if speedup else "end to end not measured"
    # What a user compares with the README: the whole run's seconds and speed-up, on this CPU.
    say(f"demo took {watch.seconds:.1f} s; {measured}; cpu: {hardware.describe()}")
    return EXIT_OK if facts["passed"] else EXIT_FAIL


def cmd_tune(args: argparse.Namespace, out: Any) -> int:
    """Tune a local Diffusers pipeline or Transformers model folder, check it, and write the report JSON."""
    from aitune_hf.hf.loading import folder_kind

    say = _printer(out)
    folder = Path(args.folder)
    if not folder.exists():
        raise PathError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise UserInputError(f"{folder} is not a folder; pass a local Diffusers pipeline or Transformers model folder")
    kind = folder_kind(folder)  # UserInputError for a folder that is neither
    call_extra = _parse_call_kwargs(args.call_kwargs)
    _check_writable(args.report)
    if kind == "diffusers" and args.text:
        raise UserInputError("--text is for Transformers model folders; a Diffusers pipeline takes --prompt")
    if kind == "transformers" and (call_extra or args.height or args.width):
        raise UserInputError("--call-kwargs/--height/--width are for Diffusers pipelines; a model takes --text")
    threads_line = _pin_threads(args.threads)
    _check_options(args)
    say(threads_line)
    try:  # the folder is the user's: a library that rejects it (a bad config value, ...) is a usage error
        if kind == "diffusers":
            call = {"prompt": args.prompt, "num_inference_steps": args.steps}
            call.update({k: v for k, v in (("height", args.height), ("width", args.width)) if v is not None})
            call.update(call_extra)
            work = _diffusers_workload(folder, call, args.seed)
            given = {k: f"--{k}" for k in ("height", "width") if getattr(args, k) is not None}
            _check_call_keys(work.obj, {**given, **dict.fromkeys(call_extra, "--call-kwargs")}, say)
            say(f"call: {', '.join(f'{k}={v!r}' for k, v in call.items())}")
        else:
            work = _transformers_workload(folder, args.text or SENTENCES[:2])
    except ValueError as error:
        if isinstance(error, AITuneError):
            raise
        raise UserInputError(f"{folder} did not load as a {kind} {_KINDS[kind]}: {_first_line(error)}") from error
    work.call_flags = "--prompt/--steps/--height/--width/--call-kwargs" if kind == "diffusers" else "--text"
    work.facts = {"command": "tune", "folder": str(folder.resolve()), "kind": kind}
    report, facts = _tune_and_check(work, args, out)
    say(f"report JSON written to {_write_json(report, facts, args.report)}")
    return EXIT_OK if facts["passed"] else EXIT_FAIL


def cmd_report(args: argparse.Namespace, out: Any) -> int:
    """Print a saved report JSON as a table."""
    path = Path(args.path)
    if not path.is_file():
        raise PathError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserInputError(f"{path} is not JSON: {error}") from None
    say = _printer(out)
    say(format_report(data))
    if args.details:
        say("")
        say(details(data))
    return EXIT_OK


def cmd_cache(args: argparse.Namespace, out: Any) -> int:
    """List the entries of a tuning cache (module, signature, winner, size), verify every artifact against its
    manifest (exit 1 when one fails), or clear it. The folder is the one enable_aitune would use: --cache-dir,
    else $AITUNE_HF_CACHE, else aitune_hf under the user's cache folder."""
    from aitune_hf.core.cache import ENV, CacheUnusable, TuningCache, default_location

    say = _printer(out)
    location = args.cache_dir or os.environ.get(ENV) or default_location()
    if location.strip().lower() == "off":
        raise UserInputError(f"the cache is off (${ENV}=off); give --cache-dir")
    try:
        cache = TuningCache(location, read_only=args.action != "clear")
    except CacheUnusable as error:
        raise UserInputError(str(error)) from None
    if args.action == "clear":
        say(f"{location}: removed {cache.clear()} entr(ies)")
        return EXIT_OK
    entries = cache.entries(verify=args.action == "verify")
    say(f"{location}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    for entry in entries:
        say(f"  {entry.describe()}")
    if args.action == "verify":
        bad = [entry for entry in entries if entry.problem]
        say(f"verify: {len(entries) - len(bad)} whole, {len(bad)} with a problem")
        return EXIT_FAIL if bad else EXIT_OK
    return EXIT_OK


# --------------------------------------------------------------------------------------------------------------
# Reading a saved report
# --------------------------------------------------------------------------------------------------------------


def format_report(data: dict[str, Any]) -> str:
    """A saved report as text: the run's own facts (if any), then the table that `str(TuningReport)` prints."""
    try:
        report = TuningReport.from_dict(data)
    except ValueError as error:
        raise UserInputError(str(error)) from None
    lines = []
    line = ""
    items = [f"{k}: {_fact(v)}" for k, v in data.items() if k not in TuningReport.KEYS and k not in _CHECK_FACTS]
    if isinstance(data.get("max_abs_diff"), int | float):  # the check on one line: the difference, and what held it
        budget = data.get("check_quality") or f"within atol {_fact(data.get('atol'))}"
        verdict = "passed" if data.get("passed") else "FAILED"
        items.append(f"check: max abs diff {_fact(data['max_abs_diff'])}, {verdict} by {budget}")
    for item in items:
        if line and len(line) + 2 + len(item) > 120:
            lines.append(line)
            line = ""
        line = f"{line}  {item}" if line else item
    if line:
        lines.append(line)
    e2e = data.get("end_to_end") or {}
    if e2e.get("method"):
        lines.append(f"end-to-end method: {e2e['method']}")
    lines.append(str(report))
    return "\n".join(lines)


#: The facts of a run's check, printed together on one line by `format_report` (`SessionResult.facts`).
_CHECK_FACTS = ("max_abs_diff", "atol", "passed", "check_quality")


def _fact(value: Any) -> str:
    """One fact of a saved report as text: numbers short, lists joined, objects as `key value` pairs (never a raw
    dict)."""
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return ",".join(map(_fact, value))
    if isinstance(value, dict):
        return "(" + ", ".join(f"{key} {_fact(item)}" for key, item in value.items()) + ")"
    return str(value)


# --------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------


def _printer(out: Any) -> Callable[[str], None]:
    """Print lines to `out`, each on a line of its own: an open progress bar (the tuning bar, on a terminal) is cleared
    off its line first and drawn again below (`tqdm.external_write_mode`), never continued by the line."""
    from tqdm import tqdm

    def say(text: str) -> None:
        with tqdm.external_write_mode(file=out):
            print(text, file=out, flush=True)

    return say


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _parse_call_kwargs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserInputError(f"--call-kwargs is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise UserInputError("--call-kwargs must be a JSON object, e.g. '{\"guidance_scale\": 4.5}'")
    return value


@contextlib.contextmanager
def _process_settings() -> Iterator[None]:
    """Hide the libraries' loading bars and info chatter (errors still show) and put back the torch thread count
    and those settings afterwards, so that `main()` called in-process leaves the process as it found it."""
    import torch

    threads = torch.get_num_threads()
    restore: list[Callable[[], None]] = []
    for package in ("diffusers.utils.logging", "transformers.utils.logging"):
        try:
            hf_logging = importlib.import_module(package)
        except ImportError:
            continue
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        restore.append(functools.partial(hf_logging.set_verbosity, verbosity))
        if bars:
            restore.append(hf_logging.enable_progress_bar)
    try:
        yield
    finally:
        for undo in restore:
            undo()
        torch.set_num_threads(threads)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _add_tuning_options(parser: argparse.ArgumentParser, rounds: int) -> None:
    parser.add_argument(
        "--targets",
        default="blocks",
        help="'blocks' (default), 'components', or comma-separated dotted module names (e.g. unet.mid_block)",
    )
    parser.add_argument(
        "--backends", default=DEFAULT_BACKENDS, help=f"comma-separated candidate backends (default {DEFAULT_BACKENDS})"
    )
    parser.add_argument("--strategy", choices=("min_latency", "first_wins"), help="how a backend is chosen")
    parser.add_argument("--min-speedup", type=float, help="ratio a candidate must beat eager by (default 1.05)")
    parser.add_argument("--repeats", type=_positive, help="timed rounds per candidate (default 15)")
    parser.add_argument("--warmup", type=int, help="untimed runs per candidate before timing (default 2)")
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=rounds,
        help=f"interleaved eager/tuned whole-call rounds for the end-to-end measurement (default {rounds})",
    )
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where tuning decisions and artifacts persist across runs: a folder or an fsspec URL "
        "(default: TuningConfig's, under the user's cache folder)",
    )
    parser.add_argument(
        "--cache",
        choices=("rw", "ro", "off"),
        help="rw: reuse entries and write new ones (default); ro: reuse, never write; off: no cache",
    )
    parser.add_argument(
        "--precision",
        metavar="PRECISION",
        help="fp32 (default: never lossy), auto (every reduced precision this machine computes natively), or a "
        "comma-separated list of fp32, bf16, fp16, int8 (docs/precision.md)",
    )
    parser.add_argument(
        "--quality",
        metavar="METRIC=BUDGET",
        help="the end-to-end budget of reduced precision against fp32 eager, e.g. psnr=40 (images), cosine=0.995 "
        "(embeddings), argmax=1, tokens=1 (default: psnr=35, cosine=0.99, argmax=1, tokens=1 by output)",
    )
    parser.add_argument("--threads", type=_positive, default=1, help="torch.set_num_threads(N) (default 1)")
    parser.add_argument("--details", action="store_true", help="also print every candidate, with full error texts")
    parser.add_argument(
        "--no-progress", action="store_true", help="hide the tuning progress bar (drawn only on a terminal)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="aitune-hf",
        description="Per-block backend tuning for Hugging Face Diffusers and Transformers inference.",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    demo = sub.add_parser(
        "demo", help="build a small random pipeline, tune it, measure it, check it", description=cmd_demo.__doc__
    )
    demo.add_argument("--family", choices=DEMO_FAMILIES, default="sd", help="what to build (default sd)")
    demo.add_argument("--size", choices=SIZES, default="small", help="tiny: seconds; small: realistic (default)")
    demo.add_argument("--json", metavar="PATH", help="write the report and the demo's facts as JSON")
    _add_tuning_options(demo, rounds=5)
    demo.set_defaults(func=cmd_demo)

    tune = sub.add_parser("tune", help="tune a local Diffusers pipeline or Transformers model folder")
    tune.add_argument("folder", help="a folder with model_index.json (Diffusers) or config.json (Transformers)")
    tune.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt for a Diffusers pipeline")
    tune.add_argument("--steps", type=_positive, default=4, help="num_inference_steps (default 4)")
    tune.add_argument("--height", type=_positive, help="image height (default: the pipeline's)")
    tune.add_argument("--width", type=_positive, help="image width (default: the pipeline's)")
    tune.add_argument("--seed", type=int, default=0, help="generator seed of the checked calls (default 0)")
    tune.add_argument(
        "--call-kwargs",
        metavar="JSON",
        help="more pipeline call arguments, checked against the pipeline's __call__, e.g. '{\"guidance_scale\": 4}'",
    )
    tune.add_argument(
        "--text", action="append", metavar="SENTENCE", help="input sentence for a Transformers model (repeatable)"
    )
    tune.add_argument("--report", default="aitune_report.json", metavar="PATH", help="where the JSON report goes")
    _add_tuning_options(tune, rounds=3)
    tune.set_defaults(func=cmd_tune)

    report = sub.add_parser("report", help="print a saved report JSON as a table")
    report.add_argument("path", help="a JSON file written by `aitune-hf demo --json` / `tune --report` / to_json()")
    report.add_argument("--details", action="store_true", help="also print every candidate, with full error texts")
    report.set_defaults(func=cmd_report)

    cache = sub.add_parser(
        "cache", help="list, verify or clear a tuning cache (docs/cache.md)", description=cmd_cache.__doc__
    )
    cache.add_argument("action", choices=("ls", "verify", "clear"), help="ls: entries; verify: check every artifact")
    cache.add_argument(
        "--cache-dir", metavar="DIR", help="a folder or an fsspec URL (default: $AITUNE_HF_CACHE, else the user cache)"
    )
    cache.set_defaults(func=cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None, *, stdout: Any = None, stderr: Any = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 check failed, 2 usage error)."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    debug = args.debug or os.environ.get("AITUNE_HF_DEBUG") == "1"
    try:
        with _process_settings(), logging_redirect_tqdm():  # log records print above an open bar, as lines do
            return args.func(args, out)
    except KeyboardInterrupt:
        print("aitune-hf: interrupted", file=err)
        return 130
    except BrokenPipeError:  # `aitune-hf report x.json | head`: the reader left; nothing to say
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return EXIT_OK
    except USER_ERRORS as error:
        if debug:
            raise
        print(f"aitune-hf: error: {_first_line(error)}", file=err)
        return EXIT_USAGE
