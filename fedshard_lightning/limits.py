"""Bounds on the counts a config gives (rounds, local epochs and steps).

A count has no natural maximum, but a typo has: unchecked, ``t1: 1e21`` would start a fit that
never ends and, off a terminal, prints nothing until its first stage does. A million rounds (or
local epochs, or local steps) is far beyond any published FL run and still finishes; above
that a count is a mistake, stopped at start-up in one line naming the field.
"""

from __future__ import annotations

from fedshard_lightning.errors import ConfigError

__all__ = ["MAX_COUNT", "check_count"]

MAX_COUNT = 1_000_000


def check_count(
    field: str, value: object, minimum: int = 1, what: str = "", *, optional: bool = False
) -> int | None:
    """``value`` if it is an integer in ``[minimum, MAX_COUNT]`` (or None where ``optional``).

    Args:
        field: The config field, as the user writes it (``algorithm.t1``).
        value: The value given.
        minimum: The smallest valid value.
        what: What the count means, said in the error (`` (the most rounds a shard trains)``).
        optional: Whether None (the default's "derive it") is accepted.

    Raises:
        ConfigError: If ``value`` is not such an integer; the line names the field and the range.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        null = " or null" if optional else ""
        raise ConfigError(f"{field}={value!r}: must be an integer from {minimum} to {MAX_COUNT}{null}{what}")
    return value
