"""Rank 0's output (ddpkit.train.metrics): running sums, log.txt, metrics.jsonl and its repair on resume."""

from __future__ import annotations

import io
import math

import torch

from ddpkit.train.metrics import RunLog, RunningSums, read_metrics


def test_running_sums_count_loss_correct_and_samples():
    sums = RunningSums(torch.device("cpu"))
    assert math.isnan(sums.local()[0]) and sums.local()[2] == 0
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    sums.add(torch.tensor(0.5), logits, torch.tensor([0, 1, 1]))  # 2 of 3 right, mean loss 0.5
    sums.add(torch.tensor(2.0), logits[:1], torch.tensor([1]))  # wrong, loss 2
    loss, acc, n = sums.local()
    assert n == 4 and acc == 0.5 and loss == (0.5 * 3 + 2.0) / 4


def test_read_metrics_skips_a_torn_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n{"epoch": 2}\n{"epo')
    assert read_metrics(tmp_path) == [{"epoch": 1}, {"epoch": 2}]
    assert read_metrics(tmp_path / "missing") == []


def test_only_the_active_log_writes(tmp_path):
    quiet = RunLog(tmp_path / "rank1", active=False, stream=io.StringIO())
    quiet.info("hello")
    quiet.metrics({"epoch": 1})
    quiet.reconcile_metrics(0, None)
    quiet.close()
    assert not (tmp_path / "rank1").exists()


def test_lines_go_to_the_console_and_log_txt_and_rows_to_metrics_jsonl_and_tensorboard(tmp_path):
    console = io.StringIO()
    log = RunLog(tmp_path, active=True, stream=console)
    log.open()
    log.info("ddpkit: 1 process(es)")
    log.metrics({"epoch": 1, "train_loss": 0.5, "val_loss": None})
    log.close()
    assert console.getvalue() == "ddpkit: 1 process(es)\n"
    stamped = (tmp_path / "log.txt").read_text()
    assert stamped.endswith(" ddpkit: 1 process(es)\n") and stamped[:4].isdigit()  # a timestamp first
    assert read_metrics(tmp_path) == [{"epoch": 1, "train_loss": 0.5, "val_loss": None}]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_progress_lines_without_a_terminal_look_like_the_tutorials(tmp_path):
    console = io.StringIO()
    log = RunLog(tmp_path, active=True, stream=console)
    sums = RunningSums(torch.device("cpu"))
    sums.add(torch.tensor(1.25), torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 1]))
    for step in range(1, 8):
        log.step(step, 7, 2, 5, sums, every=3)
    log.close()
    assert console.getvalue().splitlines() == [
        "== step: [3/7] [2/5] | loss: 1.250 | acc: 50.000%",
        "== step: [6/7] [2/5] | loss: 1.250 | acc: 50.000%",
        "== step: [7/7] [2/5] | loss: 1.250 | acc: 50.000%",  # and the epoch's last step
    ]


def _rows(path) -> list[int]:
    return [r["epoch"] for r in read_metrics(path)]


def test_reconcile_keeps_exactly_the_checkpoints_epochs(tmp_path):
    log = RunLog(tmp_path, active=True, stream=io.StringIO())
    for epoch in (1, 2, 3):
        log.metrics({"epoch": epoch})
    log.reconcile_metrics(2, None)  # resumed from an older checkpoint: epoch 3 is trained again
    assert _rows(tmp_path) == [1, 2]
    log.reconcile_metrics(3, {"epoch": 3, "from": "checkpoint"})  # a crash before the line was written
    assert read_metrics(tmp_path)[-1] == {"epoch": 3, "from": "checkpoint"}
    before = (tmp_path / "metrics.jsonl").read_text()
    log.reconcile_metrics(3, {"epoch": 3, "other": 1})  # the line is there: the file is left as it is
    assert (tmp_path / "metrics.jsonl").read_text() == before
    log.reconcile_metrics(2, {"epoch": 3})  # a row of a later epoch than kept is not appended
    assert _rows(tmp_path) == [1, 2]
    log.close()


def test_lines_logged_before_the_run_owns_out_dir_are_printed_and_written_only_once_it_does(tmp_path):
    console = io.StringIO()
    log = RunLog(tmp_path / "run", active=True, stream=console)
    log.info("loaded 6/6 tensors")  # while the model is built: out_dir is not ours yet
    assert console.getvalue() == "loaded 6/6 tensors\n" and not (tmp_path / "run").exists()
    log.close()  # a check failed: nothing was written
    assert not (tmp_path / "run").exists()
    log = RunLog(tmp_path, active=True, stream=io.StringIO())
    log.info("first")
    log.open()
    log.info("second")
    log.close()
    assert [ln.split(" ", 2)[2] for ln in (tmp_path / "log.txt").read_text().splitlines()] == [
        "first",
        "second",
    ]


class _ClosedPipe(io.StringIO):
    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_console_that_went_away_ends_the_printing_not_the_run(tmp_path, monkeypatch):
    silenced = []
    monkeypatch.setattr("ddpkit.train.metrics.silence_stdout", lambda: silenced.append(True))
    log = RunLog(tmp_path, active=True, stream=_ClosedPipe())
    log.open()
    log.info("one")  # raised BrokenPipeError before
    log.info("two")
    log.step(3, 3, 1, 1, RunningSums(torch.device("cpu")), every=1)
    log.close()
    assert silenced == [True]  # stdout pointed at /dev/null once, so the exit flush cannot fail either
    assert (tmp_path / "log.txt").read_text().count("\n") == 3
