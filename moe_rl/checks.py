"""The one-line configuration error and the checks every config section's ``validate()`` uses
(a light module: sections validate without importing their packages' heavy parts)."""

from __future__ import annotations

from typing import Any, Iterable


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""


def require_choice(key: str, value: Any, valid: Iterable) -> None:
    """``value`` is one of ``valid``, else a ConfigError naming them."""
    valid = tuple(valid)
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; valid: {', '.join(map(str, valid))}")


def require_positive(key: str, value: float, allow_zero: bool = False) -> None:
    """``value`` > 0 (or >= 0 with ``allow_zero``), else a ConfigError."""
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")
