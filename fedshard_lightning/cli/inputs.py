"""Checks of the raw command line and the parsed config that jsonargparse does not make.

jsonargparse reads every flag's value as YAML and coerces it to the annotated type, which is
lenient in ways that matter here: ``--clients '["1"]'`` and ``--clients '[١]'`` (an
Arabic-Indic digit, which Python's ``int`` accepts) both became client 1, so a request could
unlearn a client nobody typed. argparse takes ``-inf`` after a flag for another flag
(``argument --model: expected one argument``). And a finite float beyond float32's range
(``lr: 1e300``) reached the optimizer and failed there with a traceback. Each is one line here,
exit 2, before anything is loaded or written.
"""

from __future__ import annotations

import math
import re
from typing import Any

from fedshard_lightning.cli.yaml_bounds import check_yaml
from fedshard_lightning.errors import ConfigError, UnlearningRequestError

__all__ = ["FLOAT32_MAX", "check_command_line", "check_numbers", "join_negative_values"]

FLOAT32_MAX = 3.4028234663852886e38

# Plain ASCII integers: ``7``, ``[3, 17]``, ``[]`` (negative ones pass here to be named as unknown ids).
# No leading zeros: YAML 1.1 reads ``010`` as octal 8, so ``--clients '[010]'`` would unlearn client 8.
_ID = r"-?(?:0|[1-9][0-9]*)"
_CLIENTS = re.compile(rf"^\s*(?:{_ID}|\[\s*(?:{_ID}\s*(?:,\s*{_ID}\s*)*)?\])\s*$", re.ASCII)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def join_negative_values(argv: list[str]) -> list[str]:
    """``--flag -inf`` as ``--flag=-inf``: argparse takes a value that starts with '-' for a flag.

    Only values that read as numbers are joined (``-1e-3``, ``-inf``, ``-nan``); argparse already
    takes plain negative integers, and ``=`` gives it the same value either way.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (
            a.startswith("--")
            and "=" not in a
            and nxt is not None
            and nxt.startswith("-")
            and _is_number(nxt)
        ):
            out.append(f"{a}={nxt}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def _values(argv: list[str], flag: str) -> list[str]:
    found = []
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif a.startswith(flag + "="):
            found.append(a.split("=", 1)[1])
    return found


def check_command_line(argv: list[str]) -> None:
    """Refuse client ids that are not plain ASCII integers, and flag values over the YAML bounds.

    Raises:
        UnlearningRequestError: A ``--clients`` value other than ``7`` or ``[3, 17]``.
        ConfigError: A value whose YAML expands too far, nests too deep or repeats a key.
    """
    for flag in ("--clients", "--exclude_clients"):
        for value in _values(argv, flag):
            if not _CLIENTS.match(value):
                field = flag[2:]
                raise UnlearningRequestError(
                    f"{field}={value!r}: give plain integers (ASCII digits, no leading zeros), e.g. --{field} '[3, 17]' or --{field} 7"
                )
    for a in argv:
        value = a.split("=", 1)[1] if a.startswith("--") and "=" in a else a
        if value.lstrip()[:1] in ("[", "{") or "&" in value:
            check_yaml(value, f"the value {value[:40]!r}", "give a plain value")


def check_numbers(config: Any, where: str = "") -> None:
    """Refuse a float in the parsed config that is not finite or that float32 cannot hold, naming the field.

    Args:
        config: The parsed config of the command (nested dicts and lists).
        where: The field path so far.

    Raises:
        ConfigError: ``model.lr=1e+300: ...``.
    """
    stack: list[tuple[str, Any]] = [(where, config)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(value))
        elif isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            field = path.replace(".init_args", "")
            reason = "not a finite number" if not math.isfinite(value) else "beyond float32's range (3.4e38)"
            raise ConfigError(f"{field}={value!r}: {reason}; give a finite number in range")
