"""Hugging Face folders read as shards and written as shards (models/hf/storage.py, write.py): under fsdp, tensor
and pipeline parallelism each rank reads only the slices it holds, into a model that was never whole (built on the
meta device, laid out, then given memory); `ddpkit train model.init_from=DIR` under fsdp on 2 processes trains as one
process does from the same folder; `ddpkit export` of a sharded checkpoint writes safetensors shards with their
index, in float32 or bfloat16, that transformers loads. Budget: about 40 s (one pooled 2-rank group, one 2-process
run beside its one-process reference, one export)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import assert_user_error, cli_in_process, plain, run_cli, run_group, train_here

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny transformers Llama saved in two safetensors files with an index."""
    path = tmp_path_factory.mktemp("llama_shards") / "hf"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def _laid_out(hf, layout: str, rank: int, world_size: int):
    """The folder's model built on the meta device and laid out by `layout` over all ranks, then given memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddpkit.parallel.mesh.tensor import apply_tensor_parallel

    with torch.device("meta"):
        model = hf.build()
    mesh = init_device_mesh("cpu", (world_size,))
    if layout == "fsdp":
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        apply_tensor_parallel(model, mesh, family=hf.family)
    else:  # a pipeline stage: this rank's blocks and ends only
        model = hf.family.pp_stage(model, rank, world_size)
    return model.to_empty(device="cpu")


def _read_slices(rank: int, world_size: int, folder: str):
    """On each rank, for each layout and each way in (the layout's own sharded load through DCP, the weight
    source of a model built on meta, ddpkit.prepare of a function that calls load_model): (layout, way, the whole
    values this rank can see, values it read)."""
    import ddpkit
    from ddpkit.checkpoint import sharded
    from ddpkit.models import MODEL_FAMILIES
    from ddpkit.models.hf import open_folder
    from ddpkit.models.hf.storage import FolderReader, FolderSource
    from ddpkit.parallel.pipeline import stage_state

    hf, out = open_folder(folder, MODEL_FAMILIES.entries()), []
    ways = (
        ("fsdp", "dcp"),
        ("fsdp", "source"),
        ("tp", "dcp"),
        ("tp", "source"),
        ("pp", "dcp"),
        ("fsdp", "prepare"),
    )
    for layout, way in ways:
        before = FolderReader.READ.get(hf.path, 0)
        if way == "prepare":  # a user's builder: load_model on meta, made by prepare() shard by shard
            model = ddpkit.prepare(lambda: ddpkit.load_model(folder), strategy="fsdp")
        else:
            model = _laid_out(hf, layout, rank, world_size)
        if way == "source":
            wanted = dict(model.state_dict())
            with torch.no_grad():
                for name, piece in FolderSource(hf.tensors).pieces(wanted):
                    like = wanted[name]
                    (like.to_local() if hasattr(like, "to_local") else like).copy_(piece)
        elif way == "dcp" and layout == "pp":
            stage_state.load_sharded(folder, [model], None, {})
        elif way == "dcp":
            sharded.load(folder, model, None, {})
        read = FolderReader.READ.get(hf.path, 0) - before
        whole = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()
        }
        out.append((layout, way, plain(whole), read))
    return out


@pytest.mark.slow
def test_each_rank_reads_only_its_slices_under_fsdp_tp_and_pp(folder):
    import ddpkit

    want = {k: v.numpy() for k, v in ddpkit.load_model(folder).state_dict().items()}
    total = sum(v.size for v in want.values())
    ranks = run_group(_read_slices, 2, str(folder))
    for i, (layout, way, _, _) in enumerate(ranks[0]):
        got = [r[i] for r in ranks]
        for _, _, whole, read in got:
            for name, value in whole.items():
                assert np.array_equal(value, want[name]), (layout, way, name)
            assert read < 0.75 * total, (layout, way, read, total)  # no rank reads the whole folder
        if layout == "fsdp":  # every tensor split in two: the ranks' reads add up to the folder, once
            assert sum(read for *_, read in got) == total, way
        if layout == "pp":
            assert sorted(len(whole) for _, _, whole, _ in got) == [
                9 + 1,
                9 + 2,
            ]  # a block each, and the ends


TOKENS = [
    "data.dataset=tokens",
    "data.block_size=16",
    "train.max_steps=4",
    "optim.name=adamw",
    "optim.lr=0.01",
]
TOKENS += [
    "optim.ref_batch_size=null",
    "optim.schedule=constant",
    "optim.warmup_epochs=0",
    "report.curves=false",
]
TOKENS += ["train.log_every=1"]


@pytest.mark.slow
def test_init_from_under_fsdp_on_2_processes_trains_as_one_process_from_the_same_folder(folder, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from ddpkit.checkpoint import load_checkpoint

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 64, 600, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    run = [f"model.init_from={folder}", f"data.root={tmp_path}", *TOKENS]
    with ThreadPoolExecutor(max_workers=1) as pool:
        two = pool.submit(
            run_cli, "train", f"out_dir={tmp_path / 'fsdp'}", *run, "train.batch_size=4", "dist.strategy=fsdp",
            "--nproc-per-node", "2", timeout=600,
        )  # fmt: skip
        train_here(f"out_dir={tmp_path / 'one'}", *run, "train.batch_size=8")
        proc = two.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.init_from: every tensor from" in (tmp_path / "fsdp" / "log.txt").read_text()
    one = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.pt")["model"]
    fsdp = load_checkpoint(tmp_path / "fsdp" / "checkpoints" / "last.pt")["model"]
    assert set(one) == set(fsdp)
    for k, v in one.items():
        assert (fsdp[k] - v).abs().max() <= 1e-5 * max(v.abs().max().item(), 1e-2), k


@pytest.mark.slow
def test_export_of_a_sharded_checkpoint_writes_shards_and_an_index_in_fp32_or_bf16(folder, tmp_path, capsys):
    import ddpkit

    rng = np.random.default_rng(1)
    for split in ("train", "val"):
        rng.integers(0, 64, 300, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    out = tmp_path / "run"
    train_here(
        f"out_dir={out}", f"model.init_from={folder}", f"data.root={tmp_path}", *TOKENS, "train.max_steps=1",
        "train.batch_size=4", "checkpoint.format=sharded",
    )  # fmt: skip
    model = ddpkit.load_model(out)
    x = torch.randint(0, 64, (2, 16))
    for dtype, size, tol in (("fp32", "20KB", 1e-5), ("bf16", "10KB", 5e-2)):
        hf = tmp_path / f"hf-{dtype}"
        argv = ["export", str(out), "--to", "hf", str(hf), "--max-shard-size", size, "--dtype", dtype]
        proc = cli_in_process(capsys, *argv)
        assert proc.returncode == 0, proc.stderr
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and all(
            (hf / f).stat().st_size <= 1.1 * {"20KB": 20e3, "10KB": 10e3}[size] for f in files
        )
        back = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        assert next(back.parameters()).dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        with torch.no_grad():
            assert (back.float()(x).logits - model(x)).abs().max() < tol * model(x).abs().max()
        assert (ddpkit.load_model(hf).state_dict()["ln_f.weight"] - model.ln_f.weight).abs().max() < tol
    bad = ["export", str(out), "--to", "hf", str(tmp_path / "x"), "--max-shard-size", "lots"]
    assert_user_error(cli_in_process(capsys, *bad), "--max-shard-size 'lots' is not a size")
    assert not (tmp_path / "x").exists()


def _mapped(folder) -> list[str]:
    """The folder's files this process has mapped now (their pages count in its resident memory)."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if str(folder) in line})


def test_a_file_of_the_folder_is_mapped_only_while_one_tensor_is_read(folder, monkeypatch):
    """Each read maps its file and unmaps it once the piece read is dropped: with the files held open while every tensor was read, each
    of 8 ranks reading its slices of a 201M model held 440 MiB of their pages (benchmarks/RESULTS.md §21)."""
    from ddpkit.checkpoint import dcp_io, sharded
    from ddpkit.models import MODEL_FAMILIES
    from ddpkit.models.hf import open_folder
    from ddpkit.models.hf.storage import FolderSource

    hf = open_folder(folder, MODEL_FAMILIES.entries())
    with torch.device("meta"):
        model = hf.build()
    model = model.to_empty(device="cpu")
    wanted, seen = dict(model.state_dict()), []
    for _name, piece in FolderSource(hf.tensors).pieces(wanted):  # the weight source of a meta build
        seen.append(_mapped(folder))
        del piece
    commit = dcp_io.TensorsOnlyPlanner.commit_tensor

    def committed(self, item, tensor):  # DCP's read of the folder (model.init_from under a sharded layout)
        seen.append(_mapped(folder))
        return commit(self, item, tensor)

    monkeypatch.setattr(dcp_io.TensorsOnlyPlanner, "commit_tensor", committed)
    sharded.load(folder, model, None, {})
    assert len(seen) == 2 * len(wanted)
    assert max(len(files) for files in seen) == 1, seen  # the file of the piece in hand, no other
    assert _mapped(folder) == []
