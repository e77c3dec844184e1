"""torchvision-style CNNs (tests/real_models.py) through the whole flow with the numba backend.

Each model is prepared, calibrated and converted with ``get_backend("numba")``; the reference
model must equal the one torch.ao 2.13 builds with the equivalent qconfig mapping and backend
config (same quantized nodes, same reference modules, bit-identical outputs), and the lowered
model must stay within one quantization step of the reference model (the lowering tests'
teacher-forced per-op check and their end-to-end bound).
"""

from __future__ import annotations

import copy
import functools
import importlib
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

# helpers, under --import-mode=importlib: the zoo, and the lowering tests' numerics checks
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
if str(Path(__file__).parents[1] / "packages/lowering/tests") not in sys.path:
    sys.path.insert(0, str(Path(__file__).parents[1] / "packages/lowering/tests"))
import real_models as zoo
from test_lowering_numerics import _coarsest_step, _output_steps, _Recorder, _TeacherForced

import quantbridge.fx_quant as fq
from quantbridge.lowering import get_backend, lowering_report

_Q = torch.ops.quantbridge.quantize_per_tensor.tensor
_QC = torch.ops.quantbridge.quantize_per_channel.default
CALIBRATION = [zoo.example_input(seed) for seed in range(1, 4)]


@functools.cache
def _prepared(name: str) -> GraphModule:
    """The calibrated prepared model, with the numba backend's mapping and config."""
    backend = get_backend("numba")
    prepared = fq.prepare_fx(
        zoo.build(name),
        backend.qconfig_mapping(),
        (zoo.example_input(0),),
        backend_config=backend.backend_config,
    )
    fq.calibrate(prepared, CALIBRATION, progress=False)
    return prepared


@functools.cache
def _reference(name: str) -> GraphModule:
    """The reference model (shared by the tests, which copy it before changing it)."""
    prepared = _prepared(name)
    backend = get_backend("numba")
    return fq.convert_to_reference_fx(
        copy.deepcopy(prepared), backend_config=backend.backend_config
    )


def _leaf_names(pattern: Any) -> tuple[str, ...]:
    if isinstance(pattern, tuple):
        return tuple(n for p in pattern for n in _leaf_names(p))
    return (pattern if isinstance(pattern, str) else getattr(pattern, "__name__", str(pattern)),)


def _ao_class(cls: type) -> type:
    """torch.ao's class of the same name as fx_quant's QAT / intrinsic ``cls``."""
    if cls.__module__.startswith("torch."):
        return cls
    package = cls.__module__.replace("quantbridge.fx_quant.nn", "torch.ao.nn").rsplit("._", 1)[0]
    ao_cls: type = getattr(importlib.import_module(package), cls.__name__)
    return ao_cls


def _ao_equivalents() -> tuple[Any, Any, Any]:
    """torch.ao's (quantize_fx, qconfig mapping, backend config) equal to the numba backend's.

    The numba BackendConfig is the native one restricted to the patterns its kernels run and
    to non-float16 dtypes, plus clamps observed with the Linear / conv before them; its mapping
    is x86's with reduce_range=False activations (and the backend's weight range).
    """
    pytest.importorskip("torch.ao.quantization")
    importlib.import_module("torch.ao.quantization.backend_config.utils")  # torch 2.13 quirk
    ao = importlib.import_module("torch.ao.quantization")
    ao_fx = importlib.import_module("torch.ao.quantization.quantize_fx")
    ao_bc = importlib.import_module("torch.ao.quantization.backend_config")
    ours = get_backend("numba").backend_config
    kept = {
        _leaf_names(c.pattern if c.pattern is not None else c._pattern_complex_format)
        for c in ours.configs
    }
    config = ao_bc.BackendConfig("numba_equivalent")
    native = set()
    static_dtypes = {}
    for cfg in ao_bc.get_native_backend_config().configs:
        pattern = cfg.pattern if cfg.pattern is not None else cfg._pattern_complex_format
        dtypes = [
            d for d in cfg.dtype_configs if torch.float16 not in (d.input_dtype, d.weight_dtype)
        ]
        native.add(_leaf_names(pattern))
        static_dtypes[pattern] = [d for d in dtypes if d.output_dtype is torch.quint8]
        if _leaf_names(pattern) in kept and dtypes:
            cfg.set_dtype_configs(dtypes)
            config.set_backend_pattern_config(cfg)
    # numba's own entries, not in torch.ao's native config: a clamp observed with the Linear /
    # conv before it, given to torch.ao as the same pattern
    extra = [c for c in ours.configs if _leaf_names(c.pattern) not in native]
    assert {c.pattern[1] for c in extra} == {nn.ReLU6, nn.Hardtanh, F.relu6, F.hardtanh}
    for cfg in extra:
        root = _ao_class(cfg.pattern[0])
        config.set_backend_pattern_config(
            ao_bc.BackendPatternConfig((root, cfg.pattern[1]))
            .set_observation_type(ao_bc.ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
            .set_dtype_configs(static_dtypes[root])
        )
    assert len(config.configs) == len(ours.configs)
    # the backend's qconfig: on the avx2 target torch.ao's x86 one (7-bit activations,
    # reduce_range), elsewhere full-range activations; 8-bit weights (7 if asked)
    ours_qconfig = get_backend("numba").qconfig_mapping().global_qconfig
    weight = ours_qconfig.weight()
    qconfig = ao.QConfig(
        activation=ao.HistogramObserver.with_args(
            reduce_range=ours_qconfig.activation().reduce_range
        ),
        weight=ao.PerChannelMinMaxObserver.with_args(
            dtype=torch.qint8,
            qscheme=torch.per_channel_symmetric,
            quant_min=weight.quant_min,
            quant_max=weight.quant_max,
        ),
    )
    mapping = ao.get_default_qconfig_mapping("x86").set_global(qconfig)
    # fixed-qparams ops (sigmoid, hardsigmoid, ...) keep their own observers
    for key in list(mapping.object_type_qconfigs):
        if key not in ao.qconfig_mapping._FIXED_QPARAMS_OP_TO_OBSERVER:
            mapping.set_object_type(key, qconfig)
    return ao_fx, mapping, config


@functools.cache
def _theirs(name: str) -> GraphModule:
    ao_fx, mapping, config = _ao_equivalents()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = ao_fx.prepare_fx(
            zoo.build(name), mapping, (zoo.example_input(0),), backend_config=config
        )
        with torch.no_grad():
            for x in CALIBRATION:
                prepared(x)
        return ao_fx.convert_to_reference_fx(prepared, backend_config=config)


def _quantized_inputs(gm: GraphModule, targets: tuple[Any, ...]) -> list[str]:
    return sorted(n.args[0].name for n in gm.graph.nodes if n.target in targets)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_reference_model_matches_torch_ao(name: str) -> None:
    ours = _reference(name)
    theirs = _theirs(name)
    kinds_ours = {n: type(m).__name__ for n, m in ours.named_modules() if n}
    kinds_theirs = {n: type(m).__name__ for n, m in theirs.named_modules() if n}
    assert kinds_ours == kinds_theirs
    quantized = _quantized_inputs(ours, (_Q, _QC))
    assert quantized == _quantized_inputs(
        theirs, (torch.quantize_per_tensor, torch.quantize_per_channel)
    )
    assert len(quantized) > 10
    for seed in (7, 8):
        x = zoo.example_input(seed)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecated quantized tensors
            torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_lowered_within_one_step_of_reference(name: str) -> None:
    reference = _reference(name)
    lowered = get_backend("numba").lower(copy.deepcopy(reference))
    origins = lowering_report(lowered).origins
    assert origins
    (step,) = _output_steps(reference)
    assert step is not None  # the classifier's output is quantized
    coarsest = _coarsest_step(reference)
    for seed in (7, 8):
        x = zoo.example_input(seed)
        with torch.no_grad():
            rec = _Recorder(reference)
            want = rec.run(x)
            forced = _TeacherForced(lowered, rec.values, origins)
            forced_out = forced.run(x)
            got = lowered(x)
        # every lowered op within one code of the reference quantize it replaced
        assert forced.checked > 10
        assert not bool(((want - forced_out).abs() > step * (1 + 1e-5)).any())
        # end to end: bounded by the coarsest step in the model, as in the lowering tests
        diff = (want - got).abs()
        assert not bool((diff > coarsest * (1 + 1e-5)).any()), float(diff.max())


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_readme_recipe_and_reused_relu(name: str) -> None:
    """The Quickstart's three calls (docs/getting-started.md); every call of a block's shared
    ReLU is quantized."""
    model = zoo.build(name)
    backend = get_backend("numba")
    prepared = fq.prepare_fx(model, backend.qconfig_mapping(), (zoo.example_input(0),))
    fq.calibrate(prepared, CALIBRATION, progress=False)
    # the last ReLU call of a block follows the residual add, after fusion swallowed the first
    relu_calls = [
        n for n in prepared.graph.nodes if n.op == "call_module" and n.target == "layer4.1.relu"
    ]
    assert len(relu_calls) == 1
    assert isinstance(prepared.get_submodule("layer4.1.relu"), nn.ReLU)
    quantized = backend.convert(prepared)
    x = zoo.example_input(9)
    with torch.no_grad():
        out = quantized(x)
    assert out.shape == (2, 10)
    assert bool(torch.isfinite(out).all())
