"""Every error line ddpkit prints is at most LIMIT characters besides the paths it names: each `UserError(...)`
and failure of src/ddpkit, read from its source (the messages that can be enumerated), is rendered with each
value it interpolates counted at its widest (a path counts as nothing: its length is the user's)."""

from __future__ import annotations

import ast
import re

from conftest import REPO

LIMIT = 200
PREFIX = "ddpkit: error: "
ERRORS = {"UserError", "WorkerFailure", "CollectiveFailure", "TrainingFailure", "Failure", "Preempted"}
# an interpolated value that names a file or folder (its length is the user's), by the expression's words
PATHY = re.compile(
    r"path|file|folder|dir\b|out_dir|root|script|source|where|ckpt|checkpoint|shard|out\b", re.I
)
VALUE = 8  # any other value: a number, a key's value, a name


def _width(expr: ast.expr, constants: dict[str, str]) -> int:
    """How wide an interpolated value can be: first_line(..., limit=N) at most N (+ " ..."), a module's string
    constant or a text the function assigned to the name before its length, a path nothing."""
    if isinstance(expr, ast.Name) and expr.id in constants:
        return len(constants[expr.id])
    if isinstance(expr, ast.Name) and expr.id in _LOCAL:
        return max(len(_rendered(e, constants) or "x" * VALUE) for e in _LOCAL[expr.id])
    if isinstance(expr, ast.Call) and getattr(expr.func, "id", None) in _RETURNS:  # a function making a text
        return len(_rendered(_RETURNS[expr.func.id], constants) or "x" * VALUE)
    if isinstance(expr, ast.Call) and getattr(expr.func, "id", None) == "first_line":
        limits = [k.value for k in expr.keywords if k.arg == "limit"] + expr.args[1:2]
        limit = limits[0].value if limits and isinstance(limits[0], ast.Constant) else 200
        return limit + 4
    return 0 if PATHY.search(ast.unparse(expr)) else VALUE


def _rendered(node: ast.expr, constants: dict[str, str]) -> str | None:
    """The text `node` makes, each value as that many 'x' (the widest branch of a choice); None if unknown."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if isinstance(node, ast.JoinedStr):
        parts = [
            v.value if isinstance(v, ast.Constant) else "x" * _width(v.value, constants) for v in node.values
        ]
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _rendered(node.left, constants), _rendered(node.right, constants)
        return None if left is None or right is None else left + right
    if isinstance(node, (ast.Call, ast.Name)) and _width(node, constants) != VALUE:  # first_line(...), a text
        return "x" * _width(node, constants)
    if isinstance(node, ast.IfExp):
        options = [
            t for t in (_rendered(node.body, constants), _rendered(node.orelse, constants)) if t is not None
        ]
        return max(options, key=len) if options else None
    return None


_LOCAL: dict[str, list[ast.expr]] = {}  # the texts the function being read assigns to each name
_RETURNS: dict[str, ast.expr] = {}  # the module's functions whose body returns one text (a shared hint)


def _texts_assigned(function: ast.AST) -> dict[str, list[ast.expr]]:
    """{name: the f-strings and strings a function assigns to it} (`detail = f"..." + first_line(e)`)."""
    found: dict[str, list[ast.expr]] = {}
    for n in ast.walk(function):
        if isinstance(n, ast.Assign) and isinstance(n.value, (ast.JoinedStr, ast.BinOp, ast.Constant)):
            for t in n.targets:
                if isinstance(t, ast.Name) and not PATHY.search(t.id):
                    found.setdefault(t.id, []).append(n.value)
    return found


def _constants(tree: ast.Module) -> dict[str, str]:
    """A module's top-level string constants (NAME = "..."): a hint written once and used in several errors."""
    return {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        for t in n.targets
        if isinstance(t, ast.Name)
    }


def _calls(tree: ast.Module):
    """(error call, the texts its function assigns) for every call of an error class in the module."""
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    seen = set()
    for scope in reversed(scopes):  # innermost functions first: each call is read in its own function
        texts = _texts_assigned(scope) if scope is not tree else {}
        for node in ast.walk(scope):
            name = getattr(
                getattr(node, "func", None), "id", getattr(getattr(node, "func", None), "attr", None)
            )
            if isinstance(node, ast.Call) and name in ERRORS and node.args and id(node) not in seen:
                seen.add(id(node))
                yield node, name, texts


def error_lines() -> list[tuple[str, str]]:
    """(where, the line as printed) of every error of src/ddpkit whose text is written at the call."""
    found = []
    for path in sorted((REPO / "src" / "ddpkit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = _constants(tree)
        _RETURNS.clear()
        _RETURNS.update(
            {
                f.name: f.body[-1].value
                for f in tree.body
                if isinstance(f, ast.FunctionDef)
                and isinstance(f.body[-1], ast.Return)
                and f.body[-1].value
                and isinstance(f.body[-1].value, (ast.JoinedStr, ast.Constant, ast.BinOp))
            }
        )
        for node, name, texts in _calls(tree):
            _LOCAL.clear()
            _LOCAL.update(texts)
            what = _rendered(node.args[0], constants)
            hint = _rendered(node.args[1], constants) if len(node.args) > 1 and name == "UserError" else ""
            if what is not None and hint is not None:
                line = PREFIX + what + (f" ({hint})" if hint else "")
                found.append((f"{path.relative_to(REPO)}:{node.lineno}", line))
    return found


def test_every_error_line_is_at_most_200_characters_besides_its_paths():
    lines = error_lines()
    assert len(lines) > 300  # the enumeration finds the messages
    long = [(where, len(line), line) for where, line in lines if len(line) > LIMIT]
    assert long == [], "\n".join(f"{w} {n}: {line}" for w, n, line in sorted(long, key=lambda x: -x[1]))


def test_the_enumeration_counts_values_at_their_widest_and_paths_as_nothing():
    (node,) = ast.parse('f"{path} holds {n} ids: {first_line(e, limit=40)}"').body
    assert _rendered(node.value, {}) == " holds " + "x" * VALUE + " ids: " + "x" * 44


def test_a_line_over_the_limit_at_run_time_puts_its_advice_on_a_second_line():
    from ddpkit.errors import UserError, printed

    path = "/data/" + "d" * 300 + "/train.bin"
    short = UserError(f"'{path}' is a FIFO, not a file of token ids", "give a regular file")
    assert printed(PREFIX, short) == PREFIX + short.line()  # the path does not count
    long = UserError("w" * 150, "h" * 60)
    assert printed(PREFIX, long) == f"{PREFIX}{'w' * 150}\n  ({'h' * 60})"
