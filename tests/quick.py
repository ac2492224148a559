"""The tuning configs the tests share, in one place.

- `QUICK`: short timing (the suite checks what is served, never how fast: speed lives in benchmarks/), and every
  candidate tried inside the call that tunes (`anytime=False`): what the test asserts is decided when the call returns.
  The search after a first plan (anytime tuning, the default) has tests of its own (tests/core/test_anytime.py).
- `ORT`: ONNX Runtime serves wherever it is correct (`min_speedup=0`), each input shape exported on its own
  (`shapes="exact"`): a static export takes a third of a shape family's dynamic one (a tiny SD stage: 2.4 s against
  6-10 s here), and most tests are about what is served, not about shapes.
- `ORT_FAMILY`: the same with the default shape families, for tests of the polymorphic builds and of the default
  path end to end.
"""

from __future__ import annotations

from typing import Any

QUICK: dict[str, Any] = {"progress": False, "warmup": 1, "repeats": 3, "anytime": False}
ORT: dict[str, Any] = {**QUICK, "backends": ["onnxruntime"], "min_speedup": 0, "shapes": "exact"}
ORT_FAMILY: dict[str, Any] = {**ORT, "shapes": "family"}
