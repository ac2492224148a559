"""The one exception hierarchy of aitune_hf: catch `AITuneError` to catch everything aitune_hf raises on purpose.

- `UserInputError` (also a `ValueError`): a value the caller passed is invalid; the message names the value and
  what is valid. `InputTypeError` (also a `TypeError`) is the same for a value of the wrong type, and
  `ConfigError` for a field of `TuningConfig` / `enable_aitune`.
- `UsageError` (also a `RuntimeError`): a call made at the wrong time (tune() after detach(), enabling twice).
- `TuningError` (also a `RuntimeError`): tuning could not give what was asked for (e.g. `OneBackend` whose backend
  cannot serve a target). Tuning inside a user's call never raises it into that call: the target stays eager.
  `CandidateUnavailable` (a `TuningError`): a backend found while building that its candidate does not apply to the
  block (ONNX Runtime's fused kernels where nothing fuses); the strategy reports the candidate unavailable.

- `PathError` (a `UserInputError` and a `FileNotFoundError`): a file or folder named by the caller is missing;
  `ReadOnlyError` (a `UsageError` and a `PermissionError`): a write asked of a read-only cache.
- `MissingExtraError` (also an `ImportError`): a feature needs an extra that is not installed (`pip install
  'aitune-hf[notebooks]'`).

Anything else that escapes aitune_hf is a bug, and the CLI shows its traceback.
"""

from __future__ import annotations


class AITuneError(Exception):
    """Base of every error aitune_hf raises on purpose."""


class UserInputError(AITuneError, ValueError):
    """A value passed by the caller is invalid; the message names it and what is valid."""


class InputTypeError(UserInputError, TypeError):
    """A value passed by the caller has the wrong type."""


class ConfigError(UserInputError):
    """A configuration field (of `TuningConfig` or `enable_aitune`) is invalid."""


class UsageError(AITuneError, RuntimeError):
    """An operation called at the wrong time (tune() after detach(), enable_aitune() twice, ...)."""


class TuningError(AITuneError, RuntimeError):
    """Tuning could not give what was asked for."""


class CandidateUnavailable(TuningError):
    """A candidate does not apply to the block it was asked to build, found only while building (ONNX Runtime's fused
    kernels where no pattern fuses). Raised before any session or compiled artifact is made; the strategy records the
    candidate as unavailable (`CandidateResult.skipped_for`), with this message as its reason, never as a failure."""


class PathError(UserInputError, FileNotFoundError):
    """A file or folder the caller named is not there (also a `FileNotFoundError`, as Python reports it)."""


class ReadOnlyError(UsageError, PermissionError):
    """A write was asked of something opened read-only (a cache with `cache="ro"`; also a `PermissionError`)."""


class MissingExtraError(AITuneError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names the pip extra."""
