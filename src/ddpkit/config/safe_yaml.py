"""Reading a config file that may be hostile: bounded size, nodes and nesting, no duplicate keys, one-line errors.

PyYAML's safe loader constructs no objects, but it expands aliases without limit (a 342-byte file can ask for
387 million values) and keeps the last of two equal keys silently. Here every value is counted as it is
composed, with aliases counted at their expanded size, so such a file is refused before anything is built.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from ddpkit.config.schema import shown
from ddpkit.errors import UserError

MAX_FILE_BYTES = 1 << 20  # 1 MiB: a config is a few hundred bytes
MAX_NODES = 10_000  # YAML values after expanding aliases: a config has about 50
MAX_DEPTH = 32  # nesting levels: a config has 2


class NotYAML(UserError):
    """The text is not valid YAML (a KEY=VALUE value may then be taken as plain text)."""


class _Refused(Exception):
    def __init__(self, what: str, hint: str, mark: Any):
        super().__init__(f"line {mark.line + 1}: {what}")
        self.hint = hint


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts every node, aliases at their expanded size, and refuses past the limits."""

    def __init__(self, text: str):
        super().__init__(text)
        self._size: dict[int, int] = {}  # id(node) -> values it expands to (nodes stay alive while composing)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        mark = self.peek_event().start_mark
        alias = self.check_event(yaml.AliasEvent)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(
                f"nested deeper than {MAX_DEPTH} levels", "a config has two: section and key", mark
            )
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if alias:
            if id(node) not in self._size:
                raise _Refused("an alias inside its own anchor", "remove the recursive alias", mark)
            return node
        kids = node.value if isinstance(node, yaml.SequenceNode) else []
        if isinstance(node, yaml.MappingNode):
            kids = [n for pair in node.value for n in pair]
        size = 1 + sum(self._size[id(k)] for k in kids)
        if size > MAX_NODES or len(self._size) >= MAX_NODES:
            raise _Refused(
                f"more than {MAX_NODES} values once aliases are expanded",
                "refused before expanding them; a config holds about 50 values",
                mark,
            )
        self._size[id(node)] = size
        return node


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping in YAML file `path`, or a one-line UserError (missing, too big, hostile, bad YAML, not a mapping)."""
    name = f"config file {shown(path)}"
    if not os.path.exists(path):
        raise UserError(f"{name} does not exist", "check the path given to -c")
    if not os.path.isfile(path):
        raise UserError(f"{name} is not a regular file", "give -c a YAML file")
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise UserError(
                f"{name} is larger than {MAX_FILE_BYTES >> 20} MiB", "a config is a few KiB of YAML"
            )
        text = data.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"cannot read {name}: {shown(str(e))}", "check the file's permissions and encoding (UTF-8)"
        ) from None
    tree = parse_yaml(text, name)
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise UserError(f"{name} must hold a mapping of keys", "write `key: value` lines")
    return tree


def parse_yaml(text: str, name: str) -> Any:
    """One YAML document, within the limits above and without duplicate keys; `name` says where it came from."""
    _no_control_characters(text, name)
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _no_duplicates(node, name, "", set())
        return loader.construct_document(node)
    except (ValueError, OverflowError) as e:  # an implicit int of 5000 digits, a timestamp like 2001-13-45
        raise NotYAML(f"{name} holds a value YAML cannot convert: {shown(str(e))}", "quote it") from None
    except _Refused as e:
        raise UserError(f"{name}, {e}", e.hint) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise NotYAML(f"{name} is not valid YAML{where}", "fix the YAML syntax") from None
    finally:
        loader.dispose()


# C0 controls but tab, newline and carriage return; DEL; C1 controls: never meant in a config, and echoed to a
# terminal they could set its title or clear its screen (YAML's reader refuses them with a traceback)
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _no_control_characters(text: str, name: str) -> None:
    found = _CONTROL.search(text)
    if found:
        line = text.count("\n", 0, found.start()) + 1
        raise UserError(
            f"{name} holds a control character ({found.group()!r}) at line {line}",
            "remove it; write a string's special characters as YAML escapes inside double quotes",
        )


def _no_duplicates(node: Any, name: str, prefix: str, seen: set[int]) -> None:
    """Raise when a mapping repeats a key (PyYAML would keep the last one silently)."""
    if id(node) in seen or not isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _no_duplicates(item, name, prefix, seen)
        return
    lines: dict[str, int] = {}
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        dotted = prefix + key.value
        line = key.start_mark.line + 1
        if key.value in lines:
            raise UserError(
                f"{name} sets {shown(dotted)} twice, at lines {lines[key.value]} and {line}",
                "keep one of them",
            )
        lines[key.value] = line
        _no_duplicates(value, name, dotted + ".", seen)
