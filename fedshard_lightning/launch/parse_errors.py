"""A parse error as one ``error: field: reason`` line, and help as plain text.

jsonargparse nests every Union member's complaint in one error and prints docstrings'
reStructuredText markup raw; the CLI's parser and the experiments' parsers
(:class:`PlainHelpParser`) answer both the same way.
"""

from __future__ import annotations

import re
import sys
from typing import NoReturn

from jsonargparse import ArgumentParser

from fedshard_lightning.launch.exits import one_line as _one_line

__all__ = ["PlainHelpParser", "parse_reason", "plain_text"]

_RST_ROLE = re.compile(r":(?:class|meth|func|mod|attr|obj|data|exc):`~?([^`]+)`")


def plain_text(text: str) -> str:
    """Help text without reStructuredText markup (docstrings feed ``--help``; terminals show it raw).

    ``:class:`~a.b.C``` becomes ``C``, double backquotes become nothing.
    """
    text = _RST_ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1), text)
    return text.replace("``", "")


class PlainHelpParser(ArgumentParser):
    """A jsonargparse parser whose help is plain text (for the experiments' command lines)."""

    def format_help(self) -> str:
        """Help as plain text."""
        return plain_text(super().format_help())

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """A parse error as one ``error: field: reason`` line and exit 2, like the main CLI."""
        if not self.exit_on_error:
            return super().error(message, ex)
        sys.stderr.write(f"error: {_one_line(parse_reason(message))}\n")
        raise SystemExit(2)


def parse_reason(message: str) -> str:
    """A jsonargparse parse error as ``field: what was wrong`` (it nests every Union member's complaint).

    ``Parser key "data" ... Parser key "rho": Expected a <class 'float'>. Got value: inf`` becomes
    ``data.rho: expected a float, got inf``.
    """
    keys = list(dict.fromkeys(re.findall(r'Parser key "([^"]+)"', message)))
    field = ".".join(keys)
    expected = re.search(r"Expected a <class '(\w+)'>\. Got value: (.*)", message)
    unknown = re.search(r"Option '([^']+)' is not accepted", message)
    bad_class = re.search(r"Problem with given class_path '([^']+)':\s*\n\s*(.+)", message)
    union = re.search(r"Subtypes: \[(.*?)\]\s*Errors:.*Given value: ([^\n]*)", message, re.S)
    required = re.search(r"the following arguments are required: (.+)", message)
    if required:
        return _required(required.group(1))
    if expected:
        kind, value = expected.groups()
        finite = (
            "; give a finite number"
            if kind == "float" and value.strip().lower() in ("nan", "inf", "-inf")
            else ""
        )
        reason = f"expected {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {value.strip()}{finite}"
    elif unknown:
        reason = f"unknown option {unknown.group(1)!r}; --print_config lists the accepted ones"
    elif bad_class:
        reason = f"class_path {bad_class.group(1)}: {bad_class.group(2).strip()}"
    elif union:
        kinds = re.sub(r"<class '(\w+)'>", r"\1", union.group(1)).replace("NoneType", "null")
        kinds = re.sub(r",\s*(?![^\[]*\])", " or ", kinds)  # commas outside brackets
        reason = f"expected {kinds}, got {union.group(2).strip()}"
    else:
        return message
    return f"{field}: {reason}" if field else reason


def _required(names: str) -> str:
    """``unlearn.ckpt_path, unlearn.clients`` as ``unlearn: give --ckpt_path RUN_DIR and --clients``."""
    keys = [n.strip() for n in names.split(",") if n.strip()]
    command = keys[0].split(".", 1)[0] if "." in keys[0] else ""
    flags = []
    for key in keys:
        flag = key.split(".", 1)[1] if command and key.startswith(f"{command}.") else key
        flags.append(
            f"--{flag} RUN_DIR (the folder that fit created)" if flag == "ckpt_path" else f"--{flag}"
        )
    return f"{command + ': ' if command else ''}give {' and '.join(flags)}; {'they are' if len(flags) > 1 else 'it is'} required"
