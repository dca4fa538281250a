"""The layout rules a newcomer relies on, checked: declared channels, registries asked instead of name lists."""

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


def test_a_moved_module_is_importable_by_its_old_name_as_the_same_module():
    import importlib

    from ddpkit._moved import MOVED

    for old, new in MOVED.items():
        assert not (SRC.parent / (old.replace(".", "/") + ".py")).exists(), f"{old}: a file at the old path"
        module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert module.__spec__.name == new, f"{old}: the module keeps its own spec"


def test_no_folder_holds_more_than_twelve_modules():
    folders = {p.parent for p in _sources()}
    crowded = {
        f.relative_to(SRC).as_posix() or ".": n
        for f in folders
        if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > 12
    }
    assert crowded == {}


def test_every_folder_is_on_the_architecture_map_and_every_folder_on_it_exists():
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc.split("## The folders\n", 1)[1].split("\n## ", 1)[0]
    mapped = re.findall(r"^\| `([\w/]+/)` \|", section, flags=re.M)
    folders = {"ddpkit/"} | {p.parent.relative_to(SRC).as_posix() + "/" for p in SRC.rglob("*/__init__.py")}
    assert sorted(mapped) == sorted(folders)
