"""`register(modules, config) -> Registration`: the explicit-registration entry point of the core."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from aitune_hf.backends.base import Backend, warm_build_process
from aitune_hf.core.background import BackgroundTuner
from aitune_hf.core.cache import TuningCache, open_cache
from aitune_hf.core.config import TuningConfig
from aitune_hf.core.context import CallNotes, Progress, TuningContext
from aitune_hf.core.precision import with_precisions
from aitune_hf.core.quality import QualityFigure, measure
from aitune_hf.core.refine import Refinement
from aitune_hf.core.report import ModuleReport, TuningReport
from aitune_hf.core.strategy import Strategy, resolve_strategy
from aitune_hf.core.target import Target, TargetState
from aitune_hf.core.timing import Stopwatch, clock
from aitune_hf.errors import InputTypeError, UsageError, UserInputError

logger = logging.getLogger(__name__)

#: Every module that a live registration holds, and the target that holds it. Weak: nothing is kept alive.
_HELD: weakref.WeakKeyDictionary[torch.nn.Module, Target] = weakref.WeakKeyDictionary()


def get_target(module: torch.nn.Module) -> Target | None:
    """The target that holds `module` in a live registration (its `state`, `reason`, `report()`, `calls_served`),
    or None where no registration holds it (never registered, or detached), as Diffusers finds a module's hooks
    from the module itself: `get_target(pipe.unet.mid_block).state`."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"get_target takes a torch.nn.Module, got {type(module).__name__}: {module!r:.80}")
    return _HELD.get(module)


def register(
    modules: Mapping[str, torch.nn.Module] | Iterable[torch.nn.Module] | torch.nn.Module,
    config: TuningConfig | Mapping[str, Any] | None = None,
) -> Registration:
    """Register modules for tuning and install their forward routers (all or nothing).

    Args:
        modules: a mapping of name -> module (names appear in reports) or an iterable of modules. An
            `nn.ModuleList` / `nn.Sequential` given as one item registers its elements.
        config: a `TuningConfig`, a dict of its fields, or None for defaults.

    Raises:
        TypeError: an item is not an `nn.Module`.
        ValueError: nothing to register, a module nested inside another, a module already held by another
            live registration, or an unknown backend / strategy name.
        RuntimeError: the strategy needs a backend that is unavailable here.
    """
    return Registration(_collect(modules), TuningConfig.coerce(config))


def _collect(modules: Any) -> dict[str, torch.nn.Module]:
    """Name -> module, containers expanded, duplicates dropped (first name kept), input order kept."""
    if isinstance(modules, torch.nn.ModuleList | torch.nn.Sequential):
        modules = {"": modules}  # one container given alone: its elements, named by index
    items: list[tuple[str, Any]]
    if isinstance(modules, torch.nn.Module):
        items = [(type(modules).__name__, modules)]
    elif isinstance(modules, Mapping):
        items = list(modules.items())
    elif isinstance(modules, Iterable) and not isinstance(modules, str | bytes):
        items = [(str(index), module) for index, module in enumerate(modules)]
    else:
        raise InputTypeError(
            f"register() takes a mapping of name -> nn.Module or an iterable of nn.Module, got {type(modules).__name__}"
        )
    collected: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()
    for name, module in items:
        if isinstance(module, torch.nn.ModuleList | torch.nn.Sequential):
            prefix = f"{name}." if name else ""
            children = [(f"{prefix}{child_name}", child) for child_name, child in module.named_children()]
        else:
            children = [(str(name), module)]
        for child_name, child in children:
            if not isinstance(child, torch.nn.Module):
                raise InputTypeError(
                    f"cannot register {child_name!r}: expected an nn.Module, got "
                    f"{type(child).__name__}. Pass modules (or a mapping of name -> module)."
                )
            if id(child) in seen:
                continue
            if child_name in collected:
                raise UserInputError(f"two different modules are named {child_name!r}; give each a unique name")
            seen.add(id(child))
            collected[child_name] = child
    if not collected:
        raise UserInputError("nothing to register: pass at least one nn.Module")
    return collected


class Registration:
    """A set of registered targets with one config: arm tuning, read states and reports, detach.

    Usable as a context manager: leaving the `with` block detaches.
    """

    _aitune_guard_opaque = True  # guards compare it by identity, never its state

    def __init__(self, modules: dict[str, torch.nn.Module], config: TuningConfig) -> None:
        self.config = config
        strategy: Strategy = resolve_strategy(config.strategy)
        self._check_free(modules)
        self._check_not_nested(modules)
        devices = frozenset(t.device for m in modules.values() for t in [*m.parameters(), *m.buffers()])
        devices = devices or frozenset({torch.device("cpu")})
        strategy.validate(config, devices)
        candidates, precisions = with_precisions(strategy.candidates(config), config, devices)
        skipped = [(f"{precision} variants", why, precision) for precision, why in precisions]
        if config.background:  # only what builds from a private copy may build while the module serves
            skipped += [(b.describe(), _LIVE_BUILD, b.precision) for b in candidates if not b.builds_privately]
            candidates = [b for b in candidates if b.builds_privately]
            for backend in candidates:  # what their builds import, imported now, not while calls are served
                backend.prepare()
        imports = {name for backend in candidates for name in backend.build_process_imports}
        if imports and (config.background or config.anytime):  # builds on the worker go to the build process
            classes = {type(sub).__module__ for module in modules.values() for sub in module.modules()}
            warm_build_process(["aitune_hf.backends.onnx.worker", *sorted(imports), *sorted(classes)])
        self._modules = dict(modules)
        self._detached = False
        self._final_report: TuningReport | None = None
        self._local = threading.local()  # bypass() is per thread: other threads keep being served
        cache, unusable = open_cache(config)
        #: Why the cache asked for is not used (it could not be opened), or None.
        self.cache_unusable = unusable
        self._context = TuningContext(
            config=config,
            strategy=strategy,
            candidates=candidates,
            progress=Progress(self._pending_count, enabled=config.progress),
            bypassed=lambda: self.bypassed,
            bypass=self.bypass,
            served=self._served,
            cache=cache,
            skipped=skipped,
            background=BackgroundTuner(", ".join(list(modules)[:2])) if config.background else None,
            notes=lambda: getattr(self._local, "notes", None),
        )
        #: The worker of checks deferred off the callers' threads in the foreground (`worker`); made on first use.
        self._checker: BackgroundTuner | None = None
        self._checker_lock = threading.Lock()
        self._gate_lock = threading.Lock()  # one end-to-end gate at a time: each judges what its replay met
        #: The latest end-to-end quality gate (`gate`): what the report shows beside the speed-up.
        self.quality: dict[str, Any] | None = None
        self._context.worker = lambda: self.worker
        self._context.search = self._search
        self._context.quiet = self._quiet
        self._context.decided = self._decided
        self._context.started = clock()
        #: The searches after first plans (`core/refine.py`), in the order they were queued.
        self._searches: list[Refinement] = []
        self._targets = {name: Target(name, module, self._context) for name, module in modules.items()}
        #: Reports of targets that `descend()` replaced by targets inside them, by name.
        self.descended: dict[str, ModuleReport] = {}
        #: Names of the targets `descend()` added (`settling`).
        self._descended_into: list[str] = []
        #: End-to-end timings measured by the caller (the Hugging Face layer times whole pipeline calls).
        self.end_to_end: dict[str, Any] | None = None
        self._install_all()

    @property
    def strategy(self) -> Strategy:
        return self._context.strategy

    @property
    def candidates(self) -> list[Backend]:
        return list(self._context.candidates)

    def _pending_count(self) -> int:
        """Targets the progress bar waits for: armed or tuning, and called at least once (an armed target that is never
        called, such as a VAE's encoder stages in a text-to-image pipeline, would hold the bar open, short of its
        total, until detach)."""
        return sum(
            1 for t in self._targets.values() if t.state in (TargetState.ARMED, TargetState.TUNING) and not t.idle
        )

    # -- checks and installation --------------------------------------------------------------------
    @staticmethod
    def _check_free(modules: dict[str, torch.nn.Module]) -> None:
        for name, module in modules.items():
            holder = _HELD.get(module)
            if holder is not None:
                raise UserInputError(
                    f"module {name!r} ({type(module).__name__}) is already registered as "
                    f"{holder.name!r} by another live registration; call detach() on that "
                    f"registration (or disable_aitune()) first"
                )

    @staticmethod
    def _check_not_nested(modules: dict[str, torch.nn.Module], over: torch.nn.Module | None = None) -> None:
        """Targets may not nest, but for blocks that `descend(keep=True)` adds inside the target it keeps (`over`)."""
        owners: dict[int, str] = {}
        for name, module in modules.items():
            for sub in module.modules():
                if sub is not module:
                    owners.setdefault(id(sub), name)
        for name, module in modules.items():
            if id(module) in owners:
                raise UserInputError(
                    f"targets may not nest: {name!r} is inside {owners[id(module)]!r}; register one of the two"
                )
        inside_held = {
            id(sub): target.name
            for held, target in list(_HELD.items())
            if held is not over
            for sub in held.modules()
            if sub is not held
        }
        for name, module in modules.items():
            if id(module) in inside_held:
                raise UserInputError(
                    f"targets may not nest: {name!r} is inside {inside_held[id(module)]!r}, "
                    f"which another live registration holds; detach that registration first"
                )
            inner = next((t.name for sub in module.modules() if (t := _HELD.get(sub)) is not None), None)
            if inner is not None:
                raise UserInputError(
                    f"targets may not nest: {name!r} contains {inner!r}, which another live "
                    f"registration holds; detach that registration first"
                )

    def _install_all(self) -> None:
        self._install(list(self._targets.values()))
        logger.info("registered %d target(s): %s", len(self._targets), ", ".join(self._targets))

    @staticmethod
    def _install(targets: list[Target]) -> None:
        """Install every target or none."""
        installed: list[Target] = []
        try:
            for target in targets:
                target.install()
                installed.append(target)
                _HELD[target.module] = target
        except BaseException:
            for target in reversed(installed):
                target.uninstall()
                _HELD.pop(target.module, None)
            raise

    def descend(
        self, name: str, children: Mapping[str, torch.nn.Module], keep: bool = False, measure_only: bool = False
    ) -> list[Target]:
        """Add targets for modules inside target `name` (all or nothing); they start RECORDING, in order.

        For a target that did not win as a whole, its children are tried instead. Without `keep`, the old target is
        detached and its last report kept in `descended`; the new targets take its place. With `keep`, it stays, kept
        whole over its blocks (`Target.inner`): its routes that serve go on serving their shape families whole, and
        every other call runs its eager forward, where the new targets route their own calls; a shape family it meets
        later is tuned once its blocks have decided it, against them as they serve. Its routes are re-guarded with the
        blocks' routers in place (a route whose guard fails now is dropped). `measure_only` (implies `keep`): the target
        is kept over its blocks only to be measured against them (`Target.measure_only`: what it wins is reported, never
        served), and the blocks are targets of their own from the start, not a descent (`settling` does not wait for
        those never called).
        """
        keep = keep or measure_only
        if self._detached:
            raise UsageError("descend() after detach(): register the modules again")
        if name not in self._targets:
            raise UserInputError(f"no target named {name!r}; targets: {', '.join(self._targets)}")
        parent = self._targets[name]
        if keep and parent.inner:
            raise UserInputError(f"{name!r} is kept whole over its blocks already; descend() keeps it once")
        new_modules = _collect(dict(children))
        inside = {id(m) for m in parent.module.modules() if m is not parent.module}
        for child_name, module in new_modules.items():
            if id(module) not in inside:
                raise UserInputError(
                    f"{child_name!r} is not inside {name!r}; descend() takes modules inside the target"
                )
            if child_name in self._targets:
                raise UserInputError(f"a target named {child_name!r} exists already")
        new_targets = {
            child_name: Target(child_name, module, self._context) for child_name, module in new_modules.items()
        }
        if keep:
            self._check_free(new_modules)
            self._check_not_nested(new_modules, over=parent.module)
            with parent.regarding(list(new_targets.values())):  # re-guards its routes once the routers are in
                self._install(list(new_targets.values()))
            parent.measure_only = measure_only
            self._targets = _splice(self._targets, name, {name: parent, **new_targets})
            self._modules = _splice(self._modules, name, {name: parent.module, **new_modules})
            if not measure_only:
                self._descended_into += list(new_targets)
            return list(new_targets.values())
        report = parent.report()
        parent.uninstall()
        del _HELD[parent.module]
        try:
            self._check_free(new_modules)
            self._check_not_nested(new_modules)
            self._install(list(new_targets.values()))
        except BaseException:  # all or nothing: the parent goes back, as it was
            parent.install()  # back to RECORDING
            _HELD[parent.module] = parent
            raise
        self.descended[name] = report
        self._targets = _splice(self._targets, name, new_targets)
        self._modules = _splice(self._modules, name, new_modules)
        self._descended_into += list(new_targets)
        return list(new_targets.values())

    # -- public API ---------------------------------------------------------------------------------
    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        """Name -> registered module."""
        return dict(self._modules)

    @property
    def targets(self) -> dict[str, Target]:
        """Name -> Target (state, samples, routes)."""
        return dict(self._targets)

    @property
    def cache(self) -> TuningCache | None:
        """The persistent cache this registration reads (and writes), or None when it is off (docs/cache.md)."""
        return self._context.cache

    @property
    def reports(self) -> dict[str, ModuleReport]:
        """Name -> a fresh ModuleReport."""
        return {name: target.report() for name, target in self._targets.items()}

    @property
    def state_counts(self) -> dict[str, int]:
        """State name -> number of targets in it; targets never called are counted as "idle" (a VAE's encoder stages
        in a text-to-image pipeline), whatever their state."""
        return dict(collections.Counter("idle" if t.idle else str(t.state) for t in self._targets.values()))

    @property
    def all_tuned(self) -> bool:
        """True when every target that has been called has reached a decision (TUNED or EAGER), and one has. Idle
        targets (never called, such as a VAE's encoder stages in a text-to-image pipeline) are not waited for."""
        targets = self._targets.values()
        return any(t.decided for t in targets) and all(t.decided or t.idle for t in targets)

    @property
    def settling(self) -> bool:
        """True while a target that has been called is armed (it tunes at its next call), or one that `descend()` added
        has not been called yet (it records in the next whole call), or one kept over its blocks only to be measured
        has been called and not measured yet (it records once its blocks serve a call whole): more calls will tune.
        `all_tuned` does not wait for targets never called (a VAE's encoder stages), and so not for the blocks a descent
        just added."""
        targets = self._targets.values()
        return (
            any(t.armed and not t.idle for t in targets)
            or any(self._targets[name].idle for name in self._descended_into if name in self._targets)
            or any(t.measure_only and not t.idle and not t.decided for t in targets)
        )

    @property
    def detached(self) -> bool:
        return self._detached

    def tune(self, why: str = "tune() was called", off_thread: bool = False) -> Registration:
        """Arm tuning: each target tunes at its next forward call, inside the caller's own flow; with `off_thread`, on
        the worker instead, that call running eager (the Hugging Face layer arms so once every target was decided: no
        caller's call tunes after `all_tuned`). `why` is what the INFO log says when a target's tuning starts."""
        if self._detached:
            raise UsageError(
                "tune() after detach(): this registration no longer holds its modules; register them again"
            )
        for target in self._targets.values():
            target.arm(why, off_thread=off_thread)
        return self

    def _search(self, target: Target, refinement: Refinement) -> None:
        """Queue the search after `target`'s first plan on the worker (`core/refine.py`)."""
        if not any(search is refinement for search in self._searches):
            self._searches.append(refinement)
        self.worker.submit_search(
            f"the search after {target.name}'s first plan", functools.partial(target.refine_in_background, refinement),
            key=(refinement, refinement.steps),
        )  # fmt: skip

    def _decided(self) -> None:
        """A tuning ended: the first time every target that has been called has a decision, note when."""
        if self._context.first_served is None and self.all_tuned:
            self._context.first_served = clock()

    def _quiet(self) -> bool:
        """True when no target that has been called tunes or waits to tune, and nothing waits for the end-to-end
        gate. A target only measured (`Target.measure_only`) tunes on the worker, one job among the searches: it holds
        none of them back."""
        busy = (TargetState.ARMED, TargetState.TUNING)
        return (
            not any(t.state in busy and not t.idle and not t.measure_only for t in self._targets.values())
            and not self.waiting_for_gate
        )

    @property
    def searching(self) -> int:
        """Searches after first plans not ended yet (queued or running on the worker, `core/refine.py`): the plans that
        serve may still be replaced by faster ones. `wait()` waits for them."""
        return sum(search.state != "done" for search in self._searches)

    @property
    def plan_seconds(self) -> dict[str, float | None]:
        """Seconds from registration to the first tuned call (`first_tuned_s`: every target that had been called had a
        decision, so the next call is served by what tuning chose: the end of the call that tuned), and to the final
        plan (`final_plan_s`: the last search ended, or the last decision, when nothing is left to search; None while a
        search goes on or before any decision)."""
        context = self._context
        first = None if context.first_served is None else context.first_served - context.started
        ends = [search.ended_at for search in self._searches]
        final = None
        if first is not None and self.all_tuned and all(end is not None for end in ends):
            times = [context.first_served, context.decided_at, *ends]
            final = max(t for t in times if t is not None) - context.started
        return {"first_tuned_s": first, "final_plan_s": final}

    def observe_calls(self, observer: Callable[[str], None] | None) -> None:
        """Call `observer(target_name)` at the start of every routed call (in the calling thread), or stop with
        None. The Hugging Face layer arms tuning from it when an object's forwards are driven from elsewhere."""
        self._context.on_call = observer

    @property
    def bypassed(self) -> bool:
        """True inside `bypass()` in this thread: every target runs its original forward and records nothing."""
        return getattr(self._local, "paused", 0) > 0

    @contextlib.contextmanager
    def bypass(self) -> Iterator[None]:
        """Run the original forwards (no recording, no tuned backends) inside the block, in this thread only
        (other threads keep being served), e.g. to time eager or compute an eager reference."""
        self._local.paused = getattr(self._local, "paused", 0) + 1
        try:
            yield
        finally:
            self._local.paused -= 1

    @contextlib.contextmanager
    def _served(self) -> Iterator[None]:
        """Lift `bypass()` in this thread inside the block: a target kept whole over its blocks times its eager side
        with the blocks served, as they serve a call (`Target.inner`), while its references and builds run eager."""
        paused = getattr(self._local, "paused", 0)
        self._local.paused = 0
        try:
            yield
        finally:
            self._local.paused = paused

    @property
    def gate_required(self) -> bool:
        """True when reduced-precision decisions serve only after the end-to-end gate (`gate`); the Hugging Face
        layer sets it when it can replay whole calls. False (the core alone): the per-block filter suffices."""
        return self._context.gate_required

    @gate_required.setter
    def gate_required(self, value: bool) -> None:
        self._context.gate_required = bool(value)

    @property
    def background(self) -> BackgroundTuner | None:
        """The background tuner (`TuningConfig.background`): `pending`, `status()`, `wait()`; None in the foreground."""
        return self._context.background

    @property
    def worker(self) -> BackgroundTuner:
        """The thread that works off the callers' threads: the background tuner (`background`), or in the foreground
        one made on first use, that replays whole calls to check their new shapes and to gate them (`hf/gate.py`)."""
        if self._context.background is not None:
            return self._context.background
        with self._checker_lock:
            if self._checker is None:
                self._checker = BackgroundTuner(", ".join(list(self._modules)[:2]))
            return self._checker

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the work off the callers' threads is done (background tunings, deferred checks of new shapes
        and their gates): True, or False when `timeout` seconds passed first."""
        workers = [w for w in (self._context.background, self._checker) if w is not None]
        return all(worker.wait(timeout) for worker in workers)

    @contextlib.contextmanager
    def noting(self, defer: bool = False, replay: bool = False, gating: bool = False) -> Iterator[CallNotes]:
        """Note what this thread's calls meet inside the block (`CallNotes`: new shapes deferred with `defer`, routes
        waiting for the gate); `replay`: a replay of a whole call that checks its new shapes, and records and tunes
        nothing; `gating`: the gate's replay, where decisions waiting for the gate serve (a block the gate sent back
        to fp32 with no fp32 build to serve tunes again in it, as in any call)."""
        notes = CallNotes(defer=defer, replay=replay, gating=gating)
        prior = getattr(self._local, "notes", None)
        self._local.notes = notes
        worker = self._context.background or self._checker
        # A caller's call (not the worker's replays): the worker pauses while it runs (`BackgroundTuner.serving`).
        serving = worker.serving() if worker is not None and not replay and prior is None else contextlib.nullcontext()
        try:
            with serving:
                yield notes
        finally:
            self._local.notes = prior

    @property
    def replaying(self) -> bool:
        """True inside a replay of a whole call in this thread (a check of its new shapes, or the gate): boundaries
        reached in it are part of that call (a thread other than the caller's has no whole call of its own)."""
        notes = self._context.notes()
        return notes is not None and (notes.replay or notes.gating)

    @property
    def may_defer_new_shapes(self) -> bool:
        """True when the gate is required and a family route may meet a new shape: a whole call then keeps a copy of
        its inputs, so that the checks of its new shapes (and their gate) can run off the caller's thread."""
        return self._context.gate_required and any(t.covers_new_shapes for t in self._targets.values())

    @property
    def waiting_for_gate(self) -> bool:
        """True while a reduced-precision decision waits for the end-to-end gate."""
        return any(target.provisional() for target in self._targets.values())

    def gate(self, reference: Any, replay: Callable[[], Any], tunes: bool = True) -> QualityFigure | None:
        """The end-to-end quality gate of reduced precision.

        `reference` is a whole call's fp32 eager output; `replay()` makes the same call again. The call is replayed
        with every reduced-precision decision waiting for the gate serving, and its output compared with `reference`
        under `config.quality`, with the margin for calls the gate never sees (`core/quality.py`, `GATE_MARGIN`).
        While it fails, the waiting decision with the largest per-block error goes back to its fp32 fallback (or
        eager) and the call is replayed again; once it passes, the rest serve. Returns the last figure (None when
        nothing was waiting), kept in `quality` for the report. A block sent back with no fp32 build to serve tunes
        again in the next replay; with `tunes=False` (a gate off the callers' threads) it runs eager there, and tunes
        in a caller's next call of it.
        """
        with self._gate_lock:
            return self._gate(reference, replay, tunes)

    def _gate(self, reference: Any, replay: Callable[[], Any], tunes: bool) -> QualityFigure | None:
        waiting: list[tuple[Target, Any]] | None = None
        demoted: list[str] = []
        spent: list[float] = []  # each replay's seconds, less the tunings inside it (counted by their targets)

        def replayed(tuning: bool) -> tuple[Any, CallNotes]:
            with Stopwatch() as watch, self.noting(gating=True, replay=not tuning) as notes:
                output = replay()
            spent.append(max(watch.seconds - notes.tuned_s, 0.0))
            return output, notes

        stepping: set[str] = set()  # blocks sent down one precision (`Target.demote`): they tune in the next replay
        while True:
            output, notes = replayed(tunes)
            if waiting is None:  # what this call met is what its gate judges (others wait for a call that meets them)
                waiting = [(t, r) for t, r in notes.met if r.provisional]
                if not waiting:
                    return None
            elif stepping:  # what they chose when they tuned again in this replay is judged with the rest
                known = {id(route) for _, route in waiting}
                waiting += [(t, r) for t, r in notes.met if r.provisional and t.name in stepping and id(r) not in known]
                stepping.clear()
            figure = measure(reference, output, self.config.quality, gate=True)
            if figure.passed or not waiting:
                break
            target, route = max(waiting, key=lambda item: _rel_error(item[1]))
            if target.demote(route, figure.verdict()):
                stepping.add(target.name)
            elif route.new_shape_of is None:  # back to fp32 (a new shape's runs eager: its report says)
                demoted.append(target.name)
            waiting.remove((target, route))
            if not waiting and not (tunes and stepping):  # all back to fp32: the figure stays the last reduced one
                break
        for target, route in waiting:
            target.accept(route)
        if tunes and any(self._targets[name].armed for name in demoted if name in self._targets):
            # A block sent back with no fp32 build tunes in fp32 at its next call: this replay is that call, so the
            # call that tuned ends with every block decided (never left armed for a later request to tune).
            replayed(True)
        earlier = self.quality or {}  # the gates before this one (the tuning call's, then calls with new shapes)
        shown = dataclasses.asdict(figure)
        if earlier and not earlier["value"] > figure.value:  # the worst call gated is the one shown
            shown = {key: earlier.get(key) for key in shown}
        self.quality = {
            **earlier,
            **shown,
            "demoted": [*earlier.get("demoted", []), *demoted],
            "replays": earlier.get("replays", 0) + len(spent),
            "gates": earlier.get("gates", 0) + 1,
            "seconds": earlier.get("seconds", 0.0) + sum(spent),
        }
        logger.info("end-to-end quality gate: %s; %d block(s) back to fp32", figure.text(), len(demoted))
        return figure

    def report(self) -> TuningReport:
        """A TuningReport of every target, led by the end-to-end timings when the caller measured them; after
        `detach()`, the report as it stood then."""
        if self._final_report is not None:
            return self._final_report
        reports = self.reports
        return TuningReport(
            modules=reports,
            end_to_end=dict(self.end_to_end) if self.end_to_end else None,
            tuning_seconds=sum(r.tuning_seconds for r in [*reports.values(), *self.descended.values()])
            + (self.quality or {}).get("seconds", 0.0),  # the end-to-end quality gate's replays
            descended=dict(self.descended),
            cache=self.cache.stats.line() if self.cache is not None else None,
            quality=dict(self.quality) if self.quality else None,
            plans={**self.plan_seconds, "searching": self.searching} if self._context.first_served else None,
        )

    def detach(self) -> None:
        """Restore every forward exactly and release the modules. Safe to call twice."""
        if self._detached:
            return
        self._final_report = self.report()  # what it did, readable after the routes and samples are gone
        for target in self._targets.values():
            target.uninstall()
            if _HELD.get(target.module) is target:
                del _HELD[target.module]
        self._context.progress.close()
        for worker in (self._context.background, self._checker):
            if worker is not None:
                worker.stop()
        for search in self._searches:
            search.close()
        self._context.decisions.clear()
        self._context.on_call = None
        self._detached = True

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.state_counts.items()))
        return f"<Registration of {len(self._targets)} target(s): {counts}>"


_LIVE_BUILD = (
    "background tuning builds only from a private copy of the module (calls keep running on the live one); this "
    "backend compiles the live module (docs/serving.md)"
)


def _rel_error(route: Any) -> float:
    """A waiting route's relative error against eager (what the gate demotes by, largest first): measured at its new
    shape, or the chosen candidate's on the recorded calls."""
    if route.rel_error is not None:
        return route.rel_error
    report = route.report
    chosen = next((c for c in report.candidates if c.backend == report.chosen), None)
    return (chosen.rel_error or 0.0) if chosen is not None else 0.0


def _splice(table: dict[str, Any], name: str, replacement: dict[str, Any]) -> dict[str, Any]:
    """`table` with the entry `name` replaced by the entries of `replacement`, in place of it."""
    spliced: dict[str, Any] = {}
    for key, value in table.items():
        if key == name:
            spliced.update(replacement)
        else:
            spliced[key] = value
    return spliced
