"""The layout rules a newcomer relies on, checked: declared channels, registries asked instead of name lists, the
folders and their order, the size limits, the tests mirroring the package, no model named in parallel/ and
train/, every module importable alone, no import cycle. Budget: 45 s (reads files; one process imports every moved module; one
imports torch and forks once per module: about 14 s of CPU)."""

from __future__ import annotations

import re

from conftest import REPO

SRC = REPO / "src" / "ddpkit"


def _sources():
    return sorted(p for p in SRC.rglob("*.py"))


def test_every_ddpkit_environment_variable_is_declared_in_channels_only():
    from ddpkit import channels

    declared = {c.name for c in channels.CHANNELS}
    spelled = {}
    for path in _sources():
        for name in re.findall(r"[\"'](DDPKIT_[A-Z_]+)[\"']", path.read_text()):
            spelled.setdefault(name, set()).add(path.relative_to(SRC).as_posix())
    assert {n: f for n, f in spelled.items() if f != {"channels.py"}} == {}
    assert set(spelled) == declared, "a channel declared but never used, or used but not declared"
    assert all(c.set_by and c.read_by and c.meaning for c in channels.CHANNELS)


def test_no_module_lists_strategy_names_instead_of_asking_the_registry():
    from ddpkit.parallel.strategy import strategy_names

    names = [n for n in strategy_names() if n not in ("single", "dp")]  # too common as words
    one = r"[\"'](" + "|".join(names) + r")[\"']"
    pattern = re.compile(one + r"\s*,\s*" + one)  # two names side by side: a list of strategies
    offenders = [
        p.relative_to(SRC).as_posix()
        for p in _sources()
        if pattern.search(p.read_text()) and "strategy.py" not in p.name
    ]
    assert offenders == []


OWNERS = ("models/", "parallel/strategies/")  # the folders where a family's or a strategy's name may decide


def _decided_names(src, names: set[str]) -> list[str]:
    """`path:line: name` of each name in `names` that the modules under `src` (but OWNERS) decide by: compared
    (`==`, `!=`, `in`; a tuple of names too), returned, matched, or made a module-level constant (a registry's
    list of its own built-ins, a table of defaults, is not a decision)."""
    import ast

    def named(node) -> list[str]:
        return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names]

    found = []
    for path in sorted(src.rglob("*.py")):
        where = path.relative_to(src).as_posix()
        if where.startswith(OWNERS):
            continue
        tree = ast.parse(path.read_text())
        deciding = [n for n in ast.walk(tree) if isinstance(n, (ast.Compare, ast.Return, ast.MatchValue))]
        constants = [n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value]
        deciding += [c for c in constants if isinstance(c, ast.Constant)]  # AUTO = "zero2"; not a table
        for node in deciding:
            found += [f"{where}:{node.lineno}: {name}" for name in named(node)]
    return found


def test_no_family_or_strategy_name_decides_outside_its_owners(tmp_path):
    # a family's names are asked of its family (ModelFamily, FamilyCard), a strategy's facts of its entry
    # (StrategyEntry); "dp" is also the mesh's dimension name, and "auto" picks a strategy, it is none
    from ddpkit.models import CARDS, MODEL_FAMILIES
    from ddpkit.parallel.strategy import strategy_names

    families = {f.name for f in MODEL_FAMILIES.values()} | {c.name for c in CARDS}
    arches = {name for f in MODEL_FAMILIES.values() for name in f.names()}
    names = (families | arches | set(strategy_names())) - {"dp"}
    assert {"gpt", "llama", "cnn", "resnet18", "ddp", "hsdp", "single"} <= names
    # the finder itself, on a module that decides by names
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "x.py").write_text(
        'PICK = "zero2"\ndef f(a, s):\n    if a in ("cnn", "mlp") or s != "ddp":\n        return "gpt"\n'
    )
    decided = sorted(_decided_names(tmp_path, names))
    assert decided == [
        f"train/x.py:{n}: {name}"
        for n, name in [(1, "zero2"), (3, "cnn"), (3, "ddp"), (3, "mlp"), (4, "gpt")]
    ]
    assert _decided_names(SRC, names) == [], "ask the family or the strategy entry (docs/architecture.md)"


def test_each_built_in_family_is_a_folder_of_its_own_with_a_torch_free_card():
    # adding a family (Qwen, a mixture of experts) touches its folder and its name in FAMILY_FOLDERS only
    from ddpkit.models import FAMILY_FOLDERS

    heavy = _heavy_modules()
    assert sorted(FAMILY_FOLDERS) == sorted(p.parent.name for p in (SRC / "models").glob("*/model.py"))
    for folder in FAMILY_FOLDERS:
        assert (SRC / "models" / folder / "keys.py").is_file(), folder
        assert f"ddpkit.models.{folder}.keys" not in heavy, f"models/{folder}/keys.py must import no torch"
    assert "ddpkit.models.gpt.model" in heavy  # the finder sees a family's torch


def test_no_module_keeps_an_old_name_for_another():
    # 0.1.0 shipped no alias: a moved module or name lives at its new place only (no _moved.py table, no
    # module-level __getattr__ forwarding old names); the packages that load their public names lazily (so that
    # importing them imports no torch) are the only ones with a __getattr__
    import re as _re

    assert not (SRC / "_moved.py").exists()
    forwarding = {
        p.relative_to(SRC).as_posix()
        for p in _sources()
        if _re.search(r"^(def __getattr__|__getattr__ =)", p.read_text(), flags=_re.M)
    }
    assert forwarding == {"__init__.py", "data/__init__.py", "distributed/__init__.py", "models/__init__.py"}
    assert [
        p.name for p in _sources() if "_moved" in p.read_text() or "DeprecationWarning" in p.read_text()
    ] == []


def test_no_folder_holds_more_than_twelve_modules():
    folders = {p.parent for p in _sources()}
    crowded = {
        f.relative_to(SRC).as_posix() or ".": n
        for f in folders
        if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > 12
    }
    assert crowded == {}, "move modules into a subsystem folder, or make a new one (docs/architecture.md)"


def test_every_folder_is_on_the_architecture_map_and_every_folder_on_it_exists():
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc.split("## The folders\n", 1)[1].split("\n## ", 1)[0]
    mapped = re.findall(r"^\| `([\w/]+/)` \|", section, flags=re.M)
    folders = {"ddpkit/"} | {p.parent.relative_to(SRC).as_posix() + "/" for p in SRC.rglob("*/__init__.py")}
    assert sorted(mapped) == sorted(folders)


MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 60


def test_no_module_over_450_lines_and_no_function_over_60():
    import ast

    over = []
    for path in _sources():
        name, text = path.relative_to(SRC).as_posix(), path.read_text()
        if (n := len(text.splitlines())) > MAX_FILE_LINES:
            over.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    over.append(f"{name}: {node.name}() {n} lines")
    assert over == [], "split these (one concern per module, docs/architecture.md)"


def test_tests_mirror_the_package_and_import_helpers_from_conftest_only():
    tests = REPO / "tests"
    package = {p.parent.relative_to(SRC).as_posix() for p in SRC.rglob("*/__init__.py")}
    folders = {
        p.name for p in tests.iterdir() if p.is_dir() and p.name not in ("system", "scripts", "__pycache__")
    }
    assert folders <= package, folders - package
    names = {p.stem for p in tests.rglob("test_*.py")}
    importing = {
        p.relative_to(tests).as_posix()
        for p in tests.rglob("*.py")
        if re.search(r"^\s*(from|import) (" + "|".join(names) + r")\b", p.read_text(), flags=re.M)
    }
    assert importing == set(), "a test module imports another: move the helper into tests/conftest.py"


def test_parallel_train_and_the_weight_formats_name_no_model_family():
    # what a model needs for tp, pp and activation checkpointing is its family's (ModelFamily), next to the model;
    # so are its converters to other weight formats (ModelFamily.hf: models/hf/ reads and writes the folder)
    names = re.compile(r"\b(gpt|llama|resnet|vgg|vit|timm)", re.I)
    files = [p for folder in ("parallel", "train") for p in sorted((SRC / folder).rglob("*.py"))]
    named = [
        f"{p.relative_to(SRC).as_posix()}:{i}: {line.strip()}"
        for p in [*files, *sorted((SRC / "models" / "hf").glob("*.py"))]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if names.search(line)
    ]
    assert len(files) > 20 and named == [], "ask the model's family (ddpkit.models.model_family) instead"


def _folder_order() -> list[str]:
    """docs/architecture.md's folder order, lowest first: `base`, `config`, ..., `top`."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc.split("## The folder order\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `(\w+)/?`", section, flags=re.M)


ENTRY_MODULES = ("__init__", "__main__", "cli")  # the root modules above every folder (`top`)


def _rank_of(parts: tuple[str, ...], order: list[str]) -> int:
    """The place in `order` of the module at ddpkit/<parts> (a folder's modules share their folder's place)."""
    if len(parts) > 1 or (SRC / parts[0]).is_dir():
        return order.index(parts[0])
    return order.index("top" if parts[0] in ENTRY_MODULES else "base")


# imports against the order still in the code, each with what must move; the list only shrinks (a fixed one
# fails the test until it is taken off)
KNOWN_UPWARD: dict[str, str] = {}


def test_no_folder_imports_a_higher_one():
    import ast

    order = _folder_order()
    assert order[0] == "base" and order[-1] == "top" and "parallel" in order, order
    upward = {}
    for path in _sources():
        parts = path.relative_to(SRC).with_suffix("").parts
        mine = _rank_of(parts, order)
        for node in ast.walk(ast.parse(path.read_text())):  # module level and inside functions alike
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in (n.split(".")[1:] for n in names if n.split(".")[0] == "ddpkit"):
                target = (
                    tuple(name[:2]) if name and (SRC / name[0]).is_dir() else tuple(name[:1]) or ("__init__",)
                )
                if _rank_of(target, order) > mine:
                    upward[f"{path.relative_to(SRC).as_posix()} -> {order[_rank_of(target, order)]}"] = (
                        node.lineno
                    )
    assert sorted(set(upward) - set(KNOWN_UPWARD)) == [], (
        "an import from a higher folder (docs/architecture.md)"
    )
    assert sorted(set(KNOWN_UPWARD) - set(upward)) == [], "fixed: take it off KNOWN_UPWARD"


ALONE = r"""
import ast, importlib, os, sys, pathlib, traceback

src = pathlib.Path(sys.argv[1])
modules, third_party = [], set()
for path in sorted(src.rglob("*.py")):
    parts = path.relative_to(src.parent).with_suffix("").parts
    if parts[-1] != "__main__":
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    for node in ast.parse(path.read_text()).body:  # what the modules import at their top, imported here once
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        third_party |= {n for n in names if n.split(".")[0] not in ("ddpkit", "__future__")}
for name in sorted(third_party):
    importlib.import_module(name)
assert not [m for m in sys.modules if m.split(".")[0] == "ddpkit"]
failed = 0
for name in modules:
    read, write = os.pipe()
    if os.fork() == 0:  # a child with no ddpkit module imported: this one alone
        os.close(read)
        try:
            importlib.import_module(name)
        except BaseException:
            os.write(write, f"{name}: {traceback.format_exc().splitlines()[-1]}\n".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as said:
        message = said.read()
    os.wait()
    failed += bool(message)
    sys.stdout.write(message)
print(f"{len(modules)} modules, {failed} failed")
"""


def test_every_module_imports_alone_with_no_other_imported_first():
    # one interpreter imports torch and the other third-party modules once; a fork of it per ddpkit module
    # imports that module alone (a module that needs another imported first fails there)
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", ALONE, str(SRC)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    n = len([p for p in _sources() if p.name != "__main__.py"])
    assert proc.stdout.splitlines()[-1] == f"{n} modules, 0 failed", proc.stdout[-3000:]


def _module_name(path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _every_import(tree):
    """(import statement, inside a function, under TYPE_CHECKING) for every import statement of a module: its body,
    its if/try and TYPE_CHECKING blocks, its classes and its functions alike."""
    import ast

    def visit(node, in_function: bool, typing_only: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function, typing_only
            deeper = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            checking = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            yield from visit(child, deeper, typing_only or checking)

    yield from visit(tree, False, False)


def _import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(module -> the ddpkit modules any of its import statements names, [(importer, target, line)] of those
    inside functions)."""
    import ast

    trees = {_module_name(p): ast.parse(p.read_text()) for p in _sources()}
    graph: dict[str, set[str]] = {m: set() for m in trees}
    inside = []
    for m, tree in trees.items():
        for node, in_function, _ in _every_import(tree):
            targets = _ddpkit_targets(node, trees) - {m}
            graph[m] |= targets
            inside += [(m, t, node.lineno) for t in sorted(targets) if in_function]
    return graph, inside


def _a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle in `graph` (module -> the modules it imports), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return []

    return next((c for n in sorted(graph) if n not in state and (c := visit(n, [n]))), [])


def test_no_import_cycle_between_modules():
    # every import statement counts, one inside a function or under TYPE_CHECKING too: an import that only
    # dodges a cycle at run time leaves the cycle in the code
    # the finder itself: a two-module cycle and a chain
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    graph, inside = _import_graph()
    assert sum(map(len, graph.values())) > 400 and len(inside) > 20  # the scan sees the imports
    assert _a_cycle(graph) == [], "modules that import each other: move what both need below them"


# Third-party packages that take 15 ms or more to import (torch about 2 s): what an import inside a function may
# defer. A module is heavy when importing it imports one of them (its top-level imports, followed through ddpkit).
HEAVY = ("torch", "numpy", "yaml", "matplotlib", "tokenizers", "torchvision", "timm", "transformers")

# The imports of a ddpkit module inside a function, each with why it waits: the importer is light and must stay
# so (the command line and `import ddpkit` import no torch before a launch has started its fork server; a
# config loads without torch or yaml's parser), and the target is heavy. The list is checked both ways.
_TORCH_FREE_CLI = "the command line imports no torch before the launcher's fork server starts"
_NO_YAML = "a config given as KEY=VALUE or read from a checkpoint needs no YAML parser"
DEFERRED: dict[str, str] = {
    "ddpkit.cli -> ddpkit.distributed.runtime": _TORCH_FREE_CLI,
    "ddpkit.cli -> ddpkit.train.metrics": "only when stdout's reader went away (torch)",
    "ddpkit.commands.bench -> ddpkit.config.safe_yaml": "bench reads the user's config file only when given one",
    "ddpkit.commands.lm.export -> ddpkit.checkpoint": "`ddpkit export --help` imports no torch",
    "ddpkit.commands.lm.export -> ddpkit.models.loading": "`ddpkit export --help` imports no torch",
    "ddpkit.commands.run -> ddpkit.distributed.runtime": "a rank of `ddpkit run` execs the script without torch",
    "ddpkit.commands.train -> ddpkit.checkpoint": _TORCH_FREE_CLI,
    "ddpkit.commands.train -> ddpkit.checkpoint.background": _TORCH_FREE_CLI,
    "ddpkit.commands.train -> ddpkit.train.health": _TORCH_FREE_CLI,
    "ddpkit.commands.train -> ddpkit.train.rundir": _TORCH_FREE_CLI,
    "ddpkit.commands.train -> ddpkit.train.trainer": _TORCH_FREE_CLI,
    "ddpkit.config -> ddpkit.config.safe_yaml": _NO_YAML,
    "ddpkit.config.bounded -> ddpkit.config.safe_yaml": _NO_YAML,
    "ddpkit.config.keys -> ddpkit.config.safe_yaml": _NO_YAML,
    "ddpkit.config.reference -> ddpkit.config.safe_yaml": _NO_YAML,
    "ddpkit.data.builtin -> ddpkit.data.tensor_sets": "the data registry checks names without torch",
    "ddpkit.data.registry -> ddpkit.data.checked": "the data registry checks names without torch",
    "ddpkit.data.registry -> ddpkit.distributed.collectives": "the data registry checks names without torch",
    "ddpkit.data.text -> ddpkit.checkpoint": "the data registry checks names without torch",
    "ddpkit.data.text.tokenizer -> ddpkit.distributed.collectives": "the tokenizer reads its file without torch",
    "ddpkit.data.vision -> ddpkit.data.tv_classes": "torchvision only for a torchvision data set",
    "ddpkit.launcher.spawn -> ddpkit.distributed.runtime": "a spawned worker's parent imports no torch",
    "ddpkit.launcher.usermain -> ddpkit.distributed.runtime": "a user's script runs before torch is imported",
    "ddpkit.models -> ddpkit.models.hf": "model.arch is checked without torch",
    "ddpkit.models -> ddpkit.models.torchvision.model": "model.arch is checked without torch",
    "ddpkit.models -> ddpkit.models.weights": "model.arch is checked without torch",
    "ddpkit.parallel.compression_method -> ddpkit.parallel.powersgd": "dist.grad_compression is checked without torch",
    "ddpkit.parallel.plan -> ddpkit.models.blocks": "the layout is planned before workers start, without torch",
    "ddpkit.parallel.strategies.ddp -> ddpkit.parallel.experts.apply": "a strategy's entry is read without torch",
    "ddpkit.parallel.strategies.fsdp -> ddpkit.parallel.experts.apply": "a strategy's entry is read without torch",
    "ddpkit.parallel.strategies.zero1 -> ddpkit.parallel.optimizer": "a strategy's entry is read without torch",
    "ddpkit.parallel.strategy -> ddpkit.checkpoint.sharded": "a strategy's entry is read without torch",
    "ddpkit.parallel.strategy -> ddpkit.checkpoint.state_dict": "a strategy's entry is read without torch",
    "ddpkit.train.curves -> ddpkit.train.metrics": "`ddpkit report` reads runs without torch",
}
MAX_DEFERRED = 60


def _heavy_modules() -> set[str]:
    """The ddpkit modules whose import imports a HEAVY package (their top-level imports and their parents')."""
    import ast

    modules = {_module_name(p): p for p in _sources()}
    ours: dict[str, set[str]] = {}
    heavy: set[str] = set()
    for name, path in modules.items():
        found = set()
        for node, in_function, typing_only in _every_import(ast.parse(path.read_text())):
            if in_function or typing_only:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.module:
                names += [f"{node.module}.{a.name}" for a in node.names]
            found |= {n for n in names if n.split(".")[0] == "ddpkit"}
            if any(n.split(".")[0] in HEAVY for n in names):
                heavy.add(name)
        parents = {".".join(n.split(".")[:i]) for n in found | {name} for i in range(1, n.count(".") + 1)}
        ours[name] = {n for n in found | parents if n in modules} - {name}
    changed = True
    while changed:
        grown = {m for m, deps in ours.items() if deps & heavy} - heavy
        heavy |= grown
        changed = bool(grown)
    return heavy


def test_an_import_inside_a_function_defers_a_heavy_module_for_a_light_one():
    heavy = _heavy_modules()
    assert {"ddpkit.train.trainer", "ddpkit.config.safe_yaml"} <= heavy and "ddpkit.cli" not in heavy
    assert not heavy & {"ddpkit", "ddpkit.cli", "ddpkit.config", "ddpkit.models", "ddpkit.commands"}
    _, inside = _import_graph()
    found = {f"{importer} -> {target}" for importer, target, _ in inside}
    needless = sorted(
        f"{i} -> {t} (line {n})" for i, t, n in inside if i in heavy or t not in heavy
    )  # a heavy importer pays for its target anyway; a light target costs nothing to import at the top
    assert needless == [], "move it to the top of its module"
    assert sorted(found - set(DEFERRED)) == [], "a new import inside a function: say why in DEFERRED"
    assert sorted(set(DEFERRED) - found) == [], "gone: take it off DEFERRED"
    assert len(inside) <= MAX_DEFERRED and all(DEFERRED.values())


def test_two_test_processes_at_once_never_share_a_port_range():
    # a test run beside another (or a second xdist worker) must draw its ports from a range no one else holds
    import subprocess
    import sys

    import conftest

    mine = conftest.free_port()
    other = subprocess.run(
        [sys.executable, "-c", "import conftest; p = conftest.free_port(); r = conftest._PORTS[0]; print(r.start, r.stop, p)"],
        cwd=REPO / "tests", capture_output=True, text=True, timeout=120, env=conftest.cli_env(),
    )  # fmt: skip
    assert other.returncode == 0, other.stderr[-2000:]
    start, stop, port = map(int, other.stdout.split())
    theirs = range(start, stop)
    assert mine in conftest._PORTS[0] and port in theirs and mine != port
    assert set(conftest._PORTS[0]).isdisjoint(theirs)


# In-function imports of a ddpkit module that imports the importing module back at its top (directly or through
# other modules): a cycle dodged, not removed. Each entry says what must move; the list only shrinks.
DODGED_CYCLES: dict[str, str] = {}


def _ddpkit_targets(node, modules) -> set[str]:
    """The ddpkit modules a `from ddpkit.x import y` / `import ddpkit.x` names (y too when it is a module)."""
    import ast

    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if not isinstance(node, ast.ImportFrom) or node.level or not node.module or node.module not in modules:
        return set()
    subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
    return subs | (
        {node.module} if len(subs) < len(node.names) else set()
    )  # a package only for its own names


def test_no_import_inside_a_function_dodges_a_cycle():
    import ast

    trees = {_module_name(p): ast.parse(p.read_text()) for p in _sources()}
    top = {m: set().union(*[_ddpkit_targets(n, trees) for n in t.body]) for m, t in trees.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in top[todo.pop()] - seen:
                if nxt == goal:
                    return True
                seen.add(nxt)
                todo.append(nxt)
        return False

    dodged = set()
    for m, tree in trees.items():
        for fn in (f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                dodged |= {f"{m} -> {t}" for t in _ddpkit_targets(node, trees) if t != m and reaches(t, m)}
    assert sorted(dodged - set(DODGED_CYCLES)) == [], (
        "an import inside a function dodges a cycle: break the cycle"
    )
    assert sorted(set(DODGED_CYCLES) - dodged) == [], "fixed: take it off DODGED_CYCLES"


def test_the_trainer_branches_on_no_layout_and_no_metrics_field_reads_it():
    # the step runner is chosen once (train/steps RUNNERS); metrics fields take the values EpochEnd hands them
    import ast
    import dataclasses

    from ddpkit.train.metrics_file import EpochEnd

    tree = ast.parse((SRC / "train" / "trainer.py").read_text())
    layout_words = {"pp", "tp", "pipeline", "pipeline_trainer", "PipelineRunner"}
    named = [
        f"{n.lineno}: {n.attr if isinstance(n, ast.Attribute) else n.id}"
        for n in ast.walk(tree)
        if (isinstance(n, ast.Attribute) and n.attr in layout_words)
        or (isinstance(n, ast.Name) and n.id in layout_words)
    ]
    imports = [
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and "pipeline" in (n.module or "")
    ]
    assert named == [] and imports == [], "ask the step runner (train/steps/)"
    assert {f.name for f in dataclasses.fields(EpochEnd)} >= {"step", "lr", "speed", "peak_memory"}
    schema = ast.parse((SRC / "train" / "metrics_file.py").read_text())
    assert "trainer" not in {f.name for f in dataclasses.fields(EpochEnd)}
    assert [n.lineno for n in ast.walk(schema) if isinstance(n, ast.Attribute) and n.attr == "trainer"] == []


def test_every_registry_loads_its_built_ins_one_way_and_says_did_you_mean_once():
    # a registry's built-ins come through builtins= (made when it is first asked), never registered as a module
    # is imported; the closest-name hint is Registry.hint, written once
    import ast

    made, eager = [], []
    for path in _sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Registry":
                made.append((path.name, {k.arg for k in node.keywords}))
        top_calls = [n.value for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
        top_calls += [
            n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
        ]
        loops = [n for n in tree.body if isinstance(n, ast.For)]
        for call in top_calls + [c for loop in loops for c in ast.walk(loop) if isinstance(c, ast.Call)]:
            name = ast.unparse(call.func)
            if name.startswith("register") or name.endswith(".register"):
                eager.append(f"{path.relative_to(SRC)}: {name}")
    assert len(made) >= 6 and [m for m in made if "builtins" not in m[1]] == [], made
    assert eager == [], "give the registry its built-ins with builtins="
    hints = {p.relative_to(SRC).as_posix() for p in _sources() if "get_close_matches" in p.read_text()}
    asked = {
        "cli.py",
        "models/__init__.py",
        "data/registry.py",
        "parallel/strategy.py",
        "parallel/compression.py",
    }
    assert "registry.py" in hints and not asked & hints, hints
