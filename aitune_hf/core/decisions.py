"""Decisions: what serves the calls of one signature (or shape family) of a target, and where that choice came from.

A `Decision` is a record: the backend that serves (None: eager) and its precision, where the choice came from
(`source`), why eager was kept (`reason`), and the evidence it rests on (`evidence`: the `SignatureReport` with
every candidate's figures). Beside the record it carries what serving needs: the built callable, the guard of the
module state it was built in, and for a reduced-precision winner the fp32 candidate it falls back to.

Sources (set by `core/sourcing.py`, where a decision comes from; the report says them: `SignatureReport.source`):
- "tuned": a strategy chose in this process (`Strategy.decide`).
- "shared": an identical sibling's decision in this process, its winner built here and checked on the recorded calls.
- "cache": read from the persistent cache (`core/cache.py`) and checked on the recorded calls before it serves.
- "pinned": the target cannot be tuned where it stands (`Target.pin_eager`): eager for good, with no evidence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from aitune_hf.backends.base import Backend, BuiltBackend
    from aitune_hf.core.guards import ModuleGuard
    from aitune_hf.core.report import SignatureReport

#: Where a decision came from.
Source = Literal["tuned", "shared", "cache", "pinned"]


@dataclass
class Decision:
    """A choice for one signature: the backend, its built callable (None for eager), the evidence (the report); for a
    reduced-precision winner, the best fp32 candidate to fall back to (None: eager, see `fp32_lost`) if the end-to-end
    gate fails."""

    backend: Backend | None
    built: BuiltBackend | None
    report: SignatureReport | None  # None only for a pinned decision (nothing was tried)
    guard: ModuleGuard | None = None  # what the built backend depends on (None for eager)
    fallback: tuple[Backend, BuiltBackend, ModuleGuard] | None = None
    source: Source = "tuned"
    #: A reduced-precision winner without a fallback: why no fp32 candidate would serve (they were timed, and none
    #: beat eager by `min_speedup`), so that the gate sends it back to eager at once; None where fp32 was not tried
    #: (the reduced precision won clearly): the gate then tunes it again in fp32 (`Target.demote`).
    fp32_lost: str | None = None
    #: Why eager was kept, for a decision without evidence (pinned); otherwise the report says why.
    note: str | None = None
    #: The search this decision's first plan left (`core/refine.py`: anytime tuning), or None: the search is done.
    #: An identical sibling that takes the decision follows it.
    refinement: Any = None

    @classmethod
    def pinned(cls, reason: str) -> Decision:
        """Eager for good: the target cannot be tuned where it stands."""
        return cls(None, None, None, source="pinned", note=reason)

    @property
    def precision(self) -> str:
        """The precision the serving backend computes in ("fp32" for eager)."""
        return self.backend.precision if self.backend is not None else "fp32"

    @property
    def reason(self) -> str | None:
        """Why eager was kept (None when a backend serves)."""
        return self.report.reason if self.report is not None else self.note

    @property
    def evidence(self) -> SignatureReport | None:
        """What the decision rests on: every candidate's figures (None for a pinned decision)."""
        return self.report
