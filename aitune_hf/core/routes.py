"""A route: what serves the calls of one input signature (or of the shapes of one family) of a target, in one module
state: the backend chosen and its build (None: eager), the report of that decision, the guard of the module state it
was built in, and for a polymorphic build the shape it was built on (`covers`: may a new shape of its family be
checked against it). A target keeps its routes by signature (`core/target.py`) and serves a call by the first whose
guard holds (`holds`).

A reduced-precision route also carries its fp32 fallback and whether it waits for the end-to-end quality gate
(`provisional`); a new shape admitted by a block check waits as a route of its own (`new_shape_of`).

Routes are mutable on purpose, under their target's lock: a backend that raises while serving leaves its route eager,
and the gate swaps a route to its fallback; readers without the lock see either state, never a torn one (a copy of the
route table is published on every change).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aitune_hf.backends.base import Backend, BuiltBackend
from aitune_hf.core.guards import ModuleGuard
from aitune_hf.core.report import SignatureReport
from aitune_hf.core.signature import InputSignature, covers, describe_family, same_unit_dims


@dataclass(eq=False)
class Route:
    """How calls of one signature (or of the shapes of one family) are served in one module state."""

    backend: Backend | None  # None: eager
    built: BuiltBackend | None
    report: SignatureReport
    guard: ModuleGuard  # the module state the decision was made in
    reference: InputSignature | None = None  # a shape it was built on, for `covers`
    family_wide: bool = False  # an eager decision for a whole shape family: it covers every shape of it
    #: A reduced-precision decision: the fp32 candidate (backend, built, guard) it falls back to, None for eager.
    fallback: tuple[Backend, BuiltBackend, ModuleGuard] | None = None
    #: Where it has no fallback: why fp32 would not serve (`Decision.fp32_lost`); None where fp32 was not tried.
    fp32_lost: str | None = None
    #: True until the end-to-end quality gate accepts this reduced-precision decision: the fallback serves meanwhile.
    provisional: bool = False
    #: A new shape of a reduced-precision family (`new_shape_of` is the family's route, `reference` the shape): its
    #: block check passed, and it waits for the end-to-end gate of the call it came in; eager serves meanwhile.
    new_shape_of: Route | None = None
    #: The relative error the block check measured at that new shape (what the gate demotes by, largest first).
    rel_error: float | None = None

    #: A route the search after a first plan put in place of this one (`core/refine.py`): while it waits for the
    #: end-to-end gate, `replaces` (the plan it would replace) serves as its fallback, and goes back in its place if the
    #: gate fails it (`Target.demote`); None once accepted, or for any other route.
    replaces: Route | None = None

    #: Whether its guard held when last checked: a route whose guard just failed is not started before its check
    #: (`Target._start`), until it holds again.
    held: bool = True
    #: The shapes it serves (those it was tuned on, then each new one admitted after its check): what its report's
    #: signature describes (`admit`).
    served: list[InputSignature] = field(default_factory=list)

    def admit(self, signature: InputSignature) -> None:
        """A new shape passed its check: it is served from now on, and the report's signature covers it (a family's
        row reads "32x39..122", not the one shape a second tuning of it was made on)."""
        self.report.shapes += 1
        if signature not in self.served:
            self.served.append(signature)
            self.report.signature = describe_family(self.served)

    def holds(self) -> str | None:
        """None when this route may serve now, else what changed."""
        failed = self.guard.check()
        self.held = failed is None
        return failed

    def covers(self, signature: InputSignature, alike_only: bool = False) -> bool:
        """True when the built backend takes `signature`'s shapes (a polymorphic build, sizes in its range). A
        family-wide eager decision covers every shape of its family; with `alike_only` (a target kept whole over its
        blocks, `Target.inner`) only those with size 1 where its reference has (`signature.same_unit_dims`): eager on
        batches of 32 says nothing of single queries."""
        if self.family_wide:
            return not alike_only or self.reference is None or same_unit_dims(self.reference, signature)
        built = self.built
        if built is None or built.dynamic_dims is None or self.reference is None:
            return False
        return covers(self.reference, built.dynamic_dims, signature)
