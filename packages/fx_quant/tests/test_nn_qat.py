"""QAT modules (nn.qat, nn.intrinsic.qat) against torch.ao's: outputs and gradients equal."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import quantbridge.qconfig as qbq
from quantbridge.fx_quant import FxQuantError
from quantbridge.fx_quant.nn import intrinsic as nni
from quantbridge.fx_quant.nn import qat as nnqat
from quantbridge.fx_quant.nn.intrinsic import qat as nniqat


def _ao() -> Any:
    pytest.importorskip("torch.ao.quantization")
    import torch.ao.nn.intrinsic as ao_nni
    import torch.ao.nn.intrinsic.qat as ao_nniqat
    import torch.ao.nn.qat as ao_nnqat
    import torch.ao.quantization as aoq

    return ao_nni, ao_nniqat, ao_nnqat, aoq


def _run_pair(ours: nn.Module, theirs: nn.Module, make_input: Any, steps: int = 3) -> None:
    """Train both a few SGD steps on the same data; outputs, grads and params stay equal."""
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        x = make_input(gen)
        xa = x.clone().requires_grad_(True)
        xb = x.clone().requires_grad_(True)
        ya, yb = ours(xa), theirs(xb)
        assert torch.equal(ya, yb), f"forward differs at step {step}"
        ga = torch.randn(ya.shape, generator=gen)
        ya.backward(ga)
        yb.backward(ga)
        assert xa.grad is not None
        assert xb.grad is not None
        assert torch.equal(xa.grad, xb.grad), f"input grad differs at step {step}"
        named_b = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            q = named_b[name]
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), f"grad of {name} differs at step {step}"
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    for name, buf in ours.named_buffers():
        other = dict(theirs.named_buffers())[name]
        assert torch.equal(buf, other), f"buffer {name} differs"


def _qconfigs(per_channel: bool) -> tuple[Any, Any]:
    """(ours, torch.ao's) default QAT qconfig for the same backend."""
    _, _, _, aoq = _ao()
    backend = "fbgemm" if per_channel else "qnnpack"
    return qbq.get_default_qat_qconfig(backend), aoq.get_default_qat_qconfig(backend)


def _conv(dim: int, bias: bool = True, **kw: Any) -> nn.Module:
    cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
    return cls(3, 4, 3, bias=bias, **kw)


def _bn(dim: int) -> nn.Module:
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dim](4)
    with torch.no_grad():  # non-trivial statistics and affine parameters
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
    return bn


def _input(dim: int) -> Any:
    spatial = {1: (9,), 2: (7, 6), 3: (5, 5, 4)}[dim]
    return lambda gen: torch.randn((2, 3, *spatial), generator=gen)


def _with_qconfig(mod: nn.Module, qconfig: Any) -> nn.Module:
    """Attach qconfig to mod and its children, as prepare's propagation does."""
    for sub in mod.modules():
        sub.qconfig = qconfig  # type: ignore[assignment]
    return mod


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_qat_linear_matches_torch_ao(per_channel: bool, bias: bool) -> None:
    _, _, ao_nnqat, _ = _ao()
    ours_qc, ao_qc = _qconfigs(per_channel)
    torch.manual_seed(0)
    float_mod = nn.Linear(6, 5, bias=bias)
    ours = nnqat.Linear.from_float(_with_qconfig(copy.deepcopy(float_mod), ours_qc))
    theirs = ao_nnqat.Linear.from_float(_with_qconfig(copy.deepcopy(float_mod), ao_qc))
    _run_pair(ours, theirs, lambda gen: torch.randn(4, 6, generator=gen))
    back = ours.to_float()
    assert type(back) is nn.Linear
    assert torch.equal(back.weight, ours.weight)


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("per_channel", [False, True])
def test_qat_conv_matches_torch_ao(dim: int, per_channel: bool) -> None:
    _, _, ao_nnqat, _ = _ao()
    ours_qc, ao_qc = _qconfigs(per_channel)
    torch.manual_seed(dim)
    float_mod = _conv(dim, padding=1, padding_mode="reflect" if dim == 2 else "zeros")
    ours_cls = {1: nnqat.Conv1d, 2: nnqat.Conv2d, 3: nnqat.Conv3d}[dim]
    ao_cls = {1: ao_nnqat.Conv1d, 2: ao_nnqat.Conv2d, 3: ao_nnqat.Conv3d}[dim]
    ours = ours_cls.from_float(_with_qconfig(copy.deepcopy(float_mod), ours_qc))
    theirs = ao_cls.from_float(_with_qconfig(copy.deepcopy(float_mod), ao_qc))
    _run_pair(ours, theirs, _input(dim))
    assert type(ours.to_float()) is type(float_mod)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_qat_conv_relu_matches_torch_ao(dim: int) -> None:
    ao_nni, ao_nniqat, _, _ = _ao()
    ours_qc, ao_qc = _qconfigs(True)
    torch.manual_seed(10 + dim)
    conv = _conv(dim)
    ours_fused = {1: nni.ConvReLU1d, 2: nni.ConvReLU2d, 3: nni.ConvReLU3d}[dim]
    ao_fused = {1: ao_nni.ConvReLU1d, 2: ao_nni.ConvReLU2d, 3: ao_nni.ConvReLU3d}[dim]
    ours_cls = {1: nniqat.ConvReLU1d, 2: nniqat.ConvReLU2d, 3: nniqat.ConvReLU3d}[dim]
    ao_cls = {1: ao_nniqat.ConvReLU1d, 2: ao_nniqat.ConvReLU2d, 3: ao_nniqat.ConvReLU3d}[dim]
    ours = ours_cls.from_float(_with_qconfig(ours_fused(copy.deepcopy(conv), nn.ReLU()), ours_qc))
    theirs = ao_cls.from_float(_with_qconfig(ao_fused(copy.deepcopy(conv), nn.ReLU()), ao_qc))
    _run_pair(ours, theirs, _input(dim))
    back = ours.to_float()
    assert type(back) is ours_fused
    assert isinstance(ours, nni.FusedModule)


def test_qat_linear_relu_matches_torch_ao() -> None:
    ao_nni, ao_nniqat, _, _ = _ao()
    ours_qc, ao_qc = _qconfigs(True)
    torch.manual_seed(3)
    lin = nn.Linear(6, 5)
    ours = nniqat.LinearReLU.from_float(
        _with_qconfig(nni.LinearReLU(copy.deepcopy(lin), nn.ReLU()), ours_qc)
    )
    theirs = ao_nniqat.LinearReLU.from_float(
        _with_qconfig(ao_nni.LinearReLU(copy.deepcopy(lin), nn.ReLU()), ao_qc)
    )
    _run_pair(ours, theirs, lambda gen: torch.randn(4, 6, generator=gen))
    assert type(ours.to_float()) is nni.LinearReLU


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_qat_conv_bn_matches_torch_ao(dim: int, relu: bool, bias: bool) -> None:
    ao_nni, ao_nniqat, _, _ = _ao()
    ours_qc, ao_qc = _qconfigs(True)
    torch.manual_seed(20 + dim)
    conv, bn = _conv(dim, bias=bias), _bn(dim)
    key = (dim, relu)
    ours_fused = {
        (1, False): nni.ConvBn1d, (2, False): nni.ConvBn2d, (3, False): nni.ConvBn3d,
        (1, True): nni.ConvBnReLU1d, (2, True): nni.ConvBnReLU2d, (3, True): nni.ConvBnReLU3d,
    }[key]  # fmt: skip
    ao_fused = {
        (1, False): ao_nni.ConvBn1d, (2, False): ao_nni.ConvBn2d, (3, False): ao_nni.ConvBn3d,
        (1, True): ao_nni.ConvBnReLU1d, (2, True): ao_nni.ConvBnReLU2d,
        (3, True): ao_nni.ConvBnReLU3d,
    }[key]  # fmt: skip
    ours_cls = getattr(nniqat, ours_fused.__name__)
    ao_cls = getattr(ao_nniqat, ao_fused.__name__)
    extra = (nn.ReLU(),) if relu else ()
    ours = ours_cls.from_float(
        _with_qconfig(ours_fused(copy.deepcopy(conv), copy.deepcopy(bn), *extra), ours_qc)
    )
    theirs = ao_cls.from_float(
        _with_qconfig(ao_fused(copy.deepcopy(conv), copy.deepcopy(bn), *extra), ao_qc)
    )
    ours.train()
    theirs.train()
    _run_pair(ours, theirs, _input(dim))  # BN statistics update and must agree
    # freeze_bn: running statistics stop moving, still identical to torch.ao
    ours.freeze_bn_stats()
    theirs.freeze_bn_stats()
    before = ours.bn.running_mean.clone()
    _run_pair(ours, theirs, _input(dim), steps=2)
    assert torch.equal(ours.bn.running_mean, before)
    ours.update_bn_stats()
    theirs.update_bn_stats()
    _run_pair(ours, theirs, _input(dim), steps=1)
    ours.eval()
    theirs.eval()
    x = _input(dim)(torch.Generator().manual_seed(1))
    assert torch.equal(ours(x), theirs(x))
    # to_float folds BN exactly as torch.ao's does
    back, ao_back = ours.to_float(), theirs.to_float()
    float_conv = back[0] if relu else back
    ao_conv = ao_back[0] if relu else ao_back
    assert type(float_conv) is type(conv)
    assert torch.equal(float_conv.weight, ao_conv.weight)
    assert torch.equal(float_conv.bias, ao_conv.bias)
    assert torch.equal(back(x), ao_back(x))


def test_qat_linear_bn_matches_torch_ao() -> None:
    ao_nni, ao_nniqat, _, _ = _ao()
    ours_qc, ao_qc = _qconfigs(True)
    torch.manual_seed(5)
    lin = nn.Linear(6, 4)
    bn = _bn(1)
    ours = nniqat.LinearBn1d.from_float(
        _with_qconfig(nni.LinearBn1d(copy.deepcopy(lin), copy.deepcopy(bn)), ours_qc)
    )
    theirs = ao_nniqat.LinearBn1d.from_float(
        _with_qconfig(ao_nni.LinearBn1d(copy.deepcopy(lin), copy.deepcopy(bn)), ao_qc)
    )
    _run_pair(ours, theirs, lambda gen: torch.randn(8, 6, generator=gen))
    ours.eval()
    theirs.eval()
    back, ao_back = ours.to_float(), theirs.to_float()
    assert torch.equal(back.weight, ao_back.weight)
    assert torch.equal(back.bias, ao_back.bias)


@pytest.mark.parametrize("bag", [False, True])
def test_qat_embedding_matches_torch_ao(bag: bool) -> None:
    _, _, ao_nnqat, aoq = _ao()
    torch.manual_seed(6)
    ours_qc, ao_qc = qbq.default_embedding_qat_qconfig, aoq.default_embedding_qat_qconfig
    if bag:
        float_mod: nn.Module = nn.EmbeddingBag(10, 4, mode="sum")
        ours = nnqat.EmbeddingBag.from_float(_with_qconfig(copy.deepcopy(float_mod), ours_qc))
        theirs = ao_nnqat.EmbeddingBag.from_float(_with_qconfig(copy.deepcopy(float_mod), ao_qc))
        idx = torch.tensor([[1, 2, 4], [4, 3, 9]])
    else:
        float_mod = nn.Embedding(10, 4)
        ours = nnqat.Embedding.from_float(_with_qconfig(copy.deepcopy(float_mod), ours_qc))
        theirs = ao_nnqat.Embedding.from_float(_with_qconfig(copy.deepcopy(float_mod), ao_qc))
        idx = torch.tensor([[1, 2, 4], [4, 3, 9]])
    for _ in range(2):
        ya, yb = ours(idx), theirs(idx)
        assert torch.equal(ya, yb)
        ya.sum().backward()
        yb.sum().backward()
        assert torch.equal(ours.weight.grad, theirs.weight.grad)
    assert type(ours.to_float()) is type(float_mod)


def test_modules_work_with_torch_ao_qconfig_too() -> None:
    """Our modules only need qconfig.weight(): torch.ao's qconfig objects work as well."""
    _, _, ao_nnqat, aoq = _ao()
    qc = aoq.get_default_qat_qconfig("fbgemm")
    torch.manual_seed(8)
    conv = _with_qconfig(nn.Conv2d(3, 4, 3), qc)
    ours = nnqat.Conv2d.from_float(copy.deepcopy(conv))
    theirs = ao_nnqat.Conv2d.from_float(copy.deepcopy(conv))
    _run_pair(ours, theirs, _input(2), steps=2)


def test_sync_batchnorm_conv_bn() -> None:
    """SyncBatchNorm survives both orders: convert before from_float, or after.

    SyncBatchNorm only synchronizes CUDA/XPU tensors, so a CPU gloo group cannot exercise
    the cross-rank path; without a process group it computes local statistics, which must
    equal the per-rank BatchNorm version exactly.
    """
    ours_qc = qbq.get_default_qat_qconfig("fbgemm")
    torch.manual_seed(9)
    model = nn.Sequential(nni.ConvBnReLU2d(nn.Conv2d(3, 4, 3), _bn(2), nn.ReLU()))
    reference = copy.deepcopy(model)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    fused = model[0]
    assert isinstance(fused[1], nn.SyncBatchNorm)
    qat = nniqat.ConvBnReLU2d.from_float(_with_qconfig(fused, ours_qc))
    assert isinstance(qat.bn, nn.SyncBatchNorm)
    plain = nniqat.ConvBnReLU2d.from_float(_with_qconfig(reference[0], ours_qc))
    assert type(plain.bn) is nn.BatchNorm2d
    late = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain))
    assert isinstance(late.bn, nn.SyncBatchNorm)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(2, 3, 6, 6, generator=gen)
        y_plain = plain(x)
        for mod in (qat, late):
            assert torch.equal(mod(x), y_plain)
            assert torch.equal(mod.bn.running_mean, plain.bn.running_mean)
    qat.freeze_bn_stats()
    assert not qat.bn.training
    qat(x).sum().backward()
    assert qat.weight.grad is not None
    assert qat.to_float()[0].weight.shape == (4, 3, 3, 3)


def test_fused_type_checks() -> None:
    with pytest.raises(FxQuantError, match="ConvReLU2d fuses"):
        nni.ConvReLU2d(nn.Conv1d(1, 1, 1), nn.ReLU())
    with pytest.raises(FxQuantError, match="ConvBn2d"):
        nni.ConvBn2d(nn.Conv2d(1, 1, 1), nn.BatchNorm1d(1))
    with pytest.raises(FxQuantError, match="LinearTanh"):
        nni.LinearTanh(nn.Linear(1, 1), nn.ReLU())


def test_fused_forward_is_sequential() -> None:
    torch.manual_seed(0)
    lin, act = nn.Linear(4, 3), nn.LeakyReLU(0.2)
    x = torch.randn(5, 4)
    assert torch.equal(nni.LinearLeakyReLU(lin, act)(x), act(lin(x)))
    assert torch.equal(nni.LinearTanh(lin, nn.Tanh())(x), torch.tanh(lin(x)))
    bn = _bn(2).eval()
    x4 = torch.randn(2, 4, 3, 3)
    assert torch.equal(nni.BNReLU2d(bn, nn.ReLU())(x4), torch.relu(bn(x4)))
    conv = nn.Conv2d(4, 4, 1)
    other = torch.randn(2, 4, 3, 3)
    assert torch.equal(nni.ConvAdd2d(conv, torch.add)(x4, other), conv(x4) + other)
    assert torch.equal(
        nni.ConvAddReLU2d(conv, torch.add, nn.ReLU())(x4, other), torch.relu(conv(x4) + other)
    )


def test_fused_matches_torch_ao_forward() -> None:
    ao_nni, _, _, _ = _ao()
    torch.manual_seed(1)
    conv, bn = nn.Conv3d(3, 4, 2), _bn(3).eval()
    x = torch.randn(1, 3, 4, 4, 4)
    ours = nni.ConvBnReLU3d(conv, bn, nn.ReLU())
    theirs = ao_nni.ConvBnReLU3d(conv, bn, nn.ReLU())
    assert torch.equal(ours(x), theirs(x))


def test_qat_errors() -> None:
    lin = nn.Linear(2, 2)
    with pytest.raises(FxQuantError, match="no qconfig"):
        nnqat.Linear.from_float(lin)
    with pytest.raises(FxQuantError, match="only works for Linear"):
        nnqat.Linear.from_float(_with_qconfig(nn.Conv2d(1, 1, 1), qbq.default_qat_qconfig))
    with pytest.raises(FxQuantError, match="needs a qconfig"):
        nnqat.Conv2d(1, 1, 1)
    with pytest.raises(FxQuantError, match="per_channel_affine_float_qparams"):
        nnqat.Embedding.from_float(_with_qconfig(nn.Embedding(3, 2), qbq.default_qat_qconfig))


def test_mappings_cover_every_qat_module() -> None:
    from quantbridge.fx_quant.nn import (
        DEFAULT_QAT_MODULE_MAPPINGS,
        DEFAULT_REFERENCE_MODULE_MAPPINGS,
    )

    for src, dst in DEFAULT_QAT_MODULE_MAPPINGS.items():
        assert dst.__name__ == src.__name__
        assert callable(getattr(dst, "from_float", None))
    assert DEFAULT_QAT_MODULE_MAPPINGS[nni.ConvBnReLU2d] is nniqat.ConvBnReLU2d
    assert DEFAULT_REFERENCE_MODULE_MAPPINGS[nn.ConvTranspose2d].__name__ == "ConvTranspose2d"


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_qat_conv_bn_slow_path_matches_torch_ao(dim: int, bias: bool) -> None:
    ao_nni, ao_nniqat, _, _ = _ao()
    ours_qc, ao_qc = _qconfigs(True)
    torch.manual_seed(30 + dim)
    conv, bn = _conv(dim, bias=bias), _bn(dim)
    ours_fused = {1: nni.ConvBnReLU1d, 2: nni.ConvBnReLU2d}[dim]
    ao_fused = {1: ao_nni.ConvBnReLU1d, 2: ao_nni.ConvBnReLU2d}[dim]
    ours = getattr(nniqat, ours_fused.__name__).from_float(
        _with_qconfig(ours_fused(copy.deepcopy(conv), copy.deepcopy(bn), nn.ReLU()), ours_qc)
    )
    theirs = getattr(ao_nniqat, ao_fused.__name__).from_float(
        _with_qconfig(ao_fused(copy.deepcopy(conv), copy.deepcopy(bn), nn.ReLU()), ao_qc)
    )
    ours._enable_slow_path_for_better_numerical_stability = True
    theirs._enable_slow_path_for_better_numerical_stability = True
    _run_pair(ours, theirs, _input(dim))
    ours.eval()
    theirs.eval()
    _run_pair(ours, theirs, _input(dim), steps=1)


def test_torch_ao_qat_checkpoint_loads_and_continues_identically() -> None:
    """A torch.ao QAT ConvBnReLU2d state_dict (mid-training) drops into ours unchanged."""
    ao_nni, ao_nniqat, _, _ = _ao()
    ours_qc, ao_qc = _qconfigs(True)
    torch.manual_seed(16)
    conv, bn = _conv(2), _bn(2)
    ours = nniqat.ConvBnReLU2d.from_float(
        _with_qconfig(nni.ConvBnReLU2d(copy.deepcopy(conv), copy.deepcopy(bn), nn.ReLU()), ours_qc)
    )
    theirs = ao_nniqat.ConvBnReLU2d.from_float(
        _with_qconfig(ao_nni.ConvBnReLU2d(copy.deepcopy(conv), copy.deepcopy(bn), nn.ReLU()), ao_qc)
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        theirs(_input(2)(gen))
    state = theirs.state_dict()
    assert set(state) == set(ours.state_dict())
    ours.load_state_dict(state)
    _run_pair(ours, theirs, _input(2), steps=2)
