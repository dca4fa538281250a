"""ddpkit report and write_curves on real runs: the picture, the table, the HTML page, resumes, bad input."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import numpy as np
import pytest
from PIL import Image

from conftest import assert_user_error, cli_env, run_cli, train_here
from ddpkit.cli import main
from ddpkit.commands import report

RUN = ["train.epochs=2", "train.batch_size=64"]  # digits, the built-in CNN: 2 epochs in seconds


def train(out_dir, *args):
    proc = run_cli("train", f"out_dir={out_dir}", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out_dir


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """One process: 1 epoch, then the same settings with train.epochs=2 (resumes after epoch 1)."""
    out = tmp_path_factory.mktemp("resumed") / "one"
    train_here(f"out_dir={out}", "train.epochs=1", "train.batch_size=64")
    train_here(f"out_dir={out}", *RUN)
    assert "resumed from" in (out / "log.txt").read_text()
    return out


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory):
    """The same recipe on 2 processes, uninterrupted."""
    return train(tmp_path_factory.mktemp("two") / "two", *RUN, "--nproc-per-node", "2")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """The real CLI entry point, in this process (no training happens in report)."""
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def panels(png_path, run_dirs) -> list[np.ndarray]:
    """The pixels inside each plot area of a report PNG (the layout is fixed: same figure, same axes)."""
    img = np.asarray(Image.open(png_path).convert("RGB"))
    runs = [report.load_run(d) for d in run_dirs]
    fig = report.figure(runs, report.labels(runs, report.differing_keys(runs)))
    h, w = img.shape[:2]
    boxes = []
    for ax in fig.axes:
        x0, y0, x1, y1 = ax.get_position().extents
        boxes.append(img[int(h * (1 - y1)) + 3 : int(h * (1 - y0)) - 3, int(w * x0) + 3 : int(w * x1) - 3])
    return boxes


def count_color(box: np.ndarray, color: str) -> int:
    from matplotlib.colors import to_rgb

    rgb = np.array([round(255 * c) for c in to_rgb(color)])
    return int((np.abs(box.astype(int) - rgb).max(axis=-1) <= 2).sum())


def table_rows(stdout: str) -> dict[str, dict[str, str]]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    body = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    return {cells[0]: dict(zip(head, cells, strict=True)) for cells in body}


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.imgs, self.urls, self.pre = [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href"):
                self.urls.append(value)
                if tag == "img":
                    self.imgs.append(value)

    def handle_data(self, data):
        if self.tags and self.tags[-1] == "pre":
            self.pre.append(data)


def expected(run_dir, target: float) -> dict:
    """The report's numbers, computed here from metrics.jsonl."""
    r = rows(run_dir)
    accs = [(x["epoch"], x["val_acc1"]) for x in r if x["val_acc1"] is not None]
    hit = next(i for i, x in enumerate(r) if x["val_acc1"] is not None and x["val_acc1"] >= target)
    return {
        "final": accs[-1][1],
        "best": max(a for _, a in accs),
        "target_epoch": r[hit]["epoch"],
        "target_wall": sum(x["epoch_time_s"] for x in r[: hit + 1]),
        "ips": sum(x["train_images_per_s"] for x in r) / len(r),
        "time": sum(x["epoch_time_s"] for x in r),
        "world": r[-1]["world_size"],
        "batch": r[-1]["global_batch_size"],
    }


@pytest.mark.slow
def test_report_compares_one_and_two_processes(resumed, two_procs, tmp_path):
    png, page, js = tmp_path / "cmp.png", tmp_path / "cmp.html", tmp_path / "cmp.json"
    target = 0.5
    dirs = [str(resumed), str(two_procs)]
    proc = run_cli(
        "report", *dirs, "--out", str(png), "--html", str(page), "--json", str(js), "--target", str(target)
    )
    assert proc.returncode == 0, proc.stderr

    image = Image.open(png)
    image.load()
    assert image.size == (report.FIG_SIZE_IN[0] * report.FIG_DPI, report.FIG_SIZE_IN[1] * report.FIG_DPI)
    for box in panels(png, [resumed, two_procs]):  # every panel shows both runs: C0 = first, C1 = second
        assert count_color(box, "C0") > 10 and count_color(box, "C1") > 10

    table = table_rows(proc.stdout)
    doc = json.loads(js.read_text())
    assert doc["differing_keys"] == ["world_size"]
    for run_dir, s in zip([resumed, two_procs], doc["runs"], strict=True):
        want, cells = expected(run_dir, target), table[str(run_dir)]
        assert s["final_val_acc1"] == want["final"] and s["best_val_acc1"] == want["best"]
        assert s["target_epoch"] == want["target_epoch"]
        assert s["target_wall_s"] == pytest.approx(want["target_wall"], abs=1e-9)
        assert s["mean_images_per_s"] == pytest.approx(want["ips"], abs=1e-9)
        assert s["train_time_s"] == pytest.approx(want["time"], abs=1e-9)
        assert s["label"] == f"world_size={want['world']}"
        assert cells["final val_acc1"] == f"{100 * want['final']:.2f}%"
        assert cells["best val_acc1 (epoch)"].startswith(f"{100 * want['best']:.2f}%")
        assert cells["epoch reaching 50.00%"] == str(want["target_epoch"])
        assert cells["mean images/s"] == f"{want['ips']:.1f}"
        assert cells["world size"] == str(want["world"]) and cells["global batch"] == str(want["batch"])
        assert cells["strategy"] == ("ddp" if want["world"] > 1 else "single")
        assert cells["differs"] == f"world_size={want['world']}"
    assert (
        table[str(resumed)]["resumed after epoch"] == "1"
        and table[str(two_procs)]["resumed after epoch"] == "-"
    )

    parsed = _Page()
    parsed.feed(page.read_text())
    parsed.close()
    assert len(parsed.imgs) == 1 and parsed.imgs[0].startswith("data:image/png;base64,")
    png_in_page = base64.b64decode(parsed.imgs[0].split(",", 1)[1])
    assert Image.open(io.BytesIO(png_in_page)).size == image.size
    assert parsed.urls == parsed.imgs  # nothing fetched from anywhere: no scripts, stylesheets or links
    assert "script" not in parsed.tags and "link" not in parsed.tags and "table" in parsed.tags
    shown = "".join(parsed.pre)
    assert all((d / "config.yaml").read_text() in shown for d in (resumed, two_procs))


def test_resumed_run_plots_each_epoch_once(resumed, tmp_path, capsys):
    js = tmp_path / "r.json"
    code, out, err = cli(capsys, "report", str(resumed), "--out", str(tmp_path / "r.png"), "--json", str(js))
    assert code == 0, err
    (s,) = json.loads(js.read_text())["runs"]
    assert s["series"]["epoch"] == [1, 2] and s["resumed_after"] == [1]
    assert s["series"]["val_acc1"] == [r["val_acc1"] for r in rows(resumed)]


@pytest.mark.slow
def test_an_epoch_written_twice_later_line_wins(resumed, tmp_path, capsys):
    run = tmp_path / "dup"
    shutil.copytree(resumed, run)
    again = dict(rows(resumed)[-1], val_acc1=0.123, train_loss=9.5)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(again) + "\n")
    js = tmp_path / "d.json"
    code, _, err = cli(capsys, "report", str(run), "--out", str(tmp_path / "d.png"), "--json", str(js))
    assert code == 0, err
    (s,) = json.loads(js.read_text())["runs"]
    assert s["series"]["epoch"] == [1, 2]
    assert s["series"]["val_acc1"][-1] == 0.123 and s["final_val_acc1"] == 0.123
    assert s["series"]["train_loss"][-1] == 9.5
    assert s["resumed_after"] == [1]


def test_legend_names_runs_by_what_differs_in_their_configs(resumed, tmp_path):
    runs = []
    for name, lr in (("a", "0.1"), ("b", "0.4")):
        shutil.copytree(resumed, tmp_path / name)
        cfg = tmp_path / name / "config.yaml"
        text, n = re.subn(r"(?m)^  lr: .*$", f"  lr: {lr}", cfg.read_text())
        assert n == 1, "the config's optim.lr line"
        cfg.write_text(text)
        runs.append(report.load_run(tmp_path / name))
    keys = report.differing_keys(runs)
    assert keys == ["optim.lr"]  # out_dir always differs and never names a run
    assert report.labels(runs, keys) == ["optim.lr=0.1", "optim.lr=0.4"]
    assert report.labels(runs[:1], []) == ["a"]


def test_write_curves_on_a_real_run(resumed, tmp_path):
    run = tmp_path / "curves"
    shutil.copytree(resumed, run)
    assert (run / "curves.png").is_file()  # ddpkit train drew it when it ended (report.curves=true)
    (run / "curves.png").unlink()
    before = sorted(p.name for p in run.iterdir())
    path = report.write_curves(run)
    assert path == run / "curves.png"
    assert sorted(p.name for p in run.iterdir()) == sorted([*before, "curves.png"])  # no temporary left
    assert Image.open(path).size == (1200, 800)
    assert all(count_color(box, "C0") > 10 for box in panels(path, [run]))


@pytest.mark.slow
def test_a_one_node_launch_draws_its_curves_in_the_launcher(resumed, two_procs):
    # --nproc-per-node 2: the launcher imported matplotlib while the workers trained and drew the picture after
    # them; rank 0 did not (it says so in log.txt when it does, as the single process of `resumed` did).
    assert "curves: " in (resumed / "log.txt").read_text()
    assert "curves: " not in (two_procs / "log.txt").read_text()
    path = two_procs / "curves.png"
    assert Image.open(path).size == (1200, 800)
    assert all(count_color(box, "C0") > 10 for box in panels(path, [two_procs]))


def test_default_out_is_report_png_in_the_current_folder(resumed, tmp_path):
    proc = run_cli("report", str(resumed), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert Image.open(tmp_path / "report.png").size == (1200, 800)
    assert f"| {resumed} | 1 | 64 | single | 2 |" in proc.stdout


def test_the_report_command_imports_no_torch(resumed, tmp_path):
    # Before: writing the picture went through the checkpoint module, and a report paid for torch's import.
    code = (
        "import sys; from ddpkit.cli import run; "
        f"code = run(['report', {str(resumed)!r}, '--out', 'r.png']); "
        "print('torch' in sys.modules); sys.exit(code)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=cli_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "False" and (tmp_path / "r.png").is_file()


def _bad_runs(base, tmp_path) -> dict[str, tuple[list[str], str]]:
    def copy(name, metrics=None, drop=None):
        d = tmp_path / name
        shutil.copytree(base, d)
        if metrics is not None:
            (d / "metrics.jsonl").write_text(metrics)
        if drop:
            (d / drop).unlink()
        return str(d)

    good = (base / "metrics.jsonl").read_text()
    return {
        "missing dir": ([str(tmp_path / "nope")], "does not exist"),
        "a file": ([str(base / "log.txt")], "is not a directory"),
        "no metrics": ([copy("nometrics", drop="metrics.jsonl")], "has no metrics.jsonl"),
        "empty metrics": ([copy("empty", metrics="")], "holds no epoch yet"),
        # lines that are not ddpkit's are skipped and counted (test_hostile_inputs.py): none left, no epoch
        "garbage line": ([copy("garbage", metrics="{not json\n" + "{not json\n")], "1 line(s) that are not"),
        "no epoch": ([copy("noepoch", metrics='{"val_acc1": 0.5}\n')], "holds no epoch yet (1 line(s)"),
        "text number": (
            [copy("text", metrics=good.splitlines()[0].replace('"lr": ', '"lr": "x", "y": ', 1) + "\n")],
            "holds no epoch yet (1 line(s)",
        ),
        "no config": ([copy("noconfig", drop="config.yaml")], "has no config.yaml"),
        "target 0": ([str(base), "--target", "0"], "--target 0.0 is not in (0, 1]"),
        "target 1.5": ([str(base), "--target", "1.5"], "is not in (0, 1]"),
        "out folder": ([str(base), "--out", str(tmp_path / "no" / "r.png")], "does not exist"),
        "out suffix": ([str(base), "--out", str(tmp_path / "r.txt")], "does not end in .png"),
        "html folder": ([str(base), "--html", str(tmp_path / "no" / "r.html")], "does not exist"),
        "html suffix": ([str(base), "--html", str(tmp_path / "a.json")], "does not end in .html"),
        "twice": ([str(base), str(base)], "given twice"),
        "launch flag": ([str(base), "--nproc-per-node", "2"], "launch flags do not apply"),
    }


def test_bad_input_is_one_line_and_writes_nothing(resumed, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    for name, (args, fragment) in _bad_runs(resumed, tmp_path).items():
        extra = [] if "--out" in args else ["--out", str(out / "r.png")]
        code, stdout, err = cli(capsys, "report", *args, *extra)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("ddpkit: error: "), (name, err)
        assert fragment in lines[0], (name, lines[0])
        assert list(out.iterdir()) == [] and stdout == "", name


def test_bad_input_from_the_command_line(resumed, tmp_path):
    # A good run then a bad one: nothing is drawn before every input is checked; no traceback.
    proc = run_cli("report", str(resumed), str(tmp_path / "nope"), "--out", str(tmp_path / "r.png"))
    assert_user_error(proc, "run directory", "does not exist")
    assert not (tmp_path / "r.png").exists()


@pytest.mark.parametrize(
    ("nnodes", "curves", "draws"), [(1, True, True), (2, True, False), (1, False, False)]
)
def test_only_a_one_node_launcher_draws_the_curves(nnodes, curves, draws):
    # with several nodes a launcher cannot know whether rank 0 is on its node: rank 0 draws
    from ddpkit.commands import train
    from ddpkit.config import load_config
    from ddpkit.launcher.spec import LaunchSpec

    cfg = load_config(None, [f"report.curves={str(curves).lower()}"])
    tail = train.in_launcher(cfg, LaunchSpec(nnodes=nnodes, nproc_per_node=2))
    assert (tail is not None) is draws


def test_resumes_come_from_metrics_jsonl_alone(resumed, tmp_path, capsys):
    run = tmp_path / "nolog"
    shutil.copytree(resumed, run)
    (run / "log.txt").unlink()  # the numbers and the resume marks are all in metrics.jsonl
    assert [r.get("resumed_after") for r in rows(run)] == [None, 1]
    js = tmp_path / "n.json"
    code, _, err = cli(capsys, "report", str(run), "--out", str(tmp_path / "n.png"), "--json", str(js))
    assert code == 0, err
    (s,) = json.loads(js.read_text())["runs"]
    assert s["resumed_after"] == [1] and s["series"]["epoch"] == [1, 2]


def test_nan_and_infinity_in_metrics_are_named_and_left_out(resumed, tmp_path, capsys):
    run = tmp_path / "nan"
    shutil.copytree(resumed, run)
    last = rows(resumed)[-1]
    text = (run / "metrics.jsonl").read_text().splitlines()
    text[-1] = json.dumps(dict(last, train_loss=float("nan"), val_loss=float("inf")))  # JSON's NaN, Infinity
    (run / "metrics.jsonl").write_text("\n".join(text) + "\n")
    js = tmp_path / "nan.json"
    code, _, err = cli(capsys, "report", str(run), "--out", str(tmp_path / "nan.png"), "--json", str(js))
    assert code == 0, err
    (warning,) = [ln for ln in err.splitlines() if "NaN or Infinity" in ln]
    assert warning.startswith("ddpkit: warning: ") and "train_loss, val_loss" in warning
    assert f"line(s) {len(text)}" in warning
    (s,) = json.loads(js.read_text())["runs"]
    assert s["series"]["train_loss"][-1] is None and s["series"]["val_loss"][-1] is None
    assert s["series"]["val_acc1"][-1] == last["val_acc1"]
