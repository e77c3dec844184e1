"""The seven built-in BackendConfigs against torch.ao 2.13's (skipped once torch.ao is gone).

Every torch.ao class is mapped to ours by name (torch.ao.nn.intrinsic.ConvReLU2d ->
quantbridge.fx_quant.nn.intrinsic.ConvReLU2d, ...), every torch.ao fuser method to ours by an
explicit table, and then, pattern by pattern, every field of the two configs is compared.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torch.ao.quantization")

import torch.ao.quantization.backend_config.utils
from torch.ao.quantization import backend_config as ao_bc
from torch.ao.quantization import fuser_method_mappings as ao_fm
from torch.ao.quantization.backend_config.native import (
    get_test_only_legacy_native_backend_config as ao_legacy_native,
)
from torch.ao.quantization.backend_config.x86 import get_x86_backend_config as ao_x86
from torch.ao.quantization.utils import MatchAllNode as AoMatchAllNode

import quantbridge.fx_quant as fxq
import quantbridge.qconfig as qb
from quantbridge.fx_quant import _backend_configs as bc
from quantbridge.fx_quant import _fuser_methods as our_fm
from quantbridge.fx_quant import nn as qnn
from quantbridge.fx_quant._backend_configs import _fusers
from quantbridge.patterns import MatchAllNode

AO_GETTERS: dict[str, Callable[[], Any]] = {
    "native": ao_bc.get_native_backend_config,
    "fbgemm": ao_bc.get_fbgemm_backend_config,
    "x86": ao_x86,
    "qnnpack": ao_bc.get_qnnpack_backend_config,
    "onednn": ao_bc.get_onednn_backend_config,
    "executorch": ao_bc.get_executorch_backend_config,
    "tensorrt": ao_bc.get_tensorrt_backend_config,
}
OUR_GETTERS: dict[str, Callable[[], qb.BackendConfig]] = {
    "native": fxq.get_native_backend_config,
    "fbgemm": fxq.get_fbgemm_backend_config,
    "x86": fxq.get_x86_backend_config,
    "qnnpack": fxq.get_qnnpack_backend_config,
    "onednn": fxq.get_onednn_backend_config,
    "executorch": fxq.get_executorch_backend_config,
    "tensorrt": fxq.get_tensorrt_backend_config,
}
# The counts the brief fixes (and torch.ao 2.13 has).
EXPECTED_COUNTS = {
    "native": 194,
    "fbgemm": 192,
    "x86": 192,
    "qnnpack": 190,
    "onednn": 221,
    "executorch": 84,
    "tensorrt": 149,
}

# torch.ao module namespaces -> ours (most specific first).
_NAMESPACES = (
    ("torch.ao.nn.intrinsic.qat", qnn.intrinsic_qat),
    ("torch.ao.nn.intrinsic", qnn.intrinsic),
    ("torch.ao.nn.qat", qnn.qat),
    ("torch.ao.nn.quantized.reference", qnn.reference),
)

# torch.ao fuser functions -> ours, by name.
_NAMED_FUSERS: dict[str, Callable[..., Any]] = {
    "fuse_conv_bn": our_fm.fuse_conv_bn,
    "fuse_conv_bn_relu": our_fm.fuse_conv_bn_relu,
    "fuse_linear_bn": our_fm.fuse_linear_bn,
    "fuse_convtranspose_bn": our_fm.fuse_convtranspose_bn,
    "_fuse_linear_bn_leaky_relu": _fusers.fuse_linear_bn_leaky_relu,
    "_fuse_conv_add_left": _fusers.fuse_conv_add_left,
    "_fuse_conv_add_right": _fusers.fuse_conv_add_right,
    "_fuse_conv_bn_add_left": _fusers.fuse_conv_bn_add_left,
    "_fuse_conv_bn_add_right": _fusers.fuse_conv_bn_add_right,
    "_fuse_conv_add_relu_left": _fusers.fuse_conv_add_relu_left,
    "_fuse_conv_add_relu_right": _fusers.fuse_conv_add_relu_right,
    "_fuse_conv_bn_add_relu_left": _fusers.fuse_conv_bn_add_relu_left,
    "_fuse_conv_bn_add_relu_right": _fusers.fuse_conv_bn_add_relu_right,
}
# torch.ao's _sequential_wrapper2(cls) closures -> ours, by the fused class they build.
_SEQUENTIAL_FUSERS: dict[type[nn.Module], Callable[..., Any]] = {
    qnn.intrinsic.ConvReLU1d: _fusers.fuse_conv1d_relu,
    qnn.intrinsic.ConvReLU2d: _fusers.fuse_conv2d_relu,
    qnn.intrinsic.ConvReLU3d: _fusers.fuse_conv3d_relu,
    qnn.intrinsic.LinearReLU: _fusers.fuse_linear_relu,
    qnn.intrinsic.BNReLU2d: _fusers.fuse_bn2d_relu,
    qnn.intrinsic.BNReLU3d: _fusers.fuse_bn3d_relu,
    qnn.intrinsic.LinearLeakyReLU: _fusers.fuse_linear_leaky_relu,
    qnn.intrinsic.LinearTanh: _fusers.fuse_linear_tanh,
}


def to_ours(obj: Any) -> Any:
    """The quantbridge counterpart of a torch.ao object (plain torch passes through)."""
    if obj is AoMatchAllNode:
        return MatchAllNode
    if isinstance(obj, tuple):
        return tuple(to_ours(o) for o in obj)
    module = getattr(obj, "__module__", None) or ""
    if isinstance(obj, type) and module.startswith("torch.ao."):
        for prefix, namespace in _NAMESPACES:
            if module.startswith(prefix + "."):
                ours = getattr(namespace, obj.__name__, None)
                assert ours is not None, f"no counterpart of {module}.{obj.__name__}"
                return ours
        raise AssertionError(f"unmapped torch.ao class {module}.{obj.__name__}")
    if callable(obj) and module.startswith("torch.ao."):
        if obj.__qualname__ == "_sequential_wrapper2.<locals>.fuser_method":
            assert obj.__closure__ is not None
            return _SEQUENTIAL_FUSERS[to_ours(obj.__closure__[0].cell_contents)]
        assert obj.__name__ in _NAMED_FUSERS, f"unmapped torch.ao function {obj.__qualname__}"
        return _NAMED_FUSERS[obj.__name__]
    return obj


def canonical_constraints(dwc: Any) -> qb.DTypeWithConstraints:
    """torch.ao's DTypeWithConstraints as ours: dtypes canonicalised by our constructor."""
    return qb.DTypeWithConstraints(**{f.name: getattr(dwc, f.name) for f in fields(dwc)})


def describe(config: Any, *, ao: bool) -> dict[str, Any]:
    """Every field of a BackendPatternConfig, torch.ao's mapped to ours."""
    m = to_ours if ao else (lambda x: x)
    canon = canonical_constraints if ao else (lambda x: x)
    return {
        "observation_type": config.observation_type.name,
        "dtype_configs": [
            (
                canon(dc.input_dtype_with_constraints),
                canon(dc.output_dtype_with_constraints),
                canon(dc.weight_dtype_with_constraints),
                None
                if dc.bias_dtype is None
                else qb.DTypeConfig(bias_dtype=dc.bias_dtype).bias_dtype,
                dc.is_dynamic,
            )
            for dc in config.dtype_configs
        ],
        "pattern (sequential form)": m(config.pattern),
        "root_module": m(config.root_module),
        "qat_module": m(config.qat_module),
        "reference_quantized_module": m(config.reference_quantized_module),
        "fused_module": m(config.fused_module),
        "fuser_method": m(config.fuser_method),
        "root_node_getter set": config._root_node_getter is not None,
        "extra_inputs_getter set": config._extra_inputs_getter is not None,
        "num_tensor_args_to_observation_type": {
            k: v.name for k, v in config._num_tensor_args_to_observation_type.items()
        },
        "input_type_to_index": dict(config._input_type_to_index),
    }


def _show(pattern: Any) -> str:
    if isinstance(pattern, tuple):
        return "(" + ", ".join(_show(p) for p in pattern) + ")"
    if isinstance(pattern, str):
        return repr(pattern)
    return f"{getattr(pattern, '__module__', '?')}.{getattr(pattern, '__qualname__', pattern)}"


def _fmt(value: Any) -> str:
    """Compact text for diffs: a DTypeWithConstraints shows only the fields that are set."""
    if isinstance(value, qb.DTypeWithConstraints):
        if value.dtype is None:
            return "-"
        extra = [
            f"{f.name}={getattr(value, f.name)}"
            for f in fields(value)
            if f.name != "dtype" and getattr(value, f.name) is not None
        ]
        name = str(value.dtype).removeprefix("torch.")
        return f"{name}({', '.join(extra)})" if extra else name
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value)


def differences(ao_config: Any, ours: qb.BackendConfig) -> list[str]:
    """Readable differences between torch.ao's config and ours, naming the pattern."""
    theirs = {to_ours(k): v for k, v in ao_config._pattern_complex_format_to_config.items()}
    mine = ours._pattern_complex_format_to_config
    out = [f"only in torch.ao: {_show(p)}" for p in theirs if p not in mine]
    out += [f"only in ours: {_show(p)}" for p in mine if p not in theirs]
    for pattern, ao_pc in theirs.items():
        if pattern not in mine:
            continue
        want, got = describe(ao_pc, ao=True), describe(mine[pattern], ao=False)
        for key in want:
            if want[key] != got[key]:
                out.append(
                    f"{_show(pattern)}: {key}\n    torch.ao: {_fmt(want[key])}"
                    f"\n    ours:     {_fmt(got[key])}"
                )
    if not out and list(theirs) != list(mine):
        out.append("same patterns, different registration order")
    return out


@pytest.mark.parametrize("name", sorted(AO_GETTERS))
def test_same_patterns_and_fields_as_torch_ao(name: str) -> None:
    ao_config = AO_GETTERS[name]()
    ours = OUR_GETTERS[name]()
    assert ours.name == ao_config.name == name
    assert len(ours.configs) == len(ao_config.configs) == EXPECTED_COUNTS[name]
    diff = differences(ao_config, ours)
    assert not diff, f"{name}: {len(diff)} difference(s):\n" + "\n".join(diff)


def test_legacy_native_config_matches_too() -> None:
    ours = bc.get_test_only_legacy_native_backend_config()
    ao_config = ao_legacy_native()
    assert ours.name == "_native_and_fp16"
    diff = differences(ao_config, ours)
    assert not diff, "\n".join(diff)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (fxq.get_native_backend_config_dict, ao_bc.get_native_backend_config_dict),
        (fxq.get_tensorrt_backend_config_dict, ao_bc.get_tensorrt_backend_config_dict),
        (
            bc.get_test_only_legacy_native_backend_config_dict,
            torch.ao.quantization.backend_config.native.get_test_only_legacy_native_backend_config_dict,
        ),
    ],
)
def test_dict_getters_have_torch_aos_keys(
    ours: Callable[[], dict[str, Any]], theirs: Callable[[], dict[str, Any]]
) -> None:
    mine, ao_dict = ours(), theirs()
    assert mine.keys() == ao_dict.keys() == {"name", "configs"}
    assert mine["name"] == ao_dict["name"]
    assert len(mine["configs"]) == len(ao_dict["configs"])
    for i, (a, b) in enumerate(zip(mine["configs"], ao_dict["configs"], strict=True)):
        assert a.keys() == b.keys(), f"configs[{i}] ({b.get('pattern')})"
    # and the dict reads back into the same config
    assert qb.BackendConfig.from_dict(mine).to_dict() == mine


# -- fuser methods give torch.ao's results -------------------------------------------------


def _bn(cls: type[nn.Module], n: int) -> nn.Module:
    return _bn_stats(cls(n))


def _bn_stats(bn: nn.Module) -> nn.Module:
    """Non-trivial running statistics and affine parameters, so folding is visible."""
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
    return bn


# One instance per module type; 3 input channels into a layer, 4 out of it.
_FACTORIES: dict[Any, Callable[[], Any]] = {
    nn.Conv1d: lambda: nn.Conv1d(3, 4, 3),
    nn.Conv2d: lambda: nn.Conv2d(3, 4, 3, padding=1),
    nn.Conv3d: lambda: nn.Conv3d(3, 4, 3),
    nn.ConvTranspose1d: lambda: nn.ConvTranspose1d(3, 4, 3),
    nn.ConvTranspose2d: lambda: nn.ConvTranspose2d(3, 4, 3),
    nn.ConvTranspose3d: lambda: nn.ConvTranspose3d(3, 4, 3),
    nn.Linear: lambda: nn.Linear(3, 4),
    nn.BatchNorm1d: lambda: _bn(nn.BatchNorm1d, 4),
    nn.BatchNorm2d: lambda: _bn(nn.BatchNorm2d, 4),
    nn.BatchNorm3d: lambda: _bn(nn.BatchNorm3d, 4),
    nn.ReLU: nn.ReLU,
    F.relu: nn.ReLU,  # torch.ao's fuse handler passes a fresh nn.ReLU for F.relu
    nn.LeakyReLU: lambda: nn.LeakyReLU(0.1),
    F.leaky_relu: lambda: nn.LeakyReLU(0.01),
    nn.Tanh: nn.Tanh,
    torch.tanh: nn.Tanh,
}
_INPUT_SHAPES: dict[Any, tuple[int, ...]] = {
    nn.Conv1d: (2, 3, 9),
    nn.Conv2d: (2, 3, 6, 5),
    nn.Conv3d: (2, 3, 5, 5, 4),
    nn.ConvTranspose1d: (2, 3, 9),
    nn.ConvTranspose2d: (2, 3, 6, 5),
    nn.ConvTranspose3d: (2, 3, 5, 5, 4),
    nn.Linear: (5, 3),
    nn.BatchNorm2d: (2, 4, 5, 5),
    nn.BatchNorm3d: (2, 4, 3, 3, 3),
}


def _instantiate(pattern: Any, train: bool, ao: bool) -> Any:
    """The fuser's arguments for a complex pattern: modules, functions, MatchAllNode."""
    if isinstance(pattern, tuple):
        return tuple(_instantiate(p, train, ao) for p in pattern)
    if pattern is AoMatchAllNode:
        return AoMatchAllNode if ao else MatchAllNode
    if pattern in (torch.add, operator.add):
        return pattern
    return _FACTORIES[pattern]().train(train)


def _fusion_cases() -> list[tuple[str, Any]]:
    cases = []
    for name in ("native", "onednn", "executorch"):
        for pattern, pc in AO_GETTERS[name]()._pattern_complex_format_to_config.items():
            if pc.fuser_method is not None:
                cases.append((name, pattern))
    return cases


def _run(module: nn.Module, first: Any) -> torch.Tensor:
    """Forward a fused module on a fixed input suited to its first pattern element."""
    torch.manual_seed(1)
    if type(module).__name__ in ("ConvAdd2d", "ConvAddReLU2d"):
        return module(torch.randn(2, 3, 6, 5), torch.randn(2, 4, 6, 5))  # type: ignore[no-any-return]
    return module(torch.randn(_INPUT_SHAPES[first]))  # type: ignore[no-any-return]


def _swap_match_all(args: Any) -> Any:
    if isinstance(args, tuple):
        return tuple(_swap_match_all(a) for a in args)
    return MatchAllNode if args is AoMatchAllNode else args


def _case_id(value: Any) -> str:
    """Names instead of str(): its object addresses differ between processes (pytest-xdist)."""
    if isinstance(value, tuple):
        return "(" + ", ".join(_case_id(v) for v in value) + ")"
    if isinstance(value, type):
        return value.__name__
    if callable(value):
        return f"{value.__module__}.{value.__name__}"
    return str(value)


@pytest.mark.parametrize("is_qat", [False, True])
@pytest.mark.parametrize(("backend", "complex_pattern"), _fusion_cases(), ids=_case_id)
def test_fuser_methods_build_what_torch_ao_builds(
    backend: str, complex_pattern: Any, is_qat: bool
) -> None:
    ao_pc = AO_GETTERS[backend]()._pattern_complex_format_to_config[complex_pattern]
    ours_pc = OUR_GETTERS[backend]()._pattern_complex_format_to_config[to_ours(complex_pattern)]
    # Sequential patterns: the fuser takes the modules in execution order; complex ones
    # (onednn's conv-add) take the nested elements.
    elements = ao_pc.pattern if ao_pc.pattern is not None else complex_pattern
    torch.manual_seed(0)
    ao_args = _instantiate(elements, train=is_qat, ao=True)
    our_args = _swap_match_all(copy.deepcopy(ao_args))
    try:
        theirs = ao_pc.fuser_method(is_qat, *ao_args)
    except Exception:  # torch.ao refuses (QAT + bn folding): ours must refuse clearly too
        with pytest.raises(fxq.FxQuantError):
            ours_pc.fuser_method(is_qat, *our_args)
        return
    ours = ours_pc.fuser_method(is_qat, *our_args)
    assert type(ours) is to_ours(type(theirs)), (type(ours), type(theirs))
    first = elements[0] if ao_pc.pattern is not None else None
    with torch.no_grad():
        theirs.train(is_qat)
        ours.train(is_qat)
        assert torch.equal(_run(ours, first), _run(theirs, first))


def _stand_in_nodes(pattern: Any, counter: Any) -> Any:
    """Each element of a pattern replaced by a unique string, standing in for graph nodes."""
    if isinstance(pattern, tuple):
        return tuple(_stand_in_nodes(e, counter) for e in pattern)
    return f"node{next(counter)}"


def test_onednn_getters_pick_the_conv_node_and_the_other_operand() -> None:
    """Root-node and extra-inputs getters agree with torch.ao's on stand-in node patterns."""
    ao_config = ao_bc.get_onednn_backend_config()
    ours = fxq.get_onednn_backend_config()
    checked = 0
    for pattern, ao_pc in ao_config._pattern_complex_format_to_config.items():
        if ao_pc._root_node_getter is None:
            continue
        our_pc = ours._pattern_complex_format_to_config[to_ours(pattern)]
        node_pattern = _stand_in_nodes(pattern, iter(range(100)))
        assert our_pc._root_node_getter(node_pattern) == ao_pc._root_node_getter(node_pattern)
        assert our_pc._extra_inputs_getter(node_pattern) == ao_pc._extra_inputs_getter(node_pattern)
        checked += 1
    assert checked == 16


def test_sequential_fusers_agree_with_torch_aos_default_table() -> None:
    """Our per-class fusers build the same fused classes as torch.ao's default fuser table."""
    for ops, ao_fuser in ao_fm._DEFAULT_OP_LIST_TO_FUSER_METHOD.items():
        if ao_fuser.__qualname__ != "_sequential_wrapper2.<locals>.fuser_method":
            continue
        cls = to_ours(ao_fuser.__closure__[0].cell_contents)
        mods = [_FACTORIES[o]() for o in ops]
        assert type(_SEQUENTIAL_FUSERS[cls](False, *mods)) is cls


# -- end to end: fuse_fx with each config fuses what torch.ao's fuse_fx fuses -----------------


class _FusionZoo(nn.Module):
    """One model touching every fusion family: conv-bn-relu, conv(+bn)+add(+relu), bn-relu,
    linear + leaky_relu / tanh / bn, conv1d + F.relu, conv-transpose + bn."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1, self.r1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        self.c2, self.bn2, self.r2 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU()
        self.c3, self.c4, self.bn3 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.l1, self.leaky = nn.Linear(4, 8), nn.LeakyReLU(0.1)
        self.l2, self.tanh = nn.Linear(8, 8), nn.Tanh()
        self.l3, self.bn1d = nn.Linear(8, 6), nn.BatchNorm1d(6)
        self.c1d, self.ct, self.bnt = (
            nn.Conv1d(2, 3, 3),
            nn.ConvTranspose1d(3, 3, 3),
            nn.BatchNorm1d(3),
        )

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.r1(self.bn1(self.c1(x)))
        x = self.r2(self.bn2(self.c2(x)) + x)  # onednn: conv-bn-add-relu, conv on the left
        x = torch.add(x, self.c3(x))  # onednn: conv-add, conv on the right
        x = torch.relu(self.bn3(self.c4(x)))
        v = self.tanh(self.l2(self.leaky(self.l1(x.mean((2, 3))))))
        v = self.bn1d(self.l3(v))
        return v, self.bnt(self.ct(F.relu(self.c1d(z))))


@pytest.mark.parametrize("name", sorted(AO_GETTERS))
def test_fuse_fx_with_our_config_fuses_like_torch_ao(name: str) -> None:
    from torch.ao.quantization.quantize_fx import fuse_fx as ao_fuse_fx

    torch.manual_seed(0)
    model = _FusionZoo()
    for bn in model.modules():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            _bn_stats(bn)
    model.eval()
    theirs = ao_fuse_fx(copy.deepcopy(model), backend_config=AO_GETTERS[name]())
    ours = fxq.fuse_fx(copy.deepcopy(model), backend_config=OUR_GETTERS[name]())
    want = [(n, to_ours(type(m))) for n, m in theirs.named_children()]
    got = [(n, type(m)) for n, m in ours.named_children()]
    assert got == want
    x, z = torch.randn(2, 3, 5, 5), torch.randn(2, 2, 9)
    with torch.no_grad():
        for a, b in zip(ours(x, z), theirs(x, z), strict=True):
            assert torch.equal(a, b)
    if name == "onednn":  # the conv-add fusions did happen
        assert {type(m) for m in ours.children()} >= {
            qnn.intrinsic.ConvAdd2d,
            qnn.intrinsic.ConvAddReLU2d,
            qnn.intrinsic.LinearLeakyReLU,
            qnn.intrinsic.LinearTanh,
        }
