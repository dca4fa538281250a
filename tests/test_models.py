"""Models by name, pretrained weights, and device preparation (ddpkit.models)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
import urllib.error

import pytest
import torch
from torch import nn

from ddpkit import models
from ddpkit.config import Config
from ddpkit.errors import UserError
from ddpkit.models import (
    MODEL_FAMILIES,
    ModelFamily,
    build_model,
    check_arch,
    load_matching,
    read_weights,
)
from ddpkit.parallel.sync_bn import GlooSyncBatchNorm, convert_gloo_sync_batchnorm
from ddpkit.train.builders import prepare_model


def make_cfg(arch: str = "cnn", **model) -> Config:
    cfg = Config()
    cfg.model.arch = arch
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def build(
    arch: str = "cnn", num_classes: int = 10, c: int = 1, size: int = 8, report=None, **model
) -> nn.Module:
    return build_model(make_cfg(arch, **model), num_classes, c, size, report=report)


# ------------------------------------------------------------------------------------------ architectures


@pytest.mark.parametrize("arch", ["cnn", "mlp", "resnet18"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)], ids=["digits", "cifar"])
def test_arch_builds_and_runs(arch, shape):
    c, h, w = shape
    torch.manual_seed(0)
    model = build(arch, 10, c, h)
    out = model(torch.randn(2, c, h, w))
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_resnet50_builds():
    model = build("resnet50", 100, 3, 32)
    assert model.fc.out_features == 100
    assert 20e6 < sum(p.numel() for p in model.parameters()) < 30e6


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 64, 64), (3, 224, 224)])
def test_cnn_other_image_sizes_same_keys(shape):
    c, h, _ = shape
    model = build("cnn", 7, c, h).eval()
    with torch.no_grad():
        assert model(torch.randn(1, c, h, h)).shape == (1, 7)
    assert set(model.state_dict()) == set(build("cnn", 7, c, 8).state_dict())


def test_cnn_has_batchnorm():
    assert any(isinstance(m, nn.BatchNorm2d) for m in build("cnn").modules())


def test_mlp_has_no_norm_or_dropout():
    model = build("mlp", 10, 3, 32)
    banned = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.modules.dropout._DropoutNd)
    assert not [m for m in model.modules() if isinstance(m, banned)]
    kinds = [type(m) for m in model]
    assert kinds == [nn.Flatten, nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]


def test_one_channel_hook_keeps_torchvision_keys():
    import torchvision

    model = build("resnet18", 10, 1, 28).eval()
    reference = torchvision.models.resnet18(num_classes=10)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert model.conv1.weight.shape == (64, 3, 7, 7)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        # The hook is the only difference: the same weights on an explicitly repeated input give the same logits.
        reference.load_state_dict(model.state_dict())
        reference.eval()
        assert torch.equal(model(x), reference(x.repeat(1, 3, 1, 1)))
        assert model(torch.randn(2, 3, 28, 28)).shape == (2, 10)  # 3-channel input passes untouched


def test_torchvision_other_channel_counts_are_user_errors():
    with pytest.raises(UserError, match="3-channel"):
        build("resnet18", 10, 4, 32)


def test_import_stays_light():
    code = "import sys, ddpkit.models, ddpkit.train.optim; assert 'torchvision' not in sys.modules; assert 'timm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------------------ arch names


@pytest.mark.parametrize("fn", ["check_arch", "build_model"])
def test_unknown_arch_suggests_closest(fn):
    cfg = make_cfg("resnet81")
    with pytest.raises(UserError) as e:
        check_arch(cfg) if fn == "check_arch" else build_model(cfg, 10, 3, 32)
    assert "model.arch" in e.value.line() and "resnet81" in e.value.line()
    assert "did you mean 'resnet18'" in e.value.line()


def test_unknown_arch_suggests_builtin():
    with pytest.raises(UserError, match="did you mean 'cnn'"):
        check_arch(make_cfg("cnnn"))


@pytest.mark.parametrize("arch", ["cnn", "mlp", "resnet18", "vit_b_16"])
def test_check_arch_accepts_valid(arch):
    check_arch(make_cfg(arch))


def _check_toy(arch: str) -> None:
    if not arch[len("toy:") :].isdigit():
        raise UserError(f"bad toy model '{arch}'", "write toy:N")


def test_a_model_family_is_one_registry_entry(request):
    toy = ModelFamily(
        "toy",
        owns=lambda arch: arch.startswith("toy:"),
        build=lambda arch, n, c, size: nn.Sequential(nn.Flatten(), nn.Linear(c * size * size, n)),
        check=_check_toy,
        names=lambda: ["toy:1"],
    )
    models.register_model(toy)
    request.addfinalizer(lambda: MODEL_FAMILIES.unregister("toy"))
    assert list(MODEL_FAMILIES)[0] == "toy"  # asked before the built-in families
    check_arch(make_cfg("toy:1"))
    assert build("toy:1", 4, 1, 8)(torch.randn(2, 1, 8, 8)).shape == (2, 4)
    with pytest.raises(UserError, match="bad toy"):
        build("toy:x")
    with pytest.raises(UserError, match="did you mean 'toy:1'"):
        check_arch(make_cfg("tyo:1"))  # its names are suggested like everyone's
    with pytest.raises(UserError, match="needs a torchvision model"):
        check_arch(make_cfg("toy:1", pretrained="torchvision"))
    MODEL_FAMILIES.unregister("toy")
    assert list(MODEL_FAMILIES) == [
        "builtin",
        "gpt",
        "llama",
        "mixtral",
        "qwen3_moe",
        "qwen2",
        "qwen3",
        "mistral",
        "timm",
        "torchvision",
    ]


def test_timm_missing_is_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` now raises ImportError
    for call in (lambda: check_arch(make_cfg("timm:resnet18")), lambda: build("timm:resnet18", 10, 3, 32)):
        with pytest.raises(UserError) as e:
            call()
        assert "pip install timm" in e.value.line()


def _fake_timm(calls: list) -> types.ModuleType:
    timm = types.ModuleType("timm")
    names = ["resnet18", "vit_tiny_patch16_224"]
    timm.is_model = lambda name: name in names
    timm.list_models = lambda *a, **k: list(names)

    def create_model(name, pretrained=False, num_classes=1000, in_chans=3):
        calls.append((name, pretrained, num_classes, in_chans))
        return nn.Sequential(
            nn.Conv2d(in_chans, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes)
        )

    timm.create_model = create_model
    return timm


def test_timm_model_built_with_classes_and_channels(monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "timm", _fake_timm(calls))
    check_arch(make_cfg("timm:resnet18"))
    model = build("timm:resnet18", 7, 1, 16)
    assert calls == [("resnet18", False, 7, 1)]
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 7)


def test_timm_unknown_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", _fake_timm([]))
    with pytest.raises(UserError, match="did you mean 'timm:resnet18'"):
        check_arch(make_cfg("timm:resnet19"))
    with pytest.raises(UserError, match="unknown timm model"):
        build("timm:resnet19", 10, 3, 32)


# ------------------------------------------------------------------------------------------ pretrained


def _assert_same(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _trained_like(arch="cnn", num_classes=10) -> nn.Module:
    torch.manual_seed(1)
    model = build(arch, num_classes)
    with torch.no_grad():  # make the buffers differ from a fresh model's too
        for buf in model.buffers():
            if buf.is_floating_point():
                buf.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("layout", ["state_dict", "checkpoint", "ddp_prefix", "compiled_prefix"])
def test_pretrained_round_trip(tmp_path, layout):
    src = _trained_like()
    sd = src.state_dict()
    if layout == "checkpoint":
        obj = {
            "model": sd,
            "optimizer": {"state": {}, "param_groups": []},
            "epoch": 3,
            "step": 30,
            "config": {"seed": 0},
        }
    elif layout == "ddp_prefix":
        obj = {"module." + k: v for k, v in sd.items()}
    elif layout == "compiled_prefix":
        obj = {"_orig_mod.module." + k: v for k, v in sd.items()}
    else:
        obj = sd
    path = tmp_path / "w.pt"
    torch.save(obj, path)
    torch.manual_seed(2)
    messages: list[str] = []
    fresh = build("cnn", pretrained=str(path), report=messages.append)
    _assert_same(src, fresh)
    assert len(messages) == 1 and "loaded" in messages[0]


def test_pretrained_skips_classifier_when_num_classes_differs(tmp_path):
    src = _trained_like(num_classes=10)
    path = tmp_path / "w.pt"
    torch.save(src.state_dict(), path)
    messages: list[str] = []
    model = build("cnn", 5, pretrained=str(path), report=messages.append)
    sa, sb = src.state_dict(), model.state_dict()
    for k in sa:
        if k.startswith("fc."):
            assert sb[k].shape[0] == 5
        else:
            assert torch.equal(sa[k], sb[k]), k
    msg = messages[0]
    assert "classifier" in msg and "fc.weight" in msg and "num_classes" in msg


def test_load_matching_returns_message():
    src = _trained_like()
    dst = build("cnn")
    msg = load_matching(dst, src.state_dict(), "src")
    assert msg.startswith(f"loaded {len(src.state_dict())}/{len(src.state_dict())} tensors from src")
    _assert_same(src, dst)


def test_pretrained_torchvision_partial_head(tmp_path):
    import torchvision

    src = torchvision.models.resnet18(num_classes=1000)
    path = tmp_path / "r18.pth"
    torch.save(src.state_dict(), path)
    messages: list[str] = []
    model = build("resnet18", 10, 1, 32, pretrained=str(path), report=messages.append)  # gray input
    assert torch.equal(model.conv1.weight, src.conv1.weight)
    assert model.fc.weight.shape == (10, 512)
    assert "fc.weight" in messages[0]


def test_pretrained_missing_file(tmp_path):
    missing = str(tmp_path / "nope.pt")
    for call in (lambda: check_arch(make_cfg(pretrained=missing)), lambda: build(pretrained=missing)):
        with pytest.raises(UserError, match="does not exist"):
            call()
    with pytest.raises(UserError, match="not a file"):
        build(pretrained=str(tmp_path))


def test_pretrained_corrupt_file(tmp_path):
    path = tmp_path / "bad.pt"
    path.write_bytes(os.urandom(256))
    with pytest.raises(UserError, match="cannot read model.pretrained"):
        build(pretrained=str(path))
    trunc = tmp_path / "trunc.pt"
    torch.save(build().state_dict(), trunc)
    trunc.write_bytes(trunc.read_bytes()[:200])
    with pytest.raises(UserError, match="cannot read model.pretrained"):
        read_weights(str(trunc))


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_pretrained_pickle_with_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": build().state_dict(), "extra": _Evil(str(marker))}, path)
    with pytest.raises(UserError) as e:
        build(pretrained=str(path))
    assert not marker.exists()  # the payload never ran
    assert "weights_only" in e.value.line()


def test_pretrained_no_weights_or_no_match(tmp_path):
    empty = tmp_path / "empty.pt"
    torch.save({"epoch": 3}, empty)
    with pytest.raises(UserError, match="holds no model weights"):
        build(pretrained=str(empty))
    other = tmp_path / "other.pt"
    torch.save({"encoder.weight": torch.zeros(3)}, other)
    with pytest.raises(UserError, match="no tensor"):
        build(pretrained=str(other))


def test_pretrained_torchvision_offline_is_user_error(monkeypatch):
    from torchvision.models._api import WeightsEnum

    def offline(self, *args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(WeightsEnum, "get_state_dict", offline)
    with pytest.raises(UserError) as e:
        build("resnet18", 10, 3, 32, pretrained="torchvision")
    assert "resnet18-" in e.value.line() and "model.pretrained=PATH" in e.value.line()


def test_pretrained_torchvision_loads_default_weights(monkeypatch):
    import torchvision
    from torchvision.models._api import WeightsEnum

    torch.manual_seed(3)
    imagenet = torchvision.models.resnet18().state_dict()
    monkeypatch.setattr(WeightsEnum, "get_state_dict", lambda self, *a, **k: imagenet)
    messages: list[str] = []
    model = build("resnet18", 10, 3, 32, pretrained="torchvision", report=messages.append)
    assert torch.equal(model.layer4[1].conv2.weight, imagenet["layer4.1.conv2.weight"])
    assert "classifier" in messages[0]


def test_pretrained_torchvision_needs_torchvision_arch():
    with pytest.raises(UserError, match="needs a torchvision model"):
        check_arch(make_cfg("cnn", pretrained="torchvision"))
    with pytest.raises(UserError, match="needs a torchvision model"):
        build("cnn", pretrained="torchvision")


# ------------------------------------------------------------------------------------------ prepare_model


def _norms(model):
    return [type(m) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def test_sync_bn_only_when_distributed():
    cpu = torch.device("cpu")
    plain = prepare_model(build("cnn"), make_cfg(sync_bn=True), cpu, distributed=False)
    assert set(_norms(plain)) == {nn.BatchNorm2d}
    off = prepare_model(build("cnn"), make_cfg(sync_bn=False), cpu, distributed=True)
    assert set(_norms(off)) == {nn.BatchNorm2d}
    # CPU processes get the gloo-capable variant (torch's SyncBatchNorm is GPU-only and DDP refuses it on CPU).
    src = build("cnn")
    synced = prepare_model(src, make_cfg(sync_bn=True), cpu, distributed=True)
    assert set(_norms(synced)) == {GlooSyncBatchNorm}
    assert list(synced.state_dict()) == list(build("cnn").state_dict())
    # Accelerators get torch's own SyncBatchNorm ("meta" stands in for a GPU here).
    meta = prepare_model(build("cnn"), make_cfg(sync_bn=True), torch.device("meta"), distributed=True)
    assert set(_norms(meta)) == {nn.SyncBatchNorm}
    assert next(meta.parameters()).device.type == "meta"


def test_sync_bn_single_process_is_plain_batchnorm():
    torch.manual_seed(0)
    ref = build("cnn")
    synced = prepare_model(build("cnn"), make_cfg(sync_bn=True), torch.device("cpu"), distributed=True)
    synced.load_state_dict(ref.state_dict())
    x = torch.randn(4, 1, 8, 8)
    assert torch.allclose(ref(x), synced(x), atol=1e-5)
    for k, v in ref.state_dict().items():
        assert torch.allclose(v.float(), synced.state_dict()[k].float(), atol=1e-6), k


def test_channels_last():
    model = prepare_model(build("cnn", 10, 3, 32), make_cfg(channels_last=True), torch.device("cpu"), False)
    assert model.block1[0].weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    assert model(x).shape == (2, 10)
    plain = prepare_model(build("cnn", 10, 3, 32), make_cfg(channels_last=False), torch.device("cpu"), False)
    assert not plain.block1[0].weight.is_contiguous(memory_format=torch.channels_last)
    mlp = prepare_model(
        build("mlp", 10, 3, 8), make_cfg("mlp", channels_last=True), torch.device("cpu"), False
    )
    assert mlp(torch.randn(2, 3, 8, 8)).shape == (2, 10)


def _sync_bn_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    full = torch.randn(8, 3, 4, 4) * 3 + 1
    upstream = torch.randn(8, 3, 4, 4)
    bn = convert_gloo_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))
    with torch.no_grad():
        bn[0].weight.uniform_(0.5, 1.5)
        bn[0].bias.uniform_(-1, 1)
    x = full[rank * 4 : (rank + 1) * 4].clone().requires_grad_(True)
    out = bn(x)
    (out * upstream[rank * 4 : (rank + 1) * 4]).sum().backward()
    wgrad = bn[0].weight.grad.clone()
    dist.all_reduce(wgrad)
    ddp = DDP(
        convert_gloo_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)))
    )  # accepted on CPU
    ddp(x.detach()).sum().backward()
    found = {
        "out": out,
        "xgrad": x.grad,
        "wgrad": wgrad,
        "running_mean": bn[0].running_mean,
        "running_var": bn[0].running_var,
    }
    return {
        k: v.detach().tolist() for k, v in found.items()
    }  # plain lists: tensors would outlive their process


@pytest.mark.slow
def test_gloo_sync_bn_matches_full_batch():
    from conftest import run_group

    results = run_group(_sync_bn_worker, 2)
    torch.manual_seed(0)
    full = torch.randn(8, 3, 4, 4) * 3 + 1
    upstream = torch.randn(8, 3, 4, 4)
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    x = full.clone().requires_grad_(True)
    out = bn(x)
    (out * upstream).sum().backward()
    for rank, r in enumerate(results):
        part = slice(rank * 4, (rank + 1) * 4)
        r = {k: torch.tensor(v) for k, v in r.items()}
        assert torch.allclose(r["out"], out[part].detach(), atol=1e-5)
        assert torch.allclose(r["xgrad"], x.grad[part], atol=1e-5)
        assert torch.allclose(r["wgrad"], bn.weight.grad, atol=1e-4)
        assert torch.allclose(r["running_mean"], bn.running_mean, atol=1e-5)
        assert torch.allclose(r["running_var"], bn.running_var, atol=1e-5)


def test_public_api_names_all_resolve_and_import_stays_light():
    code = (
        "import sys, ddpkit; light = 'torchvision' not in sys.modules and 'sklearn' not in sys.modules; "
        "missing = [n for n in ddpkit.__all__ if getattr(ddpkit, n, None) is None]; "
        "assert light, 'import ddpkit pulled in torchvision or scikit-learn'; assert not missing, missing"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_read_weights_is_public_and_reads_a_plain_state_dict(tmp_path):
    import ddpkit

    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    got = ddpkit.read_weights(str(tmp_path / "w.pt"))
    assert got.keys() == model.state_dict().keys()
    torch.testing.assert_close(got["weight"], model.weight.detach())
