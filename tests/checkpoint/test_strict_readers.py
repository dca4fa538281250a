"""Every checkpoint reader is strict: a sharded checkpoint (DCP) holding tensors the model does not have is refused
in one line naming them, where DCP itself reads the names the model asks for and drops the rest (a 2-block run
scored with model.n_layer=1 used to evaluate its first block alone). In process, one tiny run: about 5 s."""

from __future__ import annotations

from conftest import GPT_RUN, assert_user_error, cli_in_process, train_here


def test_a_sharded_checkpoint_with_tensors_the_model_lacks_is_refused_naming_them(gpt_text, tmp_path, capsys):
    out = tmp_path / "run"
    train_here(
        *GPT_RUN, f"out_dir={out}", f"data.root={gpt_text}", "train.max_steps=1", "checkpoint.format=sharded"
    )
    last = out / "checkpoints" / "last.dcp"
    fine = cli_in_process(capsys, "eval", f"checkpoint.path={last}")
    assert fine.returncode == 0, fine.stderr
    line = assert_user_error(cli_in_process(capsys, "eval", f"checkpoint.path={last}", "model.n_layer=1"))
    assert "this model does not have the checkpoint's blocks.1." in line
