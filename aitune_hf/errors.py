"""The one exception hierarchy of aitune_hf: catch `AITuneError` to catch everything aitune_hf raises on purpose.

- `UserInputError` (also a `ValueError`): a value the caller passed is invalid; the message names the value and
  what is valid. `InputTypeError` (also a `TypeError`) is the same for a value of the wrong type, and
  `ConfigError` for a field of `TuningConfig` / `enable_aitune`.
- `UsageError` (also a `RuntimeError`): a call made at the wrong time (tune() after detach(), enabling twice).
- `TuningError` (also a `RuntimeError`): tuning could not give what was asked for (e.g. `OneBackend` whose backend
  cannot serve a target). Tuning inside a user's call never raises it into that call: the target stays eager.

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
