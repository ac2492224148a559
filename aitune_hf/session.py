"""One tuning session: the flow that `aitune-hf demo` / `tune`, `benchmarks/pipelines.py` and the notebooks run.

Given an object with the aitune mixin (a Diffusers pipeline or a Transformers model loaded through
`AITunePipeline` / `AITuneModel`) and `run()`, one whole call of it with fixed inputs that returns a numpy
array, `run_session` makes:

1. the eager call (timed; its output is the reference), unless the caller passes `reference`;
2. `obj.enable_aitune(targets, **enable_kwargs)`;
3. the recording call (every target runs eager and records its inputs; the mixin arms tuning at its end);
4. the tuning call, and at most `max_extra_calls` more while `registration.all_tuned` is False or the registration
   is `settling` (a target that did not run in a call tunes in the next; `targets="auto"` records the blocks of the
   components that stayed eager in one more call, and the worker tunes them after the next); then the wait for the
   search after the first plans on the worker (anytime tuning: `first_tuned_seconds`, `final_plan_seconds`);
5. the tuned call (timed; its output is checked against the reference);
6. optionally `obj.measure_aitune(**call_kwargs, rounds=rounds)`: interleaved eager and tuned whole calls,
   recorded in the report as the end-to-end speed-up.

Every duration comes from `aitune_hf.Stopwatch` (the one timer, `core/timing.py`). `prepare_seconds` is the wall
time from `enable_aitune` until the object is tuned (enable + recording call + tuning calls): what a user waits
before the first tuned call, and the figure a warm start (a filled `cache_dir`) shortens.

Example (a tiny random pipeline; nothing is downloaded):

    import torch
    from aitune_hf import AITunePipeline, testing
    from aitune_hf.session import run_session

    pipe = AITunePipeline.from_pretrained(testing.build_pipeline("sd"))
    pipe.set_progress_bar_config(disable=True)
    kwargs = {**testing.default_call_kwargs("sd"), "output_type": "np"}

    def run():
        return pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images

    session = run_session(pipe, run, "blocks", backends=["onnxruntime"], rounds=3, call_kwargs=kwargs, say=print)
    print(session.report)  # led by the measured end-to-end speed-up
    print(session.passed, session.max_abs_diff, session.prepare_seconds)

Known blind spots: `run()` must be deterministic (a fixed seed, fixed inputs), or the check compares two
different calls; the eager and tuned calls are each timed once (use `measure_aitune` rounds, or the
benchmarks, for a latency to trust).

What the benchmarks and notebooks say about a session, named here so that they use the public API only:
`measure(reference, output)` (the quality figure of an output against eager's: PSNR, cosine, argmax, tokens;
`aitune_hf.core.quality`), `describe_machine()` (the CPU model and the flags that change kernels, for speed claims;
`aitune_hf.hardware`) and `details(report.to_dict())` (every candidate per target and input signature, as
`aitune-hf report --details` prints it). The timer is `aitune_hf.Stopwatch`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aitune_hf.core.config import DEFAULT_TOLERANCES
from aitune_hf.core.quality import QualityFigure, measure
from aitune_hf.core.timing import Stopwatch
from aitune_hf.hardware import describe as describe_machine

if TYPE_CHECKING:
    import numpy as np

    from aitune_hf.core.registration import Registration
    from aitune_hf.core.report import TuningReport

#: enable_aitune arguments named in the progress line "enable_aitune(...)" when given.
_SHOWN = ("backends", "strategy", "cache_dir", "cache", "precision", "quality")

__all__ = [
    "QualityFigure",
    "SessionResult",
    "compare",
    "describe_machine",
    "details",
    "format_counts",
    "measure",
    "run_session",
]


@dataclass
class SessionResult:
    """What one session did and measured. Seconds are wall time (`Stopwatch`); calls include their own eager
    work, so `prepare_seconds` is what a user waits, not what tuning alone costs (`report.tuning_seconds`)."""

    registration: Registration
    report: TuningReport  # taken after the measurement, so it holds the end-to-end line when rounds > 0
    targets: Any  # as passed to enable_aitune
    eager_output: np.ndarray  # the reference: the eager call's output, or the `reference` passed in
    tuned_output: np.ndarray
    eager_call_seconds: float | None  # None when the caller passed `reference` (no eager call was made)
    enable_seconds: float
    recording_call_seconds: float
    tuning_call_seconds: float  # every tuning call together
    tuning_calls: int
    tuned_call_seconds: float
    prepare_seconds: float  # enable + recording call + tuning calls: from enable_aitune until tuned
    #: Seconds from enable_aitune to the first call a tuned backend served, and to the final plan (anytime tuning: the
    #: search after the first plans ended, on the worker; `Registration.plan_seconds`); None where none was reached.
    first_tuned_seconds: float | None
    final_plan_seconds: float | None
    end_to_end: dict[str, Any] | None  # what measure_aitune returned; None without rounds, or when not all tuned
    max_abs_diff: float
    atol: float
    passed: bool
    #: With reduced precision (`precision=`), the check is the end-to-end quality budget, not fp32's atol: its figure
    #: ("PSNR 41.2 dB (>= 35)"); None for fp32.
    quality: str | None = None

    def facts(self) -> dict[str, Any]:
        """The session's numbers as JSON-ready facts (the CLI adds them to the report JSON)."""
        return {
            "targets": self.targets if isinstance(self.targets, str) else list(self.targets),
            "eager_call_seconds": self.eager_call_seconds,
            "recording_call_seconds": self.recording_call_seconds,
            "tuning_call_seconds": self.tuning_call_seconds,
            "tuning_calls": self.tuning_calls,
            "tuned_call_seconds": self.tuned_call_seconds,
            "prepare_seconds": self.prepare_seconds,
            "first_tuned_seconds": self.first_tuned_seconds,
            "final_plan_seconds": self.final_plan_seconds,
            "max_abs_diff": self.max_abs_diff,
            "atol": self.atol,
            "passed": self.passed,
            "check_quality": self.quality,  # the check's figure; "quality" is the report's own (the gate's)
        }


def run_session(
    obj: Any,
    run: Callable[[], Any],
    targets: Any = "blocks",
    *,
    say: Callable[[str], None] | None = None,
    inputs: str = "fixed inputs",
    reference: Any = None,
    max_extra_calls: int = 2,
    rounds: int = 0,
    call_kwargs: Mapping[str, Any] | None = None,
    **enable_kwargs: Any,
) -> SessionResult:
    """Eager call, enable_aitune, recording call, tuning call(s), tuned call, optional measurement, check.

    Args:
        obj: a pipeline or model with the aitune mixin, aitune not yet enabled.
        run: one whole call of `obj` with fixed inputs (a fixed seed), returning a numpy array (or what
            `numpy.asarray` takes).
        targets, enable_kwargs: passed to `obj.enable_aitune` (`backends=`, `cache_dir=`, `cache=`, any
            `TuningConfig` field, `tune_after_calls=None` to arm by `registration.tune()` here).
        say: called with each progress line (the lines `aitune-hf` prints); None: silent.
        inputs: how the progress lines name the inputs ("fixed seed" for a pipeline).
        reference: the eager output when the caller already has it; the eager call is then skipped.
        max_extra_calls: tuning calls beyond the first while some target has not reached a decision.
        rounds, call_kwargs: `obj.measure_aitune(**call_kwargs, rounds=rounds)` when rounds > 0 (a torch module
            is measured under `torch.inference_mode()`, as Transformers models are called).

    Errors raised by `run` or `enable_aitune` propagate; before `enable_aitune` nothing was changed, after it
    `obj` keeps its aitune registration (call `obj.disable_aitune()`).
    """
    import numpy as np

    say = say or (lambda text: None)
    eager_output, eager_call_seconds = _eager_reference(run, reference, inputs, say)
    with Stopwatch() as prepare:
        registration, enable_seconds = _enable(obj, targets, enable_kwargs, say)
        recording_seconds = _record(run, say)
        manual = "tune_after_calls" in enable_kwargs and enable_kwargs["tune_after_calls"] is None
        tuning_call_seconds, calls = _tune(registration, run, manual, max_extra_calls, say)
    say(
        f"tuning call: {tuning_call_seconds:.1f} s wall ({calls} call(s)); "
        f"states: {format_counts(registration.state_counts)}"
    )
    plans = _final_plan(registration, say)
    with Stopwatch() as tuned:
        tuned_output = np.asarray(run())
    say(f"tuned call ({inputs}): {tuned.seconds:.3f} s")
    end_to_end = _measure(obj, registration, rounds, call_kwargs, say)
    diff, atol, passed, quality = _check(obj, registration, eager_output, tuned_output)
    return SessionResult(
        registration=registration,
        report=registration.report(),
        targets=targets,
        eager_output=eager_output,
        tuned_output=tuned_output,
        eager_call_seconds=eager_call_seconds,
        enable_seconds=enable_seconds,
        recording_call_seconds=recording_seconds,
        tuning_call_seconds=tuning_call_seconds,
        tuning_calls=calls,
        tuned_call_seconds=tuned.seconds,
        prepare_seconds=prepare.seconds,
        first_tuned_seconds=plans["first_tuned_s"],
        final_plan_seconds=plans["final_plan_s"],
        end_to_end=end_to_end,
        max_abs_diff=diff,
        atol=atol,
        passed=passed,
        quality=quality,
    )


# -- the steps of a session --------------------------------------------------------------------------------------------


def _eager_reference(
    run: Callable[[], Any], reference: Any, inputs: str, say: Callable[[str], None]
) -> tuple[Any, float | None]:
    """The eager output as an array, and the seconds of the eager call (None when the caller gave `reference`)."""
    import numpy as np

    if reference is not None:
        return np.asarray(reference), None
    with Stopwatch() as watch:
        reference = run()
    say(f"eager call ({inputs}): {watch.seconds:.3f} s")
    return np.asarray(reference), watch.seconds


def _enable(obj: Any, targets: Any, enable_kwargs: Mapping[str, Any], say: Callable[[str], None]) -> tuple[Any, float]:
    """`obj.enable_aitune(targets, **enable_kwargs)`, said with the targets it found; (registration, seconds)."""
    with Stopwatch() as enable:
        registration = obj.enable_aitune(targets, **enable_kwargs)
    shown = "".join(f", {k}={enable_kwargs[k]!r}" for k in _SHOWN if enable_kwargs.get(k) is not None)
    say(f"enable_aitune(targets={targets!r}{shown}): {len(registration.targets)} target(s)")
    for name, target in registration.targets.items():
        say(f"  {name} ({type(target.module).__name__})")
    return registration, enable.seconds


def _record(run: Callable[[], Any], say: Callable[[str], None]) -> float:
    """The recording call: targets run eager and record their inputs. Its seconds."""
    with Stopwatch() as recording:
        run()
    say(f"recording call: {recording.seconds:.3f} s (targets run eager and record their inputs; tuning is now armed)")
    return recording.seconds


def _tune(
    registration: Any, run: Callable[[], Any], manual: bool, max_extra_calls: int, say: Callable[[str], None]
) -> tuple[float, int]:
    """Tuning calls: one, and up to `max_extra_calls` more while some target has not decided or more calls will tune
    (`Registration.settling`: the blocks a descent added; `manual`: armed here by `registration.tune()`). Their seconds
    together, and how many."""
    say("tuning: in the next call each target builds, checks and times its candidates inside the call's own flow")
    seconds, calls = 0.0, 0
    while calls == 0 or ((not registration.all_tuned or registration.settling) and calls <= max_extra_calls):
        if manual and not any(t.armed for t in registration.targets.values()):
            registration.tune()
        with Stopwatch() as tuning:
            run()
        seconds, calls = seconds + tuning.seconds, calls + 1
        if not registration.all_tuned or registration.settling:  # what the call left to the worker (a descent's blocks)
            registration.wait()
    return seconds, calls


def _final_plan(registration: Any, say: Callable[[str], None]) -> dict[str, float | None]:
    """Wait for the work left on the worker (the search after first plans: anytime tuning), and say when the first tuned
    call and the final plan came (`Registration.plan_seconds`)."""
    if registration.searching:
        say(f"waiting for the search after the first plan(s) on the worker ({registration.searching} decision(s)) ...")
    registration.wait()
    plans = registration.plan_seconds
    if plans["first_tuned_s"] is not None:
        final = "" if plans["final_plan_s"] is None else f", final plan after {plans['final_plan_s']:.1f} s"
        say(f"plans: first tuned call {plans['first_tuned_s']:.1f} s after enable_aitune{final}")
    return plans


def _measure(
    obj: Any, registration: Any, rounds: int, call_kwargs: Mapping[str, Any] | None, say: Callable[[str], None]
) -> Any:
    """`obj.measure_aitune(...)` when `rounds` > 0 and every target decided; else None."""
    if rounds <= 0:
        return None
    if not registration.all_tuned:
        say(f"measuring skipped: not every target reached a decision ({format_counts(registration.state_counts)})")
        return None
    say(f"measuring: measure_aitune(rounds={rounds}), eager and tuned whole calls interleaved ...")
    with _inference(obj):
        return obj.measure_aitune(**(call_kwargs or {}), rounds=rounds)


def _check(obj: Any, registration: Any, eager_output: Any, tuned_output: Any) -> tuple[float, float, bool, str | None]:
    """(max abs difference, atol, passed, quality text): fp32 is held to `compare`'s atol; reduced precision to its
    end-to-end budget (`passed` then says whether the quality figure is within it)."""
    diff, atol, passed = compare(eager_output, tuned_output)
    if not registration.config.reduced:
        return diff, atol, passed, None
    # `run` returns bare arrays: say what they are (a pipeline's images are measured by PSNR, not cosine), as the
    # gate recorded it from the whole output, or from the object where nothing was gated.
    kind = (registration.quality or {}).get("kind")
    images = kind == "images" or (kind is None and hasattr(obj, "components") and hasattr(obj, "vae"))
    wrap = (lambda output: {"images": output}) if images else (lambda output: output)
    figure = measure(wrap(eager_output), wrap(tuned_output), registration.config.quality)
    return diff, atol, figure.passed, figure.text()


def compare(eager: Any, tuned: Any) -> tuple[float, float, bool]:
    """(max abs diff, atol, within atol) of two whole-call outputs.

    The whole-call output is held to the same per-dtype atol as each block's check (rtol 0); outputs of
    different shapes differ by infinity."""
    import numpy as np
    import torch

    eager, tuned = np.asarray(eager), np.asarray(tuned)
    if eager.shape != tuned.shape:
        return float("inf"), 0.0, False
    atol = DEFAULT_TOLERANCES.get(getattr(torch, str(eager.dtype), None), (1e-3, 0.0))[0]
    diff = float(np.max(np.abs(tuned.astype(np.float64) - eager.astype(np.float64)))) if eager.size else 0.0
    return diff, atol, bool(np.allclose(tuned, eager, atol=atol, rtol=0.0))


def format_counts(counts: Mapping[str, int]) -> str:
    """Target states as one line: "eager 1, tuned 12"."""
    return ", ".join(f"{state} {n}" for state, n in sorted(counts.items()))


def _inference(obj: Any) -> Any:
    """Models (torch modules) are measured under inference_mode, as they are called; pipelines run under
    no_grad themselves."""
    import torch

    return torch.inference_mode() if isinstance(obj, torch.nn.Module) else contextlib.nullcontext()


def details(data: dict[str, Any]) -> str:
    """Per target and input signature: every candidate with its speed-up, error and build time; under an error
    (or a reason) caused by an exception, its full text with every chained cause."""
    lines = ["candidates per target and input signature:"]
    for name, module in (data.get("modules") or {}).items():
        for sig in module.get("signatures") or []:
            shared = f", decision shared with {sig['shared_from']}" if sig.get("shared_from") else ""
            shared += f", decision from cache entry {sig['from_cache']}" if sig.get("from_cache") else ""
            lines.append(f"{name} [{sig.get('signature')}] -> {sig.get('chosen')}{shared}")
            if sig.get("reason"):
                lines.append(f"    reason: {sig['reason']}")
                lines.extend(_indented(sig.get("details")))
            for cand in sig.get("candidates") or []:
                if cand.get("error"):
                    lines.append(f"    {cand.get('backend')}: {cand['error']}")
                    lines.extend(_indented(cand.get("details")))
                    continue
                speedup = cand.get("speedup")
                err = cand.get("max_abs_error")
                seconds = ", ".join(
                    f"{phase} {_seconds(cand.get(f'{phase}_seconds'))}" for phase in ("build", "check", "timing")
                )
                lines.append(
                    f"    {cand.get('backend')}: "
                    f"{'-' if speedup is None else f'{speedup:.2f}x'}, "
                    f"max err {'-' if err is None else f'{err:.1e}'}, {seconds}"
                    + (" (built from an identical module's export)" if cand.get("reused") else "")
                )
    return "\n".join(lines)


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _indented(text: Any) -> list[str]:
    """The full error text behind a reason (every chained cause), indented under it; nothing when absent."""
    if not text:
        return []
    return ["        " + line if line.strip() else "" for line in str(text).splitlines()]
