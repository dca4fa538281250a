"""The one bounded reader for every YAML and JSON text ddpkit reads (configs given with -c, a run's config.yaml,
metrics.jsonl lines, bench's config, a checkpoint's embedded config): size, alias expansion and nesting depth
are bounded before anything is built, and each refusal is one line.

YAML goes through safe_yaml's counting loader (PyYAML's safe loader, aliases counted at their expanded size);
JSON's nesting is measured on the text before json.loads, whose C parser would otherwise recurse until a
RecursionError; an object already loaded (a checkpoint's config) is walked with the same limits.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ddpkit.atomicio import open_regular
from ddpkit.errors import UserError

MAX_DEPTH = 32  # nesting levels: a config has 2, a metrics line 1
MAX_NODES = 10_000  # values in one document: a config has about 50
MAX_YAML_BYTES = 1 << 20
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


class TooDeep(ValueError):
    """A JSON text or object nested deeper than MAX_DEPTH, or holding more than MAX_NODES values."""


def json_depth(text: str) -> int:
    """How deeply a JSON text nests its arrays and objects (strings skipped), without parsing it."""
    depth = deepest = 0
    for b in _BRACKET.findall(_STRING.sub("", text)):
        depth += 1 if b in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def loads_json(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads within the nesting bound: TooDeep past it, ValueError when it is not JSON."""
    if json_depth(text) > max_depth:
        raise TooDeep(f"nested deeper than {max_depth} levels")
    return json.loads(text)


def check_tree(value: Any, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    """TooDeep when a loaded value (dicts, lists, tuples) nests deeper or holds more values than allowed;
    walked without recursion, so a value nested 100,000 deep is measured, not a crash."""
    stack, nodes = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if depth > max_depth:
            raise TooDeep(f"nested deeper than {max_depth} levels")
        if nodes > max_nodes:
            raise TooDeep(f"holds more than {max_nodes} values")
        if isinstance(item, dict):
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, (list, tuple)):
            stack += [(v, depth + 1) for v in item]


def read_yaml_file(path: str | os.PathLike, name: str, hint: str) -> Any:
    """The YAML document in file `path` within the bounds (size, aliases, depth, values); a one-line UserError
    naming `name` otherwise (`hint`: what the file should be)."""
    from ddpkit.config.safe_yaml import parse_yaml

    try:
        with os.fdopen(open_regular(path), "rb") as fh:  # a FIFO is refused, never waited on
            data = fh.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise UserError(f"cannot read {name}: {e.strerror or e}", hint) from None
    if len(data) > MAX_YAML_BYTES:
        raise UserError(f"{name} is larger than {MAX_YAML_BYTES >> 20} MiB", hint)
    return parse_yaml(data.decode("utf-8", errors="replace"), name)
