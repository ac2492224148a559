"""`AITuneMixin`: enable_aitune / disable_aitune / aitune on pipelines and models, with call boundaries.

The mixin knows where a whole pipeline (or model) call begins and ends (`__call__`, and a model's `generate()`,
a VAE's `encode()` / `decode()`; calls nested in one of them are part of it), so it arms tuning after the first
full call by default (the second call then tunes inside the pipeline's own flow, with offload hooks live; which
call records, arms and tunes is `aitune_hf.hf.schedule`), and it times whole calls before and after tuning: the
report leads with that measured end-to-end speed-up.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import statistics
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from aitune_hf.backends.base import Backend, backend_names, default_backend_names
from aitune_hf.core.config import TuningConfig
from aitune_hf.core.quality import check_budget, output_kind
from aitune_hf.core.registration import Registration, register
from aitune_hf.core.strategy import Strategy
from aitune_hf.core.target import TargetState
from aitune_hf.core.timing import Stopwatch
from aitune_hf.errors import ConfigError, InputTypeError, UsageError
from aitune_hf.hf import copies
from aitune_hf.hf.gate import WholeCall
from aitune_hf.hf.hooks import install_slot_locators, weight_motion
from aitune_hf.hf.outputs import generates, output_kinds
from aitune_hf.hf.schedule import Schedule
from aitune_hf.hf.targets import FoundTarget, TargetSelection, as_modules, find_targets

logger = logging.getLogger(__name__)

#: Methods that are whole calls besides __call__: a Transformers model's generate() (every forward inside it
#: is one step of the same call), a VAE's encode() / decode() (how pipelines and users run a VAE). The dynamic
#: subclasses of `aitune_hf.hf.loading` route them to `AITuneMixin._aitune_call`.
BOUNDARY_METHODS = ("generate", "encode", "decode")


@dataclass
class _AITuneState:
    """What the mixin keeps per object: the registration, how it was made, its whole-call schedule, and whole-call
    timings."""

    _aitune_guard_opaque = True  # lives in a model's __dict__: guards compare it by identity, never its counters

    registration: Registration
    options: dict[str, Any]
    found: list[FoundTarget]
    schedule: Schedule  # which whole call records, arms, tunes (the quality gate: `hf/gate.py`)
    #: Whole-call seconds by what was called (`_call_key`): warm eager calls before tuning, tuned calls after. Only
    #: calls of the same inputs are compared (a 64-sentence batch is never set against a single query).
    eager_seconds: dict[str, list[float]] = field(default_factory=dict)
    tuned_seconds: dict[str, list[float]] = field(default_factory=dict)
    #: Inputs an eager call has had: the first call of given inputs (lazy initialisation, tokenizer and allocator
    #: caches) is cold and never a figure.
    first_seen: set[str] = field(default_factory=set)
    measured: bool = False  # end_to_end came from measure_aitune (interleaved), not from plain calls
    #: The boundary the latest whole call came through ("__call__", "encode", "generate", "decode"): what
    #: `measure_aitune()` times by default (a SentenceTransformer is used through encode(), not __call__).
    last_method: str = "__call__"
    #: The kinds of output its whole calls return (`hf/outputs.py`); None until the first whole call where the object
    #: does not say: that call's output is checked against the quality budget, and its kind kept here.
    kinds: frozenset[str] | None = None
    #: targets="auto": the targets of `found` that a descent need not look at again: components it gave their blocks
    #: to, those that hold none, and the blocks themselves (`AITuneMixin._aitune_descend`).
    looked_into: set[str] = field(default_factory=set)

    @property
    def calls(self) -> int:
        """Whole calls ended so far."""
        return self.schedule.calls


class AITuneMixin:
    """Adds aitune_hf to a Diffusers pipeline, a Transformers model or a Transformers pipeline."""

    @property
    def aitune(self) -> Registration | None:
        """The Registration (per-block state and reports): the live one, or after `disable_aitune()` the last one,
        detached (`.detached`; its `report()` is the report as it stood then); None before `enable_aitune()`."""
        state = self.__dict__.get("_aitune_state")
        return state.registration if state is not None else _last(self)

    def enable_aitune(
        self,
        targets: TargetSelection = "blocks",
        *,
        backends: Sequence[str | Backend] | None = None,
        strategy: str | Strategy | None = None,
        config: TuningConfig | Mapping[str, Any] | None = None,
        tune_after_calls: int | None = 1,
        component_backends: Sequence[str] | None = None,
        compare_whole: bool | str | Sequence[str] = False,
        **config_fields: Any,
    ) -> Registration:
        """Find the targets, register them with the tuning core, and return the Registration.

        Call it after placement and offload are set up. Args: `targets` is "blocks", "components", a list of
        dotted names or a callable; `backends`/`strategy`/other `TuningConfig` fields override `config`;
        `tune_after_calls` arms tuning after that many whole calls (None: call `self.aitune.tune()` yourself).

        `targets="auto"` tunes whole components first, with `component_backends` only (default: the ONNX runtimes
        installed, ONNX Runtime and OpenVINO: exports are quick; whole-component compiles are not); each component
        that stays eager on a shape family then gets its blocks as targets beneath it, which record in the next call
        and tune, with every backend, in the call after; the component serves whole the families where it beats them
        (docs/targets.md).

        `compare_whole=True` (with `targets="blocks"`): the blocks serve, and each component that holds blocks is also
        measured whole, in fp32 with `component_backends`, against its blocks as they serve, once they serve a call;
        the report says where the whole would have been faster ("whole would be faster: ...") or that it was not. The
        whole is never served: `targets="auto"` serves it. `compare_whole=["unet"]` (component names, or one name)
        measures those components only (each whole measurement is a build of its own); the others' blocks serve
        as with "blocks".

        Raises (before anything is registered or patched):
            ConfigError: a bad `tune_after_calls`, `component_backends` or `TuningConfig` field; a `quality` budget
                whose metric does not fit what this object returns (PSNR on embeddings; `hf/outputs.py`). Where the
                object does not say what it returns, the first whole call checks its output and raises this instead,
                with aitune disabled (every forward restored) before any tuning.
            UserInputError / InputTypeError: `targets` that do not resolve / of the wrong type.
            UsageError: aitune is already enabled here.
        """
        # Every argument is checked before anything is registered or patched: a bad value leaves nothing behind.
        if self.__dict__.get("_aitune_state") is not None:
            raise UsageError("aitune is already enabled here; call disable_aitune() first to change its settings")
        component_backends, compared = _check_arguments(targets, tune_after_calls, component_backends, compare_whole)
        tuning_config = _tuning_config(config, backends, strategy, config_fields)
        kinds = output_kinds(self)
        if kinds is not None:
            check_budget(tuning_config.quality, kinds, f"this {type(self).__name__}")
        auto = targets == "auto"
        found, registration = _register(
            self, targets, tuning_config, component_backends=component_backends, auto=auto, compared=compared
        )
        options = dict(
            targets=targets,
            backends=backends,
            strategy=strategy,
            config=config,
            tune_after_calls=tune_after_calls,
            component_backends=component_backends,
            compare_whole=compare_whole,
            **config_fields,
        )
        schedule = Schedule(registration, type(self).__name__, tune_after_calls, auto)
        self.__dict__["_aitune_state"] = _AITuneState(registration, options, found, schedule, kinds=kinds)
        _forget(self)
        registration.observe_calls(schedule.observe)
        logger.info("aitune enabled on %s: %d target(s)", type(self).__name__, len(found))
        return registration

    def disable_aitune(self) -> None:
        """Detach every target: each forward is restored exactly. Safe to call when not enabled. `self.aitune` stays
        the (detached) Registration, for its report."""
        state = self.__dict__.pop("_aitune_state", None)
        if state is not None:
            state.registration.detach()
            _remember(self, state.registration)

    def measure_aitune(self, *args: Any, rounds: int = 5, method: str | None = None, **kwargs: Any) -> dict[str, Any]:
        """Time whole calls eager and tuned, interleaved for `rounds`, and record the medians in the report.

        Call it once tuning is done (`self.aitune.all_tuned`) with the arguments of a typical call; each round makes
        one eager and one tuned call of `method`: by default the one this object was last called through (its
        `__call__`, or `encode()` for a SentenceTransformer or a VAE, `generate()` for a generative model, `decode()`).
        The result holds the medians, the speed-up, and its spread over the rounds (`speedup_range`, each round's
        eager / tuned): rounds whose ratios differ widely mean a noisy machine; measure again with more rounds.
        """
        from aitune_hf.errors import UserInputError

        state = self._aitune_state_or_raise()
        valid = ("__call__", *(name for name in BOUNDARY_METHODS if callable(getattr(self, name, None))))
        method = state.last_method if method is None else method
        if method not in valid:
            raise UserInputError(f"measure_aitune method must be one of {', '.join(valid)}, got {method!r}")
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
            raise UserInputError(f"measure_aitune rounds must be an int >= 1, got {rounds!r}")
        if not state.registration.all_tuned:
            raise UsageError(
                "measure_aitune() compares eager with tuned calls: call the pipeline until "
                f"aitune.all_tuned is True first (states now: {state.registration.state_counts})"
            )
        call = self._aitune_plain_call(method)
        eager, tuned = [], []
        with state.schedule.whole_call():  # generate()'s forwards inside are part of them, not counted
            for _ in range(rounds):
                with state.registration.bypass(), Stopwatch() as watch:
                    call(*args, **kwargs)
                eager.append(watch.seconds)
                with Stopwatch() as watch:
                    call(*args, **kwargs)
                tuned.append(watch.seconds)
        state.measured = True
        what = "whole calls" if method == "__call__" else f"{method}() calls"
        ratios = [e / t for e, t in zip(eager, tuned, strict=True) if t > 0]
        result = _record_end_to_end(state, eager, tuned, f"interleaved {what}, {rounds} rounds, medians")
        if ratios:
            result["speedup_range"] = [min(ratios), max(ratios)]
        return result

    # -- call boundaries (the dynamic subclass routes __call__ here) --------------------------------------
    def _aitune_call(self, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One whole call (`__call__`, `generate`, `encode`, `decode`). A boundary reached inside another one on
        the same thread (each forward of generate(), the decode() inside a VAE's forward) is part of it."""
        state: _AITuneState | None = self.__dict__.get("_aitune_state")
        if state is None or state.registration.detached or state.schedule.in_whole_call or state.registration.replaying:
            return call(*args, **kwargs)
        with state.schedule.whole_call():
            return self._aitune_whole_call(state, call, args, kwargs)

    def _aitune_whole_call(
        self, state: _AITuneState, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        registration = state.registration
        name = getattr(call, "__name__", "__call__")
        state.last_method = name if name in BOUNDARY_METHODS else "__call__"
        if self._aitune_needs_eager(kwargs):
            with registration.bypass():
                return call(*args, **kwargs)
        if registration.bypassed:  # an eager reference the caller asked for: not a whole call to count
            return call(*args, **kwargs)
        tuned_before = registration.all_tuned
        untouched = not any(t.armed or t.decided for t in registration.targets.values())
        with WholeCall(registration, call, args, kwargs), Stopwatch() as watch:  # the gate runs after the watch
            output = call(*args, **kwargs)
        if state.kinds is None:
            self._aitune_check_output(state, output)
        calls = state.schedule.call_ends()
        if not state.measured:
            key = functools.partial(_call_key, state.last_method, args, kwargs)
            _time_whole_call(state, key, watch.seconds, untouched=untouched, tuned_before=tuned_before)
        state.schedule.arm_after(calls, descend=functools.partial(self._aitune_descend, state))
        return output

    def _aitune_check_output(self, state: _AITuneState, output: Any) -> None:
        """The first whole call of an object that did not say what it returns: its output's kind is kept, and a quality
        budget that does not fit it is a `ConfigError`, raised with aitune disabled (every forward restored), before
        the schedule arms or gates anything."""
        kind = output_kind(output)
        try:
            check_budget(state.registration.config.quality, {kind}, f"the first {state.last_method}() of this "
                         f"{type(self).__name__}")  # fmt: skip
        except ConfigError as error:
            self.disable_aitune()
            raise ConfigError(f"{error}; aitune is disabled here, every forward restored") from None
        state.kinds = frozenset({kind})

    def _aitune_descend(self, state: _AITuneState) -> bool:
        """Auto mode, once every component is decided (the schedule calls it): each component that stayed eager on a
        shape family it met gets targets for its blocks, which record in the next whole call and tune after it. The
        component is kept whole over them (`Registration.descend(keep=True)`): the families it won go on serving
        whole, the others run its blocks, and a family met later serves whole only where the whole beats the blocks.

        Called again at the end of every later whole call (`Schedule.arm_after`): a component whose first plan served
        when every component was decided may be put back to eager by the search after it (anytime tuning: the plan
        timed fully on the worker, not faster than eager), and then descends as it would have. Components given their
        blocks, those that hold none, and the blocks are not looked at again (`looked_into`); the others cost a look at
        their routes. True where a component gave way to its blocks."""
        registration = state.registration
        waiting = {
            component.name
            for component in state.found
            if component.name not in state.looked_into
            and (target := registration.targets.get(component.name)) is not None
            and (target.state is TargetState.EAGER or any(r.built is None for r in target.routes))
        }
        if not waiting:
            return False
        blocks = find_targets(self, "blocks")
        new_found = []
        descended = False
        for component in list(state.found):
            target = registration.targets[component.name]
            inside = _blocks_inside(component, blocks) if component.name in waiting else []
            if not inside:
                if component.name in waiting:  # eager and holds no block: nothing to descend into, ever
                    state.looked_into.add(component.name)
                new_found.append(component)
                continue
            # Kept eager for good (weights that move inside it, a hook): its blocks replace it, as nothing of it serves.
            keep = target.pinned_reason is None
            logger.info("auto: %s stayed eager as a whole%s; its %d block(s) %s", component.name,
                        " on a shape family" if keep else "", len(inside),
                        "beneath it" if keep else "replace it")  # fmt: skip
            registration.descend(component.name, as_modules(inside), keep=keep)
            _apply_weight_motion(registration, inside)
            new_found += [component, *inside] if keep else inside
            state.looked_into.update([component.name, *(block.name for block in inside)])
            descended = True
        state.found = new_found
        return descended

    def _aitune_needs_eager(self, kwargs: dict[str, Any]) -> bool:
        """Calls that capture outputs from inside blocks (attention weights) must run every block eager."""
        if kwargs.get("output_attentions"):
            return True
        for owner in (self, getattr(self, "model", None)):
            if getattr(getattr(owner, "config", None), "output_attentions", False) is True:
                return True
        return False

    def _aitune_plain_call(self, method: str = "__call__") -> Callable[..., Any]:
        """The concrete class's own `method` (a whole call), without the mixin's call bookkeeping."""
        return getattr(super(type(self), self), method)

    def _aitune_state_or_raise(self) -> _AITuneState:
        state = self.__dict__.get("_aitune_state")
        if state is None:
            raise UsageError("aitune is not enabled here; call enable_aitune() first")
        return state

    # -- copies (copy.copy / copy.deepcopy / pickle / torch.save) ----------------------------------------
    def __reduce_ex__(self, protocol: Any) -> Any:
        """Reduce to the concrete class without the aitune state: a copy or a pickle is untuned and eager.

        The dynamic aitune subclass cannot be imported, and the Registration (targets, built backends, ONNX
        Runtime sessions) must never serve a copy; the forward routers in the modules reduce to the eager
        forwards. A reduction whose form cannot be rewritten safely raises `UsageError` naming disable_aitune().
        """
        return copies.reduce_ex(self, protocol, AITuneMixin.__reduce_ex__)

    def __copy__(self) -> Any:
        """A shallow copy of the concrete class, untuned (its components are the same module objects)."""
        return copies.reconstruct(self, None, AITuneMixin.__reduce_ex__)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A deep copy of the concrete class, untuned: every block of the copy runs its eager forward."""
        duplicate = copies.reconstruct(self, memo, AITuneMixin.__reduce_ex__)
        if "_aitune_state" in self.__dict__:
            copies.drop_eager_forwards(duplicate)
        return duplicate

    def _aitune_component_replaced(self, name: str) -> None:
        """A component was re-assigned (`pipe.unet = x`): register the new one in its place."""
        state: _AITuneState | None = self.__dict__.get("_aitune_state")
        if state is None or not any(found.name.split(".")[0] == name for found in state.found):
            return
        logger.info("component %r replaced: re-registering aitune targets", name)
        self.disable_aitune()
        options = dict(state.options)
        self.enable_aitune(options.pop("targets"), **options)


#: The last Registration of each object after `disable_aitune()` (for `obj.aitune.report()`), kept beside the object
#: rather than in it, so that copies and pickles of the object never carry it. Weak: it lives as long as the object.
_DETACHED: weakref.WeakKeyDictionary[Any, Registration] = weakref.WeakKeyDictionary()


def _remember(obj: Any, registration: Registration) -> None:
    with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced or hashed keeps none
        _DETACHED[obj] = registration


def _forget(obj: Any) -> None:
    with contextlib.suppress(TypeError):
        _DETACHED.pop(obj, None)


def _last(obj: Any) -> Registration | None:
    try:
        return _DETACHED.get(obj)
    except TypeError:
        return None


#: What auto mode adds for a generative model whole: its calls hold the KV cache, which ONNX Runtime cannot
#: take, and one compiled forward per token beats a compiled call per block (each pays Dynamo's guards on the
#: cache): benchmarks/results/generation.md.
_GENERATIVE_BACKENDS = frozenset({"inductor"})


def _check_arguments(
    targets: Any, tune_after_calls: Any, component_backends: Any, compare_whole: Any = False
) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    """Check `enable_aitune`'s own arguments (the config's fields are checked by `TuningConfig`); returns
    `component_backends` as a tuple, and the components `compare_whole` names: () for every one that holds blocks,
    None for none."""
    if isinstance(compare_whole, str):
        compare_whole = [compare_whole]
    if not isinstance(compare_whole, bool) and not (
        isinstance(compare_whole, Sequence)
        and compare_whole
        and all(isinstance(name, str) and name for name in compare_whole)
    ):
        raise ConfigError(
            f"enable_aitune compare_whole must be True, False or component names (a non-empty list of str), "
            f"got {compare_whole!r:.80}"
        )
    if compare_whole is not False and not (isinstance(targets, str) and targets == "blocks"):
        raise ConfigError(
            f"enable_aitune compare_whole={compare_whole!r:.40} measures components against their blocks: it needs "
            f"targets='blocks', got targets={targets!r:.60} ('auto' serves the whole where it wins)"
        )
    compared = None if compare_whole is False else () if compare_whole is True else tuple(compare_whole)
    if tune_after_calls is not None and (
        not isinstance(tune_after_calls, int) or isinstance(tune_after_calls, bool) or tune_after_calls < 1
    ):
        raise ConfigError(f"enable_aitune tune_after_calls must be an int >= 1 or None, got {tune_after_calls!r}")
    if component_backends is None:
        component_backends = tuple(name for name in default_backend_names() if name != "inductor")
    if isinstance(component_backends, str):
        component_backends = (component_backends,)
    if (
        not isinstance(component_backends, Sequence)
        or not component_backends
        or not all(isinstance(name, str) and name in backend_names() for name in component_backends)
    ):
        raise ConfigError(
            f"enable_aitune component_backends must be a non-empty list of backend names "
            f"({', '.join(backend_names())}), got {component_backends!r}"
        )
    if not (isinstance(targets, str | Sequence) or callable(targets)):
        raise InputTypeError(
            f"enable_aitune targets must be 'blocks', 'components', 'auto', a list of dotted module names or "
            f"a callable, got {type(targets).__name__}: {targets!r:.60}"
        )
    return tuple(component_backends), compared


def _tuning_config(
    config: TuningConfig | Mapping[str, Any] | None,
    backends: Sequence[str | Backend] | None,
    strategy: str | Strategy | None,
    config_fields: dict[str, Any],
) -> TuningConfig:
    """`config` with `backends`, `strategy` and the other fields given to `enable_aitune` put over it."""
    base = TuningConfig.coerce(config)
    overrides = {k: v for k, v in {"backends": backends, "strategy": strategy}.items() if v is not None}
    overrides.update(config_fields)
    return TuningConfig.coerce({**_fields(base), **overrides}) if overrides else base


def _register(
    obj: Any,
    targets: TargetSelection,
    config: TuningConfig,
    *,
    component_backends: tuple[str, ...],
    auto: bool = False,
    compared: tuple[str, ...] | None = None,
) -> tuple[list[FoundTarget], Registration]:
    """Find the targets of `obj` and register them, all or nothing, with the restrictions of offload hooks. `auto`
    registers whole components, each tried with `component_backends` only; `compared` (blocks with `compare_whole`:
    the components it names, () for every one) goes to `_register_compared`, which measures them with those."""
    install_slot_locators()
    if compared is not None:
        return _register_compared(obj, config, component_backends, compared)
    found = find_targets(obj, "components" if auto else targets)
    registration = register(as_modules(found), config)
    try:
        _apply_weight_motion(registration, found)
        _mark_whole(registration, found if auto or targets == "components" else [])
        for component in found if auto else ():
            allowed = set(component_backends) | (_GENERATIVE_BACKENDS if generates(component.module) else set())
            reason = f"auto mode tries whole components with {', '.join(sorted(allowed))} only"
            registration.targets[component.name].restrict(
                lambda backend, allowed=allowed: backend.name in allowed, reason
            )
    except BaseException:
        registration.detach()  # all or nothing: no target stays patched when enabling fails
        raise
    return found, registration


def _register_compared(
    obj: Any, config: TuningConfig, backends: tuple[str, ...], names: tuple[str, ...] = ()
) -> tuple[list[FoundTarget], Registration]:
    """`targets="blocks"` with `compare_whole`: every block a target, as with "blocks"; each component that holds
    blocks (of `names`, where given) registered too and kept whole over them (`Registration.descend(keep=True)`) only to
    be measured (`Target.measure_only`), in fp32, with `backends`. A component whose weights move inside it (an offload
    hook) is not measured: its blocks take its place, as in auto mode. A name that is no component holding blocks is a
    `ConfigError` naming those that are, before anything is registered."""
    blocks = find_targets(obj, "blocks")
    held = {c.name: (c, inside) for c in find_targets(obj, "components") if (inside := _blocks_inside(c, blocks))}
    unknown = [name for name in names if name not in held]
    if unknown:
        raise ConfigError(
            f"enable_aitune compare_whole names {', '.join(map(repr, unknown))}, not a component that holds blocks "
            f"here; valid: {', '.join(map(repr, held)) or 'none'}"
        )
    if names:
        held = {name: held[name] for name in held if name in names}
    components = [component for component, _ in held.values()]
    taken = {id(b) for _, inside in held.values() for b in inside}
    loose = [b for b in blocks if id(b) not in taken]
    registration = register(as_modules([*components, *loose]), config)
    found: list[FoundTarget] = []
    try:
        _apply_weight_motion(registration, [*components, *loose])
        _mark_whole(registration, components)
        allowed = set(backends)
        reason = f"compare_whole measures whole components in fp32 with {', '.join(sorted(allowed))} only"
        for component, inside in held.values():
            target = registration.targets[component.name]
            keep = target.pinned_reason is None
            if keep:
                target.restrict(lambda b: b.name in allowed and b.precision == "fp32", reason)
            registration.descend(component.name, as_modules(inside), measure_only=keep)
            _apply_weight_motion(registration, inside)
            found += [component, *inside] if keep else inside
    except BaseException:
        registration.detach()  # all or nothing
        raise
    return [*found, *loose], registration


def _mark_whole(registration: Registration, components: list[FoundTarget]) -> None:
    """Mark the targets of whole components (`targets="components"`, "auto"; a VAE's encoder and decoder each one) as
    whole models (`Target.whole`: anytime tuning tries quick builds first on them)."""
    for component in components:
        registration.targets[component.name].whole = True


def _blocks_inside(component: FoundTarget, blocks: list[FoundTarget]) -> list[FoundTarget]:
    """The blocks among `blocks` that sit inside `component` (one walk of its modules)."""
    modules = {id(m) for m in component.module.modules()}
    return [b for b in blocks if id(b.module) in modules]


def _fields(config: TuningConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in TuningConfig.__dataclass_fields__}


def _apply_weight_motion(registration: Registration, found: list[FoundTarget]) -> None:
    for target in found:
        inside, around = weight_motion(target.component, target.path)
        if inside:
            registration.targets[target.name].pin_eager(inside)
        elif around:
            registration.targets[target.name].restrict(
                lambda backend: not backend.bakes_weights, f"{around}; a backend that bakes weights would go stale"
            )


def _call_key(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """What makes two whole calls comparable: the method, the inputs' structure, tensors by shape, dtype and device,
    plain values (a prompt, a sentence, a step count) by value, other objects (a generator, an image) by type."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts = [
        (tuple(leaf.shape), str(leaf.dtype), str(leaf.device)) if isinstance(leaf, torch.Tensor)
        else leaf if isinstance(leaf, str | int | float | bool | type(None))
        else type(leaf).__qualname__
        for leaf in leaves
    ]  # fmt: skip
    return hashlib.sha1(repr((method, str(spec), parts)).encode()).hexdigest()[:16]


#: The latest seconds kept per inputs and side for the end-to-end line (a service repeating one input for days keeps
#: these, not every call's).
_TIMES_KEPT = 64


def _time_whole_call(
    state: _AITuneState, key: Callable[[], str], seconds: float, *, untouched: bool, tuned_before: bool
) -> None:
    """Keep a whole call's seconds under its inputs (`key()`, computed only for a call that may be kept: the recording
    and tuning calls in between pay nothing) for the end-to-end line: as eager where no target was armed or decided
    when it began, warm calls only (the first call of given inputs, lazy initialisation and cold caches, is never
    compared: skipping only the very first call once set a cold query against warm tuned ones, 3.6x on 1.1x); as
    tuned where every target was decided before and after it. The line compares calls of the same inputs only, those
    timed most on both sides; where no tuned call had the inputs of a warm eager one, it says so and claims no figure
    (nor a payback)."""
    if untouched:
        inputs = key()
        if inputs not in state.first_seen:
            state.first_seen.add(inputs)
            return
        times = state.eager_seconds.setdefault(inputs, [])
    elif tuned_before and state.registration.all_tuned and state.eager_seconds:
        inputs = key()
        if inputs not in state.eager_seconds:  # never compared, so never kept: a service's every new sentence would be
            if not state.tuned_seconds:
                state.registration.end_to_end = {
                    "method": "no tuned whole call had the inputs of a warm eager one (calls of different inputs are "
                    "not compared); measure_aitune() times one"
                }
            return
        times = state.tuned_seconds.setdefault(inputs, [])
    else:  # a tuned call with no warm eager one to compare with needs no key (hashing the inputs costs a call 0.1 ms)
        return
    times.append(seconds)
    del times[:-_TIMES_KEPT]
    if not state.tuned_seconds:
        return
    both = list(state.tuned_seconds)  # each has eager seconds
    best = max(both, key=lambda k: min(len(state.eager_seconds[k]), len(state.tuned_seconds[k])))
    eager, tuned = state.eager_seconds[best], state.tuned_seconds[best]
    method = f"whole calls of the same inputs: {len(eager)} warm before tuning (recording), {len(tuned)} after; medians"
    if len(state.eager_seconds) > 1:
        method += (
            f" (of {len(state.eager_seconds)} distinct inputs timed warm before tuning, {len(both)} timed after; the "
            "most timed one shown)"
        )
    _record_end_to_end(state, eager, tuned, method)


def _record_end_to_end(state: _AITuneState, eager: list[float], tuned: list[float], method: str) -> dict[str, Any]:
    eager_s, tuned_s = statistics.median(eager), statistics.median(tuned)
    result = {"eager_s": eager_s, "tuned_s": tuned_s, "speedup": eager_s / tuned_s, "method": method}
    state.registration.end_to_end = result
    return result
