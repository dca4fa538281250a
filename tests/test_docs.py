"""The reference in docs/ matches the program: every command, launch flag and exit status it names exists, and
every one the program has is named."""

from __future__ import annotations

import re

from conftest import REPO
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


def test_exit_statuses_in_the_docs_are_the_programs():
    documented = {row[0] for row in _table("Exit status")}
    assert {
        str(UserError.exit_code),
        str(WorkerFailure.exit_code),
        str(Preempted.exit_code),
        "0",
        "130",
    } <= documented
