"""A nanoGPT-style GPT (tied token embedding and head, fused q/k/v, forward(idx, targets) -> (logits, loss)) and
its one-process training loop (tests/scripts/nanogpt.py), ported with `ddpkit run --nproc-per-node 2`:
prepare(tp=2) with an MLP plan and with the attention split head-wise (FusedColwiseParallel), and prepare(pp=2)
across the tied weights, each print the unported script's losses at every step and its validation loss; a plan
naming no module is one error line for the job, exit 2 (the other plan checks: tests/parallel/test_tp_plan.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, assert_user_error, cli_env, run_clis

SCRIPT = str(REPO / "tests" / "scripts" / "nanogpt.py")


def _numbers(out: str) -> tuple[list[float], float]:
    """(the training loss at each step, the validation loss) as rank 0 printed them, each once."""
    steps: dict[int, set[float]] = {}
    for it, loss in re.findall(r"^iter (\d+): loss (\S+)$", out, re.M):
        steps.setdefault(int(it), set()).add(float(loss))
    vals = {float(v) for v in re.findall(r"^val loss (\S+)$", out, re.M)}
    assert len(vals) == 1 and all(len(v) == 1 for v in steps.values()), out[-2000:]
    return [steps[i].pop() for i in sorted(steps)], vals.pop()


@pytest.mark.slow
def test_nanogpt_ported_to_tp_and_pp_trains_as_the_unported_script():
    plain = subprocess.run(
        [sys.executable, SCRIPT], capture_output=True, text=True, timeout=300, env=cli_env()
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    ref_losses, ref_val = _numbers(plain.stdout)
    assert len(ref_losses) == 4 and ref_losses[-1] < ref_losses[0]
    ports = ["tp", "tp-fused", "pp", "tp-typo"]
    runs = run_clis(*(["run", "--nproc-per-node", "2", SCRIPT, "--port", p] for p in ports))
    for port, proc in zip(ports[:3], runs[:3], strict=True):
        assert proc.returncode == 0, (port, proc.stdout[-2000:], proc.stderr[-3000:])
        losses, val = _numbers(proc.stdout)
        # the unported script's batches in its order, the tied weights trained as one: every step's loss
        assert losses == pytest.approx(ref_losses, rel=1e-5), port
        assert val == pytest.approx(ref_val, rel=1e-4), port
    assert_user_error(
        runs[3], "tp_plan entry 'transformer.h.*.mlp.fc' matches no module of GPT", "transformer.h.1.mlp.c_fc"
    )
