"""Bounds on the YAML a command reads: alias expansion, nesting depth, duplicate keys.

A config is parsed by jsonargparse, which expands every alias: a "billion laughs" file of a few
hundred bytes (aliases of aliases) ran past 90 s at 2 GB, and a list nested 5,000 deep raised a
RecursionError traceback. PyYAML silently keeps the last of two equal keys, so a typo'd second
``lr:`` replaced the first without a word. :func:`check_yaml` composes the document's node graph
(aliases stay shared references, so composing costs the text's size), then counts what
expanding it would create, measures its depth and looks for repeated keys, all without
expanding anything; a document over a bound is refused in one line.
"""

from __future__ import annotations

import yaml

from fedshard_lightning.errors import ConfigError

__all__ = ["MAX_DEPTH", "MAX_NODES", "check_yaml"]

MAX_NODES = 1_000_000  # values after alias expansion: far above any config (a K=65536 client list)
MAX_DEPTH = 64  # nesting of mappings and lists: configs nest about 6 deep


def _refuse(name: str, why: str, fix: str) -> ConfigError:
    return ConfigError(f"{name}: {why}; {fix}")


def check_yaml(text: str, name: str, fix: str) -> None:
    """Refuse YAML whose expansion, depth or keys are out of bounds (see the module docstring).

    Args:
        text: The document.
        name: What to call it in the error (``--config FILE``, ``--clients``).
        fix: The way out, said at the end of the line.

    Raises:
        ConfigError: One line naming the document and the bound.
    """
    depth = deepest = 0
    for char in text:  # flow brackets first: composing 5,000 of them recurses for seconds
        depth += (char in "[{") - (char in "]}")
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        raise _refuse(name, f"nested deeper than {MAX_DEPTH} levels", fix)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise _refuse(name, f"nested deeper than {MAX_DEPTH} levels", fix) from None
    except yaml.YAMLError:
        return  # not YAML at all: the reader's own check says so
    if root is None:
        return
    size: dict[int, int] = {}  # values under each node once expanded, by id
    height: dict[int, int] = {}  # nesting under each node once expanded
    visiting: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # post-order, iterative (a deep document must not recurse here); shared aliases sized once
        node, done = stack.pop()
        key = id(node)
        children = _children(node, name, fix)
        if done:
            visiting.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            height[key] = 1 + max((height[id(c)] for c in children), default=0)
            if height[key] > MAX_DEPTH:
                raise _refuse(name, f"nested deeper than {MAX_DEPTH} levels", fix)
            if size[key] > MAX_NODES:
                raise _refuse(
                    name,
                    f"expands to more than {MAX_NODES:,} values (aliases of aliases: a 'billion laughs' document)",
                    fix,
                )
            continue
        if key in size:
            continue
        if key in visiting:  # reached again below itself
            raise _refuse(name, "an alias refers to a value that contains it (an endless document)", fix)
        visiting.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def _children(node: yaml.Node, name: str, fix: str) -> list[yaml.Node]:
    """A node's keys, values or items; a mapping that repeats a key is refused."""
    if isinstance(node, yaml.MappingNode):
        keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode) and k.value != "<<"]
        if len(keys) != len(set(keys)):
            twice = next(k for i, k in enumerate(keys) if k in keys[:i])
            raise _refuse(name, f"key {twice!r} is given twice in one mapping (the first would be lost)", fix)
        return [c for pair in node.value for c in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []
