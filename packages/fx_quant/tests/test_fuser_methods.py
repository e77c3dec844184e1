"""Fuser methods: same results as torch.ao's fuser methods, our fused module types."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from quantbridge.fx_quant import FxQuantError
from quantbridge.fx_quant import _fuser_methods as fm
from quantbridge.fx_quant.nn import intrinsic as nni


def _ao() -> Any:
    pytest.importorskip("torch.ao.quantization")
    import torch.ao.quantization.fuser_method_mappings as ao_fm

    return ao_fm


def _bn(cls: type[nn.Module], n: int) -> nn.Module:
    bn = cls(n)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
    return bn


CONVS = [
    (nn.Conv1d, nn.BatchNorm1d, (2, 3, 9)),
    (nn.Conv2d, nn.BatchNorm2d, (2, 3, 7, 6)),
    (nn.Conv3d, nn.BatchNorm3d, (2, 3, 5, 4, 4)),
]


@pytest.mark.parametrize(("conv_cls", "bn_cls", "shape"), CONVS)
@pytest.mark.parametrize("relu", [False, True])
def test_conv_bn_eval_matches_torch_ao(
    conv_cls: type[nn.Module], bn_cls: type[nn.Module], shape: tuple[int, ...], relu: bool
) -> None:
    ao_fm = _ao()
    torch.manual_seed(0)
    conv, bn = conv_cls(3, 4, 3).eval(), _bn(bn_cls, 4).eval()
    x = torch.randn(shape)
    if relu:
        ours = fm.fuse_conv_bn_relu(False, copy.deepcopy(conv), copy.deepcopy(bn), nn.ReLU().eval())
        theirs = ao_fm.fuse_conv_bn_relu(
            False, copy.deepcopy(conv), copy.deepcopy(bn), nn.ReLU().eval()
        )
        assert isinstance(ours, nni.FusedModule)
        assert type(ours[0]) is conv_cls
        assert torch.equal(ours[0].weight, theirs[0].weight)
        assert torch.equal(ours[0].bias, theirs[0].bias)
    else:
        ours = fm.fuse_conv_bn(False, copy.deepcopy(conv), copy.deepcopy(bn))
        theirs = ao_fm.fuse_conv_bn(False, copy.deepcopy(conv), copy.deepcopy(bn))
        assert type(ours) is conv_cls
        assert torch.equal(ours.weight, theirs.weight)
        assert torch.equal(ours.bias, theirs.bias)
    assert torch.equal(ours(x), theirs(x))
    # folding is faithful: the fused conv computes conv -> bn (-> relu) up to rounding
    expected = bn(conv(x))
    torch.testing.assert_close(ours(x), torch.relu(expected) if relu else expected)


@pytest.mark.parametrize(("conv_cls", "bn_cls", "shape"), CONVS)
def test_conv_bn_qat_builds_our_fused_modules(
    conv_cls: type[nn.Module], bn_cls: type[nn.Module], shape: tuple[int, ...]
) -> None:
    conv, bn = conv_cls(3, 4, 3), _bn(bn_cls, 4)
    fused = fm.fuse_conv_bn(True, conv, bn)
    assert type(fused).__name__ == f"ConvBn{conv_cls.__name__[-2:]}"
    assert fused[0] is conv
    assert fused[1] is bn
    fused3 = fm.fuse_conv_bn_relu(True, conv, bn, nn.ReLU())
    assert type(fused3).__name__ == f"ConvBnReLU{conv_cls.__name__[-2:]}"
    x = torch.randn(shape)
    assert torch.equal(fused3(x), torch.relu(bn(conv(x))))


def test_linear_bn_matches_torch_ao() -> None:
    ao_fm = _ao()
    torch.manual_seed(1)
    lin, bn = nn.Linear(5, 4).eval(), _bn(nn.BatchNorm1d, 4).eval()
    ours = fm.fuse_linear_bn(False, copy.deepcopy(lin), copy.deepcopy(bn))
    theirs = ao_fm.fuse_linear_bn(False, copy.deepcopy(lin), copy.deepcopy(bn))
    assert type(ours) is nn.Linear
    assert torch.equal(ours.weight, theirs.weight)
    assert torch.equal(ours.bias, theirs.bias)
    fused = fm.fuse_linear_bn(True, lin.train(), bn.train())
    assert type(fused) is nni.LinearBn1d


@pytest.mark.parametrize(
    ("cls", "bn_cls", "shape"),
    [
        (nn.ConvTranspose1d, nn.BatchNorm1d, (2, 4, 6)),
        (nn.ConvTranspose2d, nn.BatchNorm2d, (2, 4, 5, 5)),
        (nn.ConvTranspose3d, nn.BatchNorm3d, (2, 4, 3, 4, 3)),
    ],
)
def test_convtranspose_bn_matches_torch_ao(
    cls: type[nn.Module], bn_cls: type[nn.Module], shape: tuple[int, ...]
) -> None:
    ao_fm = _ao()
    torch.manual_seed(2)
    convt, bn = cls(4, 6, 3, stride=2).eval(), _bn(bn_cls, 6).eval()
    ours = fm.fuse_convtranspose_bn(False, copy.deepcopy(convt), copy.deepcopy(bn))
    theirs = ao_fm.fuse_convtranspose_bn(False, copy.deepcopy(convt), copy.deepcopy(bn))
    x = torch.randn(shape)
    assert torch.equal(ours.weight, theirs.weight)
    assert torch.equal(ours(x), theirs(x))
    with pytest.raises(FxQuantError, match="cannot be fused for QAT"):
        fm.fuse_convtranspose_bn(True, convt.train(), bn.train())


def test_default_table_matches_torch_ao_keys_and_results() -> None:
    ao_fm = _ao()
    ao_table = ao_fm._DEFAULT_OP_LIST_TO_FUSER_METHOD
    assert set(fm.DEFAULT_OP_LIST_TO_FUSER_METHOD) == set(ao_table)
    for ops, method in fm.DEFAULT_OP_LIST_TO_FUSER_METHOD.items():
        assert fm.get_fuser_method(ops) is method
        if len(ops) == 2 and ops[1] is nn.ReLU:
            first = (
                ops[0](4)
                if issubclass(ops[0], nn.modules.batchnorm._BatchNorm)
                else (ops[0](4, 4) if ops[0] is nn.Linear else ops[0](4, 4, 1))
            )
            fused = method(True, first, nn.ReLU())
            ao_fused = ao_table[ops](True, first, nn.ReLU())
            assert type(fused).__name__ == type(ao_fused).__name__
            assert isinstance(fused, nni.FusedModule)


def test_errors() -> None:
    conv, bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(5)
    with pytest.raises(FxQuantError, match="5 features"):
        fm.fuse_conv_bn(True, conv, bn)
    with pytest.raises(FxQuantError, match="train or all in eval"):
        fm.fuse_conv_bn(False, conv.train(), nn.BatchNorm2d(4).eval())
    with pytest.raises(FxQuantError, match="affine"):
        fm.fuse_conv_bn(True, conv, nn.BatchNorm2d(4, affine=False))
    with pytest.raises(FxQuantError, match="track_running_stats"):
        fm.fuse_linear_bn(True, nn.Linear(2, 4), nn.BatchNorm1d(4, track_running_stats=False))
    with pytest.raises(FxQuantError, match="cannot fuse a ConvTranspose2d"):
        fm.fuse_conv_bn(True, nn.ConvTranspose2d(3, 4, 1), nn.BatchNorm2d(4))
    with pytest.raises(FxQuantError, match="no fuser method for"):
        fm.get_fuser_method((nn.Linear, nn.Tanh))
    custom = fm.sequential_wrapper2(nni.LinearTanh)
    assert fm.get_fuser_method((nn.Linear, nn.Tanh), {(nn.Linear, nn.Tanh): custom}) is custom
