"""The metrics.jsonl schema: one declaration that the trainer's lines, docs/run-dir.md and the readers share.

Time budget: under a second (no training; the lines of real runs are checked in test_text_lm.py and
test_trainer.py).
"""

from __future__ import annotations

import ast

import pytest

from conftest import REPO
from ddpkit.train import metrics_file as metrics_schema
from ddpkit.train.metrics import METRIC_KEYS


def test_run_dir_doc_table_is_the_schemas():
    text = (REPO / "docs" / "run-dir.md").read_text()
    section = text.split("## metrics.jsonl\n", 1)[1].split("\n## ", 1)[0]
    assert metrics_schema.doc_table() in section


def test_each_field_is_declared_once_with_a_meaning():
    names = [f.name for f in metrics_schema.FIELDS]
    assert len(names) == len(set(names)) and set(METRIC_KEYS) == set(metrics_schema.EVERY_LINE)
    assert all(f.meaning and f.kind in (int, float, str) for f in metrics_schema.FIELDS)
    assert {"val_ppl", "train_tokens_per_s", "param_bytes_per_rank", "resumed_after"} <= set(names)


def test_the_schema_reads_each_field_the_trainer_does_not_get_elsewhere():
    # adding a metric is one Field with its value; only the task's train_*, the evaluation's val_* and the run's
    # first-line fields come from the trainer's own parts
    own = {f.name for f in metrics_schema.FIELDS if f.value is None}
    elsewhere = {
        f.name for f in metrics_schema.FIELDS if f.name.startswith(("train_", "val_")) or f.lines != "every"
    }
    assert own == elsewhere
    trainer_py = (REPO / "src" / "ddpkit" / "train" / "trainer.py").read_text()
    assert "measured(EpochEnd(" in trainer_py and "make_row(" in trainer_py


def test_make_row_orders_the_fields_and_refuses_undeclared_or_missing_ones():
    every = dict.fromkeys(metrics_schema.EVERY_LINE)
    row = metrics_schema.make_row(**{"startup_s": 1.5, **dict(reversed(every.items()))})
    assert list(row) == [*metrics_schema.EVERY_LINE, "startup_s"]  # the schema's order, not the caller's
    with pytest.raises(ValueError, match="undeclared fields \\['accuracy'\\]"):
        metrics_schema.make_row(**every, accuracy=1.0)
    with pytest.raises(ValueError, match="missing fields \\['val_ppl'\\]"):
        metrics_schema.make_row(**{k: v for k, v in every.items() if k != "val_ppl"})


def test_bad_value_names_a_field_of_the_wrong_type():
    assert metrics_schema.bad_value({"epoch": 1, "lr": 0.1, "backend": "gloo", "val_loss": None}) is None
    assert metrics_schema.bad_value({"epoch": 1, "lr": "0.1"}) == "lr"
    assert metrics_schema.bad_value({"backend": 3}) == "backend"
    assert metrics_schema.bad_value({"step": True}) == "step"


def test_report_and_bench_read_no_log_file():
    for module in (
        "commands/report/__init__.py",
        "train/curves/__init__.py",
        "train/curves/drawing.py",
        "commands/bench.py",
    ):
        tree = ast.parse((REPO / "src" / "ddpkit" / module).read_text())
        strings = {
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        assert not [s for s in strings if "log.txt" in s and "metrics" not in s], module
