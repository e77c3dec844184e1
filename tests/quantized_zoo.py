"""The test zoo quantized as the numba backend quantizes it, with fixed bits (not a target's
defaults), so every CPU builds the same reference models: the torchvision-style CNNs, the BERT
encoder with trained-like outlier channels, a torchvision-style ViT, and the lowering zoo's
cases.

Shared by the ONNX checks (``tests/test_onnx_zoo.py``, ``packages/lowering/bench/
check_onnx_zoo.py``) and the target matrix (``targets/zoo_outputs.py``).
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import GraphModule

if str(Path(__file__).parents[1] / "packages/lowering/tests") not in sys.path:
    sys.path.insert(0, str(Path(__file__).parents[1] / "packages/lowering/tests"))
import bert_zoo
import lowering_zoo
import real_models
from vit_model import VisionTransformer

import quantbridge.fx_quant as fq
from quantbridge.lowering import get_backend

BACKEND = get_backend("numba")

Inputs = tuple[torch.Tensor, ...]


def cnn_reference(name: str, activation_bits: int = 8) -> GraphModule:
    """``real_models`` CNN ``name``, calibrated on two images, as its reference model."""
    prepared = fq.prepare_fx(
        real_models.build(name),
        BACKEND.qconfig_mapping(weight_bits=8, activation_bits=activation_bits),
        (real_models.example_input(0),),
        backend_config=BACKEND.backend_config,
    )
    fq.calibrate(prepared, [real_models.example_input(s) for s in (1, 2)], progress=False)
    return fq.convert_to_reference_fx(prepared)


def bert_reference() -> tuple[GraphModule, Inputs]:
    """The BERT encoder with outlier channels (transformer mapping, 8 bits), and one batch."""
    torch.manual_seed(0)
    model = bert_zoo.BertEncoder().eval()
    bert_zoo.add_outliers(model)
    calibration = bert_zoo.token_batches(4)
    mapping = BACKEND.qconfig_mapping(transformer=True, weight_bits=8, activation_bits=8)
    prepared = fq.prepare_fx(model, mapping, calibration[0], backend_config=BACKEND.backend_config)
    fq.calibrate(prepared, calibration, progress=False)
    return fq.convert_to_reference_fx(prepared), bert_zoo.token_batches(1, seed=3)[0]


def vit_reference() -> tuple[GraphModule, Inputs]:
    """A small torchvision-style ViT (transformer mapping, 8 bits), and one batch."""
    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, layers=2, heads=4, dim=64, mlp_dim=128).eval()
    g = torch.Generator().manual_seed(1)
    calibration = [(torch.randn(2, 3, 32, 32, generator=g),) for _ in range(3)]
    mapping = BACKEND.qconfig_mapping(transformer=True, weight_bits=8, activation_bits=8)
    prepared = fq.prepare_fx(model, mapping, calibration[0], backend_config=BACKEND.backend_config)
    fq.calibrate(prepared, calibration, progress=False)
    return fq.convert_to_reference_fx(prepared), (torch.randn(2, 3, 32, 32, generator=g),)


def float_logits_reference() -> tuple[GraphModule, Inputs]:
    """The lowering zoo's MLP with its output left float (``set_output_float_indexes``), as a
    classifier's logits: its last Linear computes float32 from quantized inputs."""
    case = lowering_zoo.STATIC_CASES[0]
    torch.manual_seed(0)
    prepared = fq.prepare_fx(
        case.model().eval(),
        BACKEND.qconfig_mapping(weight_bits=8, activation_bits=8),
        case.inputs(0),
        backend_config=BACKEND.backend_config,
        prepare_custom_config=fq.PrepareCustomConfig().set_output_float_indexes([0]),
    )
    fq.calibrate(prepared, [case.inputs(100 + i) for i in range(4)], progress=False)
    return fq.convert_to_reference_fx(prepared), case.inputs(5)


def case_reference(case: lowering_zoo.Case) -> tuple[GraphModule, Inputs]:
    """A lowering zoo case's reference model (static cases at 8 bits), and its inputs."""
    mapping = lowering_zoo.qconfig_mapping_for(case, BACKEND)
    if case.mode == "static":
        mapping = BACKEND.qconfig_mapping(weight_bits=8, activation_bits=8)
    return lowering_zoo.reference_model(case, BACKEND, mapping=mapping), case.inputs(5)


@dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[], tuple[GraphModule, Inputs]]
    static: bool  # statically quantized: outputs compare in quantization steps


def zoo_models() -> list[ZooModel]:
    """Every model of the zoo, built on demand."""
    models = [
        ZooModel(
            name, lambda name=name: (cnn_reference(name), (real_models.example_input(9),)), True
        )
        for name in real_models.MODELS
    ]
    models.append(ZooModel("bert (outliers)", bert_reference, True))
    models.append(ZooModel("vit", vit_reference, True))
    models.append(ZooModel("mlp (float logits)", float_logits_reference, True))
    models += [
        ZooModel(case.name, lambda case=case: case_reference(case), case.mode == "static")
        for case in lowering_zoo.ALL_CASES
    ]
    return models


def runtime_tolerance_steps(reference: GraphModule) -> float:
    """How many of its coarsest steps another runtime's output may stand from ``reference``:
    one, and two where two activations are multiplied. A runtime's float convs sum in
    another order than torch's, so a value on a rounding tie may land one code away; a
    product of two activations scales that code by the other factor, up to one more step of
    its output."""
    mul = {operator.mul, torch.mul}
    dequantize = torch.ops.quantbridge.dequantize_per_tensor
    for node in reference.graph.nodes:
        if node.op == "call_function" and node.target in mul:
            args = [a for a in node.args if isinstance(a, torch.fx.Node)]
            if len(args) == 2 and all(
                getattr(a.target, "overloadpacket", None) is dequantize for a in args
            ):
                return 2.0
    return 1.0
