"""What every replica of a deployment needs: load, enable from a shared cache read-only, warm at start, and a health
view. The Ray Serve and Ray Data recipes in docs/serving.md use it; nothing here imports ray.

"Tune once": a tuning job fills a cache for the shapes the service will see (`aitune-hf tune ... --cache-dir URL`, or
`Replica(..., cache="rw")` on one machine of the replicas' kind), and every replica starts warm from it:

    from aitune_hf.serving import Replica

    replica = Replica(
        load=lambda: SentenceTransformer("/models/all-MiniLM-L6-v2", device="cpu"),
        warm=lambda model: model.encode(["a sentence of the length the service sees"] * 32, batch_size=32),
        cache_dir="s3://bucket/aitune",  # read-only by default: replicas never write
    )
    replica.obj.encode(texts)  # the loaded object, tuned
    replica.health()           # tuned and eager counts, decisions from the cache vs tuned here, seconds

At start, `warm` is called `warm_calls` times (default 2: the first records what each block is called with and arms
tuning, the second tunes). With `background=True` (the default here), tuning runs on a worker thread: the replica
waits while decisions come from the cache (each block's cached winner is built alone, from its artifact, and checked
against eager: seconds), and stops waiting as soon as a block has to be tuned afresh (a cache miss): it then serves at
eager speed at once, and each block switches to its decision when it is made. No request waits for a tuning.

A cache that cannot be used (an unreachable URL, a protocol whose fsspec package is missing, a read-only folder)
never stops a replica from starting: it tunes locally (or serves eager), and `health()["cache"]` says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aitune_hf.core.timing import Stopwatch
from aitune_hf.errors import InputTypeError, UsageError
from aitune_hf.hf.loading import enable_aitune

logger = logging.getLogger(__name__)


class Replica:
    """One replica of a deployment: the loaded object with aitune enabled, warmed, and its health.

    Args:
        load: makes the object to serve (a Diffusers pipeline, a Transformers model, a SentenceTransformer, any
            `nn.Module` holding one); called once.
        warm: one request's worth of work on the object (called `warm_calls` times at start); None: no warm-up
            (tuning then happens on the first requests: in the background by default).
        targets, enable_options: passed to `enable_aitune` (`backends=`, `precision=`, any `TuningConfig` field).
        cache_dir: the shared cache (a folder or an fsspec URL); None: `AITUNE_HF_CACHE`, else the user cache.
        cache: "ro" (default: read, never write), "rw" (a tuning job filling the cache), or "off".
        background: tune on a worker thread (default: True), so that no request waits for a tuning.
        wait_s: at start, how long to wait at most for decisions from the cache (background mode).
        warm_calls: how many times `warm` is called (record, then tune).

    Raises what `load`, `warm` and `enable_aitune` raise (a bad option is a `ConfigError` before anything loads).
    """

    def __init__(
        self,
        load: Callable[[], Any],
        warm: Callable[[Any], Any] | None = None,
        *,
        targets: Any = "blocks",
        cache_dir: str | None = None,
        cache: str = "ro",
        background: bool = True,
        wait_s: float = 120.0,
        warm_calls: int = 2,
        **enable_options: Any,
    ) -> None:
        from aitune_hf.core.config import TuningConfig

        if not callable(load) or (warm is not None and not callable(warm)):
            raise InputTypeError(
                f"Replica(load=..., warm=...) takes callables: load() -> the object, warm(object) -> anything; got "
                f"load={load!r:.60}, warm={warm!r:.60}"
            )
        options = {"cache_dir": cache_dir, "cache": cache, "background": background, **enable_options}
        TuningConfig.coerce({k: v for k, v in options.items() if k in TuningConfig.__dataclass_fields__})  # fail early
        with Stopwatch() as loading:
            self.obj = load()
        self.load_seconds = loading.seconds
        self.registration = enable_aitune(self.obj, targets, **options)
        self.warm_seconds = 0.0
        with Stopwatch() as warming:
            if warm is not None:
                for _ in range(warm_calls):
                    warm(self.obj)
                tuner = self.registration.background
                if tuner is not None:  # decisions from the cache are quick: wait for them, not for full tunings
                    tuner.wait(timeout=wait_s, until=lambda: tuner.afresh)
        self.warm_seconds = warming.seconds
        logger.info("aitune_hf replica ready: %s", self.summary())

    # -- health ------------------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """What this replica did and does: target states, decisions from the cache vs tuned here, what the background
        tuner has left, load and warm-up seconds, and what the cache did (or why it is not used)."""
        registration = self.registration
        from_cache = tuned_here = 0
        # An armed target that has decided nothing yet: its first tuning is still to come. Not an idle one (never
        # called: a VAE's encoder in a text-to-image service): it stays armed with nothing to tune until a call comes.
        waiting = False
        for target in registration.targets.values():
            signatures = target.report().signatures
            waiting = waiting or (target.armed and not target.idle and not signatures)
            for signature in signatures:  # an identical sibling's decision counts as its owner's
                if signature.from_cache:
                    from_cache += 1
                else:
                    tuned_here += 1
        counts = registration.state_counts
        cache = registration.cache
        background = registration.background.status() if registration.background is not None else None
        return {
            "ready": True,
            # Nothing left to tune for the traffic seen: no target recording, tuning, queued, or armed without any
            # decision yet. A target that decided may stay "armed" for a signature seen once that no later call has
            # (it tunes when one comes, served by its other routes meanwhile): that does not keep it unsettled.
            "settled": not counts.get("recording")
            and not counts.get("tuning")
            and not (background or {}).get("pending")
            and not waiting
            and any(counts.get(state) for state in ("tuned", "eager", "armed")),
            "targets": len(registration.targets),
            "states": counts,
            "tuned": counts.get("tuned", 0),
            "eager": counts.get("eager", 0),
            "decisions_from_cache": from_cache,
            "decisions_tuned_here": tuned_here,
            "background": background,
            "load_seconds": self.load_seconds,
            "warm_seconds": self.warm_seconds,
            "cache": cache.stats.line() if cache is not None else _cache_off(registration),
            "cache_problems": list(cache.stats.problems) if cache is not None else [],
        }

    def summary(self) -> str:
        health = self.health()
        return (
            f"{health['targets']} targets {health['states']}; {health['decisions_from_cache']} decision(s) from the "
            f"cache, {health['decisions_tuned_here']} tuned here; load {health['load_seconds']:.1f} s, warm-up "
            f"{health['warm_seconds']:.1f} s; {health['cache']}"
        )

    def check(self) -> None:
        """Raise when the replica cannot serve (what Ray Serve's `check_health` should call): aitune was disabled
        under it. A replica serving eager is healthy."""
        if self.registration.detached:
            raise UsageError("aitune_hf replica: disable_aitune() was called; restart the replica to tune again")


def _cache_off(registration: Any) -> str:
    """Why a replica has no cache: off by choice, or unusable (and why)."""
    if registration.cache_unusable is not None:
        return f"not used, tuning locally: {registration.cache_unusable}"
    return "off"
