"""Data sets on real on-disk formats, availability checks, the global-order sampler, exact eval sharding, loaders."""

from __future__ import annotations

import os
import pickle
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from conftest import cli_env, run_group, write_cifar10, write_cifar100
from ddpkit.config import Config
from ddpkit.data import (
    CIFAR_MEAN,
    CIFAR_STD,
    DataSpec,
    DistributedLoader,
    ExactEvalSampler,
    GlobalOrderSampler,
    build_datasets,
    build_loaders,
    check_available,
    distributed_loader,
    eval_loader,
)
from ddpkit.errors import UserError


def make_cfg(dataset: str = "digits", root=None, **data) -> Config:
    cfg = Config()
    cfg.data.dataset = dataset
    if root is not None:
        cfg.data.root = str(root)
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


# ---------------------------------------------------------------- writers of the real on-disk formats


def write_mnist(root, train: int = 10, test: int = 4) -> None:
    d = root / "MNIST" / "raw"
    d.mkdir(parents=True)
    for prefix, n in (("train", train), ("t10k", test)):
        images = np.zeros((n, 28, 28), dtype=np.uint8)
        for i in range(n):
            images[i] = 20 * i
        labels = np.arange(n, dtype=np.uint8) % 10
        (d / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes()
        )
        (d / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.tobytes())


def write_imagefolder(root, classes=("ant", "bee", "cat"), per_class: int = 3, val_classes=None) -> None:
    from PIL import Image

    for split, names in (("train", classes), ("val", val_classes or classes)):
        for c, name in enumerate(names):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (20, 24), (40 * c, 10 * i, 200)).save(d / f"{i}.png")


# ---------------------------------------------------------------- data sets through build_datasets


def test_cifar10_real_pickled_batches(tmp_path):
    write_cifar10(tmp_path, per_batch=4, test=6)
    train, val, spec = build_datasets(make_cfg("cifar10", tmp_path, augment=False))
    assert spec == DataSpec(num_classes=10, in_channels=3, image_size=32, train_size=20, val_size=6)
    x, y = val[3]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == 3
    for c in range(3):
        expected = ((30 + c) / 255 - CIFAR_MEAN[c]) / CIFAR_STD[c]
        assert torch.allclose(x[c], torch.full((32, 32), expected), atol=1e-5)
    assert [train[i][1] for i in range(20)] == [i % 10 for i in range(20)]
    # augmentation: random crop with zero padding changes border pixels for some seeds; same seed, same output
    aug, _, _ = build_datasets(make_cfg("cifar10", tmp_path, augment=True))
    torch.manual_seed(1)
    a = torch.stack([aug[5][0] for _ in range(8)])
    torch.manual_seed(1)
    b = torch.stack([aug[5][0] for _ in range(8)])
    assert torch.equal(a, b) and not all(torch.equal(a[0], a[i]) for i in range(8))
    pickle.loads(pickle.dumps(train))  # workers started with spawn need to pickle the data set


def test_cifar100_fine_labels_and_100_classes(tmp_path):
    write_cifar100(tmp_path, train=12, test=5)
    train, val, spec = build_datasets(make_cfg("cifar100", tmp_path, augment=False))
    assert spec.num_classes == 100 and (spec.train_size, spec.val_size) == (12, 5)
    assert [train[i][1] for i in range(12)] == [(7 * i) % 100 for i in range(12)]
    assert val[0][0].shape == (3, 32, 32)
    cfg = make_cfg("cifar100", tmp_path)
    cfg.model.num_classes = 10
    with pytest.raises(UserError, match=r"model\.num_classes=10 .* 100 classes"):
        build_datasets(cfg)


def test_mnist_idx_files(tmp_path):
    write_mnist(tmp_path, train=10, test=4)
    train, val, spec = build_datasets(make_cfg("mnist", tmp_path, augment=False))
    assert spec == DataSpec(num_classes=10, in_channels=1, image_size=28, train_size=10, val_size=4)
    x, y = val[2]
    assert x.shape == (1, 28, 28) and y == 2
    assert torch.allclose(x, torch.full((1, 28, 28), (40 / 255 - 0.1307) / 0.3081), atol=1e-5)
    _, _, spec16 = build_datasets(make_cfg("mnist", tmp_path, image_size=16))
    assert spec16.image_size == 16


def test_imagefolder_png_tree(tmp_path):
    write_imagefolder(
        tmp_path, per_class=3, val_classes=("ant", "cat")
    )  # val lacks a class: labels must not shift
    train, val, spec = build_datasets(make_cfg("imagefolder", tmp_path, image_size=16))
    assert spec == DataSpec(num_classes=3, in_channels=3, image_size=16, train_size=9, val_size=6)
    assert sorted({train[i][1] for i in range(9)}) == [0, 1, 2]
    assert [val[i][1] for i in range(6)] == [0, 0, 0, 2, 2, 2]
    x, _ = val[0]
    assert x.shape == (3, 16, 16)
    blue = (200 / 255 - 0.406) / 0.225  # every image's blue channel is 200
    assert torch.allclose(x[2], torch.full((16, 16), blue), atol=1e-3)
    pickle.loads(pickle.dumps(val))
    cfg = make_cfg("imagefolder", tmp_path, image_size=16)
    cfg.model.num_classes = 2
    with pytest.raises(UserError, match=r"model\.num_classes"):
        build_datasets(cfg)


# ---------------------------------------------------------------- check_available


def _err(cfg) -> str:
    with pytest.raises(UserError) as e:
        check_available(cfg)
    return str(e.value)


def test_check_available_errors(tmp_path):
    msg = _err(make_cfg("cifar10", tmp_path / "nope"))
    assert "data.root" in msg and "does not exist" in msg and "data.download=true" in msg
    (tmp_path / "afile").write_text("x")
    assert "is a file" in _err(make_cfg("mnist", tmp_path / "afile"))
    write_cifar10(tmp_path / "c")
    os.remove(tmp_path / "c" / "cifar-10-batches-py" / "data_batch_3")
    msg = _err(make_cfg("cifar10", tmp_path / "c"))
    assert "data_batch_3" in msg and "data.root" in msg and "data.download=true" in msg
    check_available(make_cfg("cifar10", tmp_path / "c", download=True))  # download would fetch them
    msg = _err(make_cfg("cifar100", tmp_path / "c"))
    assert "cifar-100-python/train" in msg
    (tmp_path / "m" / "MNIST" / "raw").mkdir(parents=True)
    assert "t10k-labels-idx1-ubyte" in _err(make_cfg("mnist", tmp_path / "m"))
    for name in ("digits", "synthetic"):
        check_available(make_cfg(name, tmp_path / "nope"))


def test_check_available_imagefolder(tmp_path):
    assert "does not exist" in _err(make_cfg("imagefolder", tmp_path / "nope"))
    write_imagefolder(tmp_path / "a")
    check_available(make_cfg("imagefolder", tmp_path / "a"))
    import shutil

    shutil.rmtree(tmp_path / "a" / "val")
    msg = _err(make_cfg("imagefolder", tmp_path / "a"))
    assert "data.root" in msg and "val/" in msg
    (tmp_path / "b" / "train").mkdir(parents=True)
    (tmp_path / "b" / "val").mkdir()
    assert "no class folders" in _err(make_cfg("imagefolder", tmp_path / "b"))
    for split in ("train", "val"):
        (tmp_path / "b" / split / "dog").mkdir()
        (tmp_path / "b" / split / "dog" / "notes.txt").write_text("not an image")
    msg = _err(make_cfg("imagefolder", tmp_path / "b"))
    assert "without images" in msg and "dog" in msg
    write_imagefolder(tmp_path / "c", classes=("ant",), val_classes=("ant", "zebra"))
    assert "zebra" in _err(make_cfg("imagefolder", tmp_path / "c"))


def test_build_datasets_checks_first(tmp_path):
    with pytest.raises(UserError, match="data.root"):
        build_datasets(make_cfg("cifar10", tmp_path / "missing"))


def test_damaged_files_are_one_line_user_errors(tmp_path):
    write_cifar10(tmp_path / "c")
    (tmp_path / "c" / "cifar-10-batches-py" / "data_batch_2").write_bytes(b"not a pickle\n\x00")
    write_mnist(tmp_path / "m")
    (tmp_path / "m" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").write_bytes(
        struct.pack(">I", 2051) + b"\x01"
    )
    for name, root in (("cifar10", tmp_path / "c"), ("mnist", tmp_path / "m")):
        with pytest.raises(UserError) as e:
            build_datasets(make_cfg(name, root))
        assert "cannot read" in str(e.value) and "data.root" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- digits and synthetic


def test_digits_fixed_split_and_sizes():
    a_train, a_val, spec = build_datasets(make_cfg("digits", augment=False))
    assert spec == DataSpec(num_classes=10, in_channels=1, image_size=8, train_size=1438, val_size=359)
    cfg = make_cfg("digits", augment=False)
    cfg.seed = 1234
    b_train, b_val, _ = build_datasets(cfg)
    assert torch.equal(a_val.images, b_val.images) and torch.equal(a_train.labels, b_train.labels)
    xs = torch.stack([a_train[i][0] for i in range(len(a_train))])
    assert xs.shape == (1438, 1, 8, 8)
    assert abs(xs.mean().item()) < 1e-4 and abs(xs.std().item() - 1) < 1e-3  # normalised with train stats
    x16, _ = build_datasets(make_cfg("digits", image_size=16))[1][0]
    assert x16.shape == (1, 16, 16)


def test_digits_augmentation_streams():
    train, val, _ = build_datasets(make_cfg("digits", augment=True))

    def stream(seed):
        torch.manual_seed(seed)
        return torch.stack([train[i][0] for i in range(64)])

    assert torch.equal(stream(10), stream(10))
    assert not torch.equal(stream(10), stream(11))  # seed + rank: every rank its own augmentation
    torch.manual_seed(0)
    first = val[0][0]
    torch.manual_seed(1)
    assert torch.equal(first, val[0][0])  # no augmentation on the val set


def test_synthetic_deterministic_and_learnable_shape():
    cfg = make_cfg("synthetic", synthetic_size=300, synthetic_val_size=50, augment=False)
    cfg.seed = 7
    t1, v1, spec = build_datasets(cfg)
    t2, _, _ = build_datasets(cfg)
    assert spec == DataSpec(num_classes=10, in_channels=3, image_size=32, train_size=300, val_size=50)
    for i in (0, 17, 299):
        assert torch.equal(t1[i][0], t2[i][0]) and t1[i][1] == t2[i][1]
    cfg.seed = 8
    t3, _, _ = build_datasets(cfg)
    assert not torch.equal(t1[0][0], t3[0][0])
    # class-dependent: a nearest-class-mean classifier built on train beats chance by far on val
    xs = torch.stack([t1[i][0] for i in range(300)]).flatten(1)
    ys = torch.tensor([t1[i][1] for i in range(300)])
    means = torch.stack([xs[ys == k].mean(0) for k in range(10)])
    vx = torch.stack([v1[i][0] for i in range(50)]).flatten(1)
    vy = torch.tensor([v1[i][1] for i in range(50)])
    assert (torch.cdist(vx, means).argmin(1) == vy).float().mean() > 0.8
    cfg.model.num_classes = 4
    cfg.data.image_size = 12
    _, _, spec4 = build_datasets(cfg)
    assert (spec4.num_classes, spec4.image_size) == (4, 12)


def test_import_stays_light():
    code = "import ddpkit.data, sys; assert 'torchvision' not in sys.modules and 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=cli_env(), timeout=120)


# ---------------------------------------------------------------- GlobalOrderSampler


def _ranks(n, batch, world, seed=0, epoch=0, accum=1, start=0, shuffle=True):
    out = []
    for r in range(world):
        s = GlobalOrderSampler(n, batch, r, world, seed, shuffle=shuffle, grad_accum_steps=accum)
        s.set_epoch(epoch)
        s.set_start(start)
        idx = list(s)
        assert len(idx) == len(s)
        out.append([idx[i : i + batch] for i in range(0, len(idx), batch)])
    return out


def _global_steps(per_rank):
    """Per global micro-step, the samples all ranks train on together (sorted: DDP averages over the union)."""
    return [sorted(sum((per_rank[r][i] for r in range(len(per_rank))), [])) for i in range(len(per_rank[0]))]


def test_same_global_order_on_any_world_size():
    one = _global_steps(_ranks(200, 16, 1))
    assert _global_steps(_ranks(200, 8, 2)) == one
    assert _global_steps(_ranks(200, 4, 4)) == one
    # 2 processes x B/2 with 2 accumulation micro-steps cover the 1-process optimizer step
    accum = _global_steps(_ranks(200, 4, 2, accum=2))
    assert [sorted(accum[i] + accum[i + 1]) for i in range(0, len(accum), 2)] == one
    s = GlobalOrderSampler(200, 16, 0, 1, 0)
    order = s.global_order().tolist()
    assert one == [sorted(order[i : i + 16]) for i in range(0, len(one) * 16, 16)]
    assert _ranks(40, 4, 2, shuffle=False)[1][0] == [1, 3, 5, 7]  # DistributedSampler's interleaving


@pytest.mark.parametrize(
    ("n", "batch", "world", "drop_last"),
    [(200, 16, 2, True), (203, 8, 3, True), (203, 8, 3, False), (10, 4, 4, False)],
)
def test_same_batches_as_torch_distributed_sampler(n, batch, world, drop_last):
    """A script ported from DistributedSampler + DataLoader sees exactly the batches it saw before."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    ds = _Indexed(n)
    for epoch in (0, 3):
        for rank in range(world):
            theirs = DistributedSampler(
                ds, num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=drop_last
            )
            theirs.set_epoch(epoch)
            want = [
                b[0][:, 0].long().tolist() for b in DataLoader(ds, batch, sampler=theirs, drop_last=drop_last)
            ]
            ours = distributed_loader(ds, batch, seed=5, drop_last=drop_last, rank=rank, world_size=world)
            ours.set_epoch(epoch)
            assert [b[0][:, 0].long().tolist() for b in ours] == want, (epoch, rank)


def test_equal_steps_on_every_rank_and_accum_rounding():
    per_rank = _ranks(1001, 10, 3)
    assert [len(p) for p in per_rank] == [33, 33, 33]  # 1001 // 30 global micro-batches, 11 samples dropped
    seen = sum(_global_steps(per_rank), [])
    assert len(seen) == len(set(seen)) == 990
    per_rank = _ranks(1001, 10, 3, accum=4)
    assert [len(p) for p in per_rank] == [32, 32, 32]  # rounded down to a multiple of grad_accum_steps
    assert GlobalOrderSampler(1001, 10, 0, 3, 0, grad_accum_steps=4).micro_batches_per_epoch == 32


def test_epochs_differ_and_repeat():
    e0, e1 = _ranks(100, 10, 1, epoch=0), _ranks(100, 10, 1, epoch=1)
    assert e0 != e1 and sorted(sum(e0[0], [])) == sorted(sum(e1[0], [])) == list(range(100))
    assert _ranks(100, 10, 1, epoch=1, seed=3) == _ranks(100, 10, 1, epoch=1, seed=3)
    assert _ranks(100, 10, 1, seed=3) != _ranks(100, 10, 1, seed=4)


def test_set_start_resumes_on_other_world_sizes():
    n, epoch = 1000, 2
    full = GlobalOrderSampler(n, 8, 0, 1, 5)
    full.set_epoch(epoch)
    order = full.global_order().tolist()
    k = 7  # micro-batches done at world size 2, batch 8 -> consumed 7 * 16 samples
    before = sum(_global_steps(_ranks(n, 8, 2, seed=5, epoch=epoch))[:k], [])
    consumed = k * 16
    assert sorted(before) == sorted(order[:consumed])
    for world, batch in ((1, 16), (4, 4), (3, 8)):
        after = sum(_global_steps(_ranks(n, batch, world, seed=5, epoch=epoch, start=consumed)), [])
        assert sorted(after) == sorted(
            order[consumed : consumed + len(after)]
        )  # the same remaining global order
        assert not set(after) & set(before)  # nothing seen twice
        assert len(after) == (n - consumed) // (batch * world) * batch * world
    s = GlobalOrderSampler(n, 8, 0, 2, 5)
    s.set_start(consumed)
    assert len(s) == (n - consumed) // 16 * 8
    s.set_epoch(3)  # a new epoch starts from its beginning
    assert len(s) == s.micro_batches_per_epoch * 8
    with pytest.raises(UserError):
        s.set_start(n + 1)


def test_too_small_dataset_is_a_user_error():
    with pytest.raises(UserError, match=r"10 samples.*train\.batch_size 32 x world size 2 = 64"):
        GlobalOrderSampler(10, 32, 0, 2, 0)
    with pytest.raises(UserError, match=r"grad_accum_steps"):
        GlobalOrderSampler(100, 16, 0, 2, 0, grad_accum_steps=4)
    GlobalOrderSampler(64, 32, 1, 2, 0)  # exactly one step is fine


# ---------------------------------------------------------------- ExactEvalSampler and eval_loader


@pytest.mark.parametrize("n", [359, 7, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_eval_every_index_once(n, world):
    shards = [list(ExactEvalSampler(n, r, world)) for r in range(world)]
    assert sum(shards, []) == list(range(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sizes == [
        len(ExactEvalSampler(n, r, world)) for r in range(world)
    ]


class _Indexed(Dataset):
    """Item i is (tensor([i]), i % 3)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i % 3


class _Noisy(Dataset):
    """Item i is drawn from torch, numpy and python random: shows how workers are seeded."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.tensor([torch.rand(()).item(), float(np.random.rand()), random.random()])


def test_eval_loader_covers_all_once():
    ds = _Indexed(359)
    seen = []
    for r in range(3):
        for x, _ in eval_loader(ds, 50, rank=r, world_size=3):
            seen += x[:, 0].long().tolist()
    assert seen == list(range(359))
    assert len(eval_loader(ds, 50)) == 8  # rank/world default to the (single) process


# ---------------------------------------------------------------- DistributedLoader


def _pass(loader) -> list[int]:
    return [int(v) for x, _ in loader for v in x[:, 0]]


def test_loader_sets_epoch_itself():
    ds = _Indexed(100)
    loader = distributed_loader(ds, 10, seed=1)
    assert isinstance(loader, DistributedLoader) and len(loader) == 10 == loader.micro_batches_per_epoch
    p0, p1 = _pass(loader), _pass(loader)
    assert p0 != p1 and sorted(p0) == sorted(p1) == list(range(100))
    assert loader.epoch == 2
    loader.set_epoch(1)
    assert _pass(loader) == p1
    loader.set_epoch(0)
    assert _pass(loader) == p0
    # mid-epoch resume through the loader: len() and the pass reflect the skip; the next epoch is whole
    loader.set_epoch(1)
    loader.set_start(40)
    assert len(loader) == 6 and _pass(loader) == p1[40:]
    assert loader.epoch == 2 and len(loader) == 10
    # a pass broken early still moves on: the next pass is a new epoch, not a replay of the same order
    for _ in loader:
        break
    assert loader.epoch == 3
    p3 = _pass(loader)
    assert p3 != _pass(loader) and loader.epoch == 5
    # unless the user chose the epoch during the pass (the trainer's way)
    for _ in loader:
        loader.set_epoch(1)
        break
    assert loader.epoch == 1 and _pass(loader) == p1


def test_loader_worker_seeds_per_rank_and_epoch():
    def first_batch(rank, epoch):
        loader = distributed_loader(_Noisy(), 4, seed=3, num_workers=1, rank=rank, world_size=2)
        loader.set_epoch(epoch)
        return next(iter(loader))

    a = first_batch(0, 0)
    assert torch.equal(a, first_batch(0, 0))
    assert not torch.equal(a, first_batch(1, 0))
    assert not torch.equal(a, first_batch(0, 1))
    assert len({float(v) for v in a[:, 1]}) == 4 and len({float(v) for v in a[:, 2]}) == 4


def test_build_loaders_from_config():
    cfg = make_cfg("digits")
    cfg.train.batch_size, cfg.train.grad_accum_steps, cfg.eval.batch_size = 16, 2, 100
    train_ds, val_ds, _ = build_datasets(cfg)
    train, val = build_loaders(cfg, 1, 2, train_ds, val_ds)
    assert train.sampler.world_size == 2 and train.sampler.rank == 1
    assert len(train) == 1438 // 32 // 2 * 2 == 44
    x, y = next(iter(train))
    assert x.shape == (16, 1, 8, 8) and y.shape == (16,)
    assert sum(len(b[1]) for b in val) == 359 - 180 and val.batch_size == 100


# ---------------------------------------------------------------- a real process group


def _download_group(rank: int, world_size: int, root: str):
    cfg = make_cfg("cifar10", root, download=True, augment=False)
    train, val, spec = build_datasets(cfg)  # files present: rank 0 "downloads" (a no-op) first, then the rest
    return spec.train_size, spec.val_size


@pytest.mark.slow
def test_download_path_in_a_process_group(tmp_path):
    write_cifar10(tmp_path, per_batch=2, test=3)
    assert run_group(_download_group, 2, str(tmp_path)) == [(10, 3), (10, 3)]


def test_set_epoch_on_the_loaders_sampler_is_honoured():
    """What every tutorial writes: `loader.sampler.set_epoch(epoch)` chooses the order (it was ignored)."""
    ds = _Indexed(100)
    reference = distributed_loader(ds, 10, seed=1)
    reference.set_epoch(5)
    want = _pass(reference)
    loader = distributed_loader(ds, 10, seed=1)
    loader.sampler.set_epoch(5)
    assert _pass(loader) == want
    for epoch in range(3):  # the tutorial loop: set_epoch on the sampler before each pass
        loader.sampler.set_epoch(epoch)
        reference.set_epoch(epoch)
        assert _pass(loader) == _pass(reference)


def test_a_resumed_position_survives_the_tutorials_set_epoch_call():
    ds = _Indexed(100)
    loader = distributed_loader(ds, 10, seed=2)
    loader.set_epoch(3)
    full = _pass(loader)
    it = iter(loader)
    loader.set_epoch(3)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    del it
    assert state == {"epoch": 3, "consumed": 40}
    resumed = distributed_loader(ds, 10, seed=2)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(3)  # the script's own set_epoch(epoch) at the top of the resumed epoch
    assert _pass(resumed) == full[40:]
    resumed.set_epoch(3)  # asked again after the pass: the whole epoch
    assert _pass(resumed) == full


# ---------------------------------------------------------------- hostile data files


class _Payload:
    """Unpickling this runs `touch MARKER`: what a hostile data file does with __reduce__."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("victim", ["batches.meta", "data_batch_2", "test_batch"])
def test_a_cifar_file_that_runs_code_is_refused_and_never_runs(tmp_path, victim):
    write_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    path = tmp_path / "cifar-10-batches-py" / victim
    path.write_bytes(pickle.dumps({"data": _Payload(marker), "labels": [], "label_names": _Payload(marker)}))
    with pytest.raises(UserError) as e:
        build_datasets(make_cfg("cifar10", tmp_path))
    assert not marker.exists()  # the payload's side effect did not happen
    line = e.value.line()
    assert victim in line and "posix.system" in line and "\n" not in line, line
    import torchvision.datasets.cifar as tv_cifar

    from ddpkit.data import safe_pickle

    assert tv_cifar.pickle is safe_pickle.SAFE_PICKLE  # every pickle.load call site of torchvision's CIFAR


def test_the_cli_refuses_a_hostile_cifar_file_in_one_line(tmp_path):
    write_cifar10(tmp_path / "data")
    marker = tmp_path / "pwned"
    (tmp_path / "data" / "cifar-10-batches-py" / "batches.meta").write_bytes(pickle.dumps(_Payload(marker)))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "train",
            "data.dataset=cifar10",
            f"data.root={tmp_path / 'data'}",
            f"out_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "batches.meta asks to run posix.system" in proc.stderr
    assert not marker.exists()


def test_real_cifar_pickles_still_load(tmp_path):
    """What the real files hold (numpy arrays in protocol 2 and 5 pickles, Python 2's latin-1 strings) passes."""
    from ddpkit.data import safe_pickle

    for protocol in (2, 4, 5):
        entry = {
            b"data": np.arange(12, dtype=np.uint8).reshape(2, 6),
            b"labels": [1, 2],
            b"batch_label": b"x",
        }
        back = safe_pickle.loads(pickle.dumps(entry, protocol=protocol), encoding="latin1")
        assert np.array_equal(back[b"data"], entry[b"data"]) and back[b"labels"] == [1, 2]


def test_digits_come_from_scikit_learns_file_without_importing_it():
    from sklearn.datasets import load_digits

    from ddpkit.data.builtin import digits_arrays

    images, labels = digits_arrays()
    reference = load_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(labels, reference.target)
    code = (
        "import sys; from ddpkit.data import build_datasets; from ddpkit.config import load_config;"
        "t, v, s = build_datasets(load_config()); assert (len(t), len(v)) == (1438, 359);"
        "assert 'sklearn' not in sys.modules, 'scikit-learn was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=cli_env(), timeout=120)


def test_an_evaluation_pass_leaves_the_global_random_stream_alone():
    loader = eval_loader(_Indexed(20), 4)
    torch.manual_seed(3)
    want = torch.rand(3)
    torch.manual_seed(3)
    for _ in loader:
        pass
    assert torch.equal(torch.rand(3), want)


# ---------------------------------------------------------------- undecodable samples (data.skip_corrupt)


def damaged_imagefolder(root: Path, train_bad: int = 7) -> tuple[Path, Path]:
    """An image tree (2 classes x 8 images per split) with one garbage training file and one cut-short
    validation PNG; returns their paths."""
    write_imagefolder(root, classes=("ant", "bee"), per_class=8)
    bad_train = root / "train" / "bee" / f"{train_bad}.png"
    bad_train.write_bytes(b"not an image at all")
    bad_val = root / "val" / "ant" / "3.png"
    whole = bad_val.read_bytes()
    bad_val.write_bytes(whole[: len(whole) // 2])
    return bad_train, bad_val


IMAGES = ["data.dataset=imagefolder", "data.image_size=8", "model.arch=mlp", "train.batch_size=4"]


def train_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", "train", "report.curves=false", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(),
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_an_undecodable_image_met_while_training_is_one_line_naming_the_file(tmp_path, workers):
    bad_train, _ = damaged_imagefolder(tmp_path / "data")
    proc = train_cli(
        f"out_dir={tmp_path / 'run'}",
        f"data.root={tmp_path / 'data'}",
        *IMAGES,
        f"data.num_workers={workers}",
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ddpkit: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"cannot decode file '{bad_train}' of the training set" in errors[0]
    assert "data.skip_corrupt=true" in errors[0] and "BufferedReader" not in errors[0]


def test_skip_corrupt_leaves_undecodable_samples_out_counts_and_names_them(tmp_path):
    bad_train, bad_val = damaged_imagefolder(tmp_path / "data")
    out = tmp_path / "run"
    proc = train_cli(
        f"out_dir={out}",
        f"data.root={tmp_path / 'data'}",
        *IMAGES,
        "data.num_workers=2",
        "data.skip_corrupt=true",
        "train.epochs=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from ddpkit.metrics import read_metrics

    rows = read_metrics(out)
    assert [r["skipped_samples"] for r in rows] == [2, 2]  # one training and one validation file each epoch
    assert [r["val_samples"] for r in rows] == [15, 15]  # scored: the 16 validation images but the bad one
    log = (out / "log.txt").read_text()
    assert (
        log.count("left out 2 undecodable sample(s)") == 2 and str(bad_train) in log and str(bad_val) in log
    )


def test_an_undecodable_first_sample_is_refused_before_anything_is_written(tmp_path):
    damaged_imagefolder(tmp_path / "data", train_bad=0)  # ImageFolder's first sample: the first class's 0.png
    (tmp_path / "data" / "train" / "ant" / "0.png").write_bytes(b"")
    out = tmp_path / "run"
    out.mkdir()
    proc = train_cli(f"out_dir={out}", f"data.root={tmp_path / 'data'}", *IMAGES)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "cannot decode file" in proc.stderr and "ant/0.png" in proc.stderr
    assert list(out.iterdir()) == []  # no config.yaml, no log.txt, no lock file


def test_checked_samples_keep_the_data_sets_face_and_travel_to_workers(tmp_path):
    from ddpkit.data.checked import CheckedSamples, SkipCollate

    bad_train, _ = damaged_imagefolder(tmp_path, train_bad=0)
    train, _, _ = build_datasets(make_cfg("imagefolder", tmp_path, image_size=8, skip_corrupt=True))
    assert isinstance(train, CheckedSamples) and train.classes == ["ant", "bee"]  # the inner set's attributes
    bad = next(i for i, (p, _) in enumerate(train.samples) if p == str(bad_train))
    loader = (
        torch.utils.data.DataLoader(  # a spawned worker: the data set travels pickled, the marks come back
            torch.utils.data.Subset(train, [bad, bad + 1]),
            batch_size=2,
            num_workers=1,
            multiprocessing_context="spawn",
            collate_fn=SkipCollate(train, fill=True),
        )
    )
    (x, y), *_ = list(loader)
    assert x.shape == (1, 3, 8, 8)  # the undecodable sample left out of its batch
    assert train.take_skipped() == [f"file '{bad_train}'"] and train.take_skipped() == []
    x, y = SkipCollate(train, fill=True)([None, None])  # nothing decodable left: one good sample instead
    assert x.shape == (1, 3, 8, 8) and y.shape == (1,)
    x, y = SkipCollate(train, fill=False)([None])  # evaluation: an empty batch, nothing scored twice
    assert x.shape == (0, 3, 8, 8) and y.shape == (0,)
    digits, _, _ = build_datasets(make_cfg("digits", skip_corrupt=True))
    assert not isinstance(digits, CheckedSamples)  # samples in memory: nothing to decode
