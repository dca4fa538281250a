"""A user's transformers LlamaForCausalLM through ddpkit.prepare() with no plan and no wrapper written: the model's
own declarations (`_no_split_modules`, `config.base_model_tp_plan`, `base_model_pp_plan`) make its FSDP units,
its tensor-parallel plan and its pipeline stages. The third-party-style script tests/scripts/hf_llama.py under
`ddpkit run` prints the unported script's loss at every step under fsdp, tp=2, pp=2 and fsdp x tp; a hand-written
layer loop under pp=2 is one error line. In-process and 2-rank checks: each decoder layer its own FSDP unit, a
tied head and embedding left whole under tp, transformers styles without a torch counterpart refused.

Budget: about 60 s on a quiet 2-core machine (the reference in this process, five launches two at a time, one
2-rank group)."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, assert_user_error, run_clis, run_group
from ddpkit.errors import UserError

transformers = pytest.importorskip("transformers")

SCRIPT = str(REPO / "tests" / "scripts" / "hf_llama.py")


def _losses(out: str) -> list[float]:
    steps = re.findall(r"^step (\d+): loss (\S+)$", out, re.M)
    assert [int(s) for s, _ in steps] == list(range(len(steps))), out[-2000:]
    return [float(v) for _, v in steps]


def _unported() -> list[float]:
    """The script as its user wrote it, run in this process."""
    argv, out = sys.argv, io.StringIO()
    sys.argv = [SCRIPT]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(SCRIPT, run_name="__main__")
    finally:
        sys.argv = argv
    return _losses(out.getvalue())


@pytest.mark.slow
def test_a_transformers_llama_trains_under_every_layout_as_its_unported_script():
    reference = _unported()
    assert len(reference) == 4 and reference[-1] < reference[0]
    ports = {"fsdp": 2, "tp": 2, "pp": 2, "pp-wrapper": 2, "fsdp-tp": 4}
    runs = run_clis(
        *(["run", "--nproc-per-node", str(n), SCRIPT, "--port", port] for port, n in ports.items()),
        timeout=600,
    )
    done = dict(zip(ports, runs, strict=True))
    for port in ("fsdp", "tp", "pp", "fsdp-tp"):
        proc = done[port]
        assert proc.returncode == 0, (port, proc.stdout[-2000:], proc.stderr[-3000:])
        # every step: the unported script's batch (split_batches), its loss within 1e-4
        assert _losses(proc.stdout) == pytest.approx(reference, abs=1e-4), port
    # a hand-written layer loop passes the rotary embeddings (a tuple) across the cut: one line, what and the fix
    assert_user_error(
        done["pp-wrapper"],
        "pipeline stage 0 of Logits gives stage 1 a tuple of 2 tensors",
        "the output of llama.model.rotary_emb, crossing the cut at 'llama.model.layers.2'",
        "give prepare() the transformers model inside it (llama) itself",
    )


def _tiny(tied: bool = False, layers: int = 4):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _step_loss(model, opt, x, y) -> float:
    loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _units_plans_and_refusals(rank: int, world_size: int, folder: str) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import ddpkit

    out = {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)  # as a user brings it, on the CPU
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ddpkit.prepare(model, opt, strategy="fsdp")
    out["units"] = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
    # a head tied to the embedding under the model's own tp plan: both left whole, trains as one process
    seq = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    reference = _tiny(tied=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    tied = _tiny(tied=True)
    tied, tied_opt = ddpkit.prepare(tied, torch.optim.SGD(tied.parameters(), lr=0.5), tp=2)
    out["tied_losses"] = [
        (
            _step_loss(reference, ref_opt, seq[:, :-1], seq[:, 1:]),
            _step_loss(tied, tied_opt, seq[:, :-1], seq[:, 1:]),
        )
        for _ in range(2)
    ]
    out["split"] = sorted(
        n for n, p in tied.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()
    )
    out["tied_still"] = tied.lm_head.weight is tied.model.embed_tokens.weight
    # the pipeline's first stage: a step's x of another shape than the first step's is one line
    piped = ddpkit.prepare(
        _tiny(), pp=2, loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())
    )
    piped.step(seq[:, :-1].repeat(2, 1), seq[:, 1:].repeat(2, 1))
    for x in (seq[:, :-2].repeat(2, 1), {"input_ids": seq[:, :-1]}):
        try:
            piped.step(x, seq[:, 1:].repeat(2, 1))
        except UserError as e:
            out.setdefault("refused", []).append(str(e))
    return out


@pytest.mark.slow
def test_each_decoder_layer_is_an_fsdp_unit_and_a_tied_head_stays_whole_under_tp(tmp_path):
    _tiny().save_pretrained(tmp_path)
    r0, r1 = run_group(_units_plans_and_refusals, 2, str(tmp_path))
    # the root and each decoder layer: not <root>, model, lm_head (the whole body gathered at once)
    assert (
        r0["units"]
        == r1["units"]
        == ["", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3"]
    )
    for ref, got in r0["tied_losses"]:
        assert got == pytest.approx(ref, abs=1e-5)
    assert (
        r0["tied_still"]
        and "lm_head.weight" not in r0["split"]
        and "model.embed_tokens.weight" not in r0["split"]
    )
    assert (
        "model.layers.0.self_attn.q_proj.weight" in r0["split"]
        and "model.layers.3.mlp.down_proj.weight" in r0["split"]
    )
    shape, kind = r0["refused"]
    assert "model.step() got x of shape (4, 7)" in shape and "from x of shape (4, 8)" in shape
    assert "model.step(x, y) got a dict as x; the pipeline's first stage takes one tensor" in kind


def test_transformers_tp_styles_without_a_torch_counterpart_are_refused():
    from ddpkit.porting import hf_model

    model = _tiny()
    assert hf_model.is_hf_model(model) and not hf_model.is_hf_model(torch.nn.Linear(2, 2))
    plan = hf_model.tp_plan(model, 2)
    assert type(plan["model.layers.*.self_attn.q_proj"]).__name__ == "ColwiseParallel"
    assert type(plan["model.layers.*.self_attn.o_proj"]).__name__ == "RowwiseParallel"
    with pytest.raises(UserError, match="num_key_value_heads=2 cannot be split over 4 ranks"):
        hf_model.tp_plan(model, 4)
    model.config.base_model_tp_plan = {
        **model.config.base_model_tp_plan,
        "layers.*.mlp": "local_packed_rowwise",
    }
    with pytest.raises(
        UserError, match="splits 'model.layers.\\*.mlp' as 'local_packed_rowwise', a transformers style"
    ):
        hf_model.tp_plan(model, 2)
    model.config.base_model_tp_plan = {}
    type(model)._tp_plan, saved = {}, type(model)._tp_plan
    try:
        with pytest.raises(UserError, match="declares no tensor-parallel plan"):
            hf_model.tp_plan(model, 2)
    finally:
        type(model)._tp_plan = saved
    assert hf_model.split_names(_tiny(layers=5), 2) == ["model.layers.3"]  # the first stage one longer


def test_what_a_pipeline_stage_gives_and_its_loss_are_checked_in_one_line():
    from torch.distributed.pipelining._utils import PipeliningMetadataError

    from ddpkit.parallel.pipeline import passing

    stage = torch.nn.Identity()
    stage.ddpkit_model, stage.ddpkit_gives = "Wrapper", ["h", "the output of rotary_emb"]
    passing.check_output((torch.ones(1), torch.ones(1)), stage, 0, 2)  # tensors pass
    with pytest.raises(
        UserError, match="stage 0 of Wrapper gives stage 1 a tuple of 2 tensors as its value 1 "
    ):
        passing.check_output((torch.ones(1), (torch.ones(1), torch.ones(1))), stage, 0, 2)
    with pytest.raises(UserError, match="the last, gives loss_fn a dict"):
        passing.check_output({"logits": torch.ones(1)}, stage, 1, 2)
    per_token = passing.checked_loss(lambda out, y: F.cross_entropy(out, y, reduction="none"))
    with pytest.raises(UserError, match=r"loss_fn gave a tensor of shape \(3,\); .* one number"):
        per_token(torch.randn(3, 5), torch.tensor([0, 1, 2]))
    raw = RuntimeError("failed to run forward")
    raw.__cause__ = PipeliningMetadataError("Stage 1 forward inputs: shape: expected (2, 8), got (2, 9)")
    told = passing.refusal(raw)
    assert isinstance(told, UserError) and "expected (2, 8), got (2, 9)" in str(told)
    assert passing.refusal(ValueError("the model's own bug")) is None  # keeps its traceback
