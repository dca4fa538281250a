"""The reference in docs/ matches the program: every command, launch flag and exit status it names exists, and
every one the program has is named."""

from __future__ import annotations

import re

import pytest

from conftest import REPO
from ddpkit import errors
from ddpkit.cli import command_parser
from ddpkit.commands import COMMANDS
from ddpkit.errors import Preempted, UserError, WorkerFailure

CLI_MD = (REPO / "docs" / "cli.md").read_text()


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table under `## heading`, cells stripped."""
    section = CLI_MD.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")][2:]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows]


def test_every_command_is_documented_and_every_documented_command_exists():
    documented = [re.fullmatch(r"`ddpkit (\w+)`", row[0])[1] for row in _table("Commands")]
    assert documented == list(COMMANDS)


def test_launch_flags_in_the_docs_are_the_parsers():
    parser = command_parser(COMMANDS["train"])
    group = next(g for g in parser._action_groups if g.title == "launch flags")
    flags = {a.option_strings[0] for a in group._group_actions}
    documented = {re.match(r"`(--[\w-]+)", row[0])[1] for row in _table("Launch flags")}
    assert documented == flags


def _exit_table(doc: str) -> dict[str, str]:
    """{status: meaning} of the `## Exit status` table of docs/DOC."""
    section = (REPO / "docs" / doc).read_text().split("## Exit status\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")][2:]
    return {cells[0]: cells[1] for cells in ([c.strip() for c in r.strip("|").split("|")] for r in rows)}


def _program_codes() -> set[int]:
    """Every exit code an exception of ddpkit.errors ends a command with."""
    return {
        obj.exit_code
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, Exception) and hasattr(obj, "exit_code")
    }


@pytest.mark.parametrize("doc", ["cli.md", "reliability.md"])
def test_exit_status_tables_are_the_programs_codes(doc):
    # 130: Ctrl-C in a single process (cli.main; test_cli.py::test_each_ending_is_one_line_and_its_exit_code)
    table = _exit_table(doc)
    documented = {int(k) for k in table if k.isdigit()}
    assert documented == {0, *_program_codes(), *({130} if doc == "cli.md" else ())}, table
    assert (UserError.exit_code, WorkerFailure.exit_code, Preempted.exit_code) == (2, 1, 3)
    assert "worker failed" in table["1"] and "user error" in table["2"] and "preempted" in table["3"].lower()
