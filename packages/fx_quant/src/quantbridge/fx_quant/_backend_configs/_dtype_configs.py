"""The DTypeConfigs the built-in backends are made of, with canonical dtypes.

torch.ao writes these with ``torch.quint8``/``torch.qint8``/``torch.quint4x2``; here they are
``torch.uint8``/``torch.int8``, and the 4-bit weight is ``torch.uint8`` limited to [0, 15]
(what ``DTypeWithConstraints`` records for the ``quint4x2`` alias). Each function returns a new
object, so a caller that edits one backend's config does not change another's.
"""

from __future__ import annotations

import torch

from quantbridge.qconfig import DTypeConfig, DTypeWithConstraints

# The smallest scale QNNPACK's int8 kernels accept.
QNNPACK_SCALE_MIN = 2**-12


def weighted_op_quint8() -> DTypeConfig:
    """uint8 activations, int8 weight, float bias: static linear/conv on fbgemm-style kernels."""
    return DTypeConfig(
        input_dtype=torch.uint8,
        output_dtype=torch.uint8,
        weight_dtype=torch.int8,
        bias_dtype=torch.float32,
    )


def default_op_quint8() -> DTypeConfig:
    """uint8 in and out, no weight: elementwise, pooling, shape ops."""
    return DTypeConfig(input_dtype=torch.uint8, output_dtype=torch.uint8)


def default_op_fp16() -> DTypeConfig:
    """float16 everywhere (torch.ao's legacy test-only native config)."""
    return DTypeConfig(
        input_dtype=torch.float16,
        output_dtype=torch.float16,
        weight_dtype=torch.float16,
        bias_dtype=torch.float16,
    )


def dynamic_int8() -> DTypeConfig:
    """Dynamic quantization: uint8 activations quantized at run time, int8 weight, float out."""
    return DTypeConfig(
        input_dtype=torch.uint8,
        output_dtype=torch.float32,
        weight_dtype=torch.int8,
        bias_dtype=torch.float32,
        is_dynamic=True,
    )


def dynamic_float16() -> DTypeConfig:
    """Dynamic float16: float16 activations and weight, float out."""
    return DTypeConfig(
        input_dtype=torch.float16,
        output_dtype=torch.float32,
        weight_dtype=torch.float16,
        bias_dtype=torch.float32,
        is_dynamic=True,
    )


def input_output_only_quint8() -> DTypeConfig:
    """uint8 activations with a float weight and bias (layer norm's kernel)."""
    return DTypeConfig(
        input_dtype=torch.uint8,
        output_dtype=torch.uint8,
        weight_dtype=torch.float32,
        bias_dtype=torch.float32,
    )


def weight_only_quint8() -> DTypeConfig:
    """Float activations, uint8 weight (embeddings)."""
    return DTypeConfig(
        input_dtype=torch.float32, output_dtype=torch.float32, weight_dtype=torch.uint8
    )


def weight_only_quint4x2() -> DTypeConfig:
    """Float activations, 4-bit unsigned weight (torch.ao's ``quint4x2``) for embeddings."""
    return DTypeConfig(
        input_dtype=torch.float32,
        output_dtype=torch.float32,
        weight_dtype=DTypeWithConstraints(
            dtype=torch.uint8, quant_min_lower_bound=0, quant_max_upper_bound=15
        ),
    )


def weight_only_qint8() -> DTypeConfig:
    """Float activations, int8 weight (onednn's embeddings)."""
    return DTypeConfig(
        input_dtype=torch.float32, output_dtype=torch.float32, weight_dtype=torch.int8
    )


def qnnpack_act_qint8() -> DTypeWithConstraints:
    """int8 activation with QNNPACK's minimum scale."""
    return DTypeWithConstraints(dtype=torch.int8, scale_min_lower_bound=QNNPACK_SCALE_MIN)


def qnnpack_weight_qint8_symmetric() -> DTypeWithConstraints:
    """int8 weight restricted to [-127, 127] with QNNPACK's minimum scale."""
    return DTypeWithConstraints(
        dtype=torch.int8,
        quant_min_lower_bound=-127,
        quant_max_upper_bound=127,
        scale_min_lower_bound=QNNPACK_SCALE_MIN,
    )


def weighted_op_qint8_symmetric() -> DTypeConfig:
    """QNNPACK's symmetric int8 weighted op (XNNPACK-compatible)."""
    return DTypeConfig(
        input_dtype=qnnpack_act_qint8(),
        output_dtype=qnnpack_act_qint8(),
        weight_dtype=qnnpack_weight_qint8_symmetric(),
        bias_dtype=torch.float32,
    )


def default_op_qint8_symmetric() -> DTypeConfig:
    """QNNPACK's int8 activations for ops without a weight."""
    return DTypeConfig(input_dtype=qnnpack_act_qint8(), output_dtype=qnnpack_act_qint8())


def dynamic_qint8_symmetric() -> DTypeConfig:
    """Dynamic int8 with QNNPACK's constraints (executorch)."""
    return DTypeConfig(
        input_dtype=qnnpack_act_qint8(),
        output_dtype=torch.float32,
        weight_dtype=qnnpack_weight_qint8_symmetric(),
        bias_dtype=torch.float32,
        is_dynamic=True,
    )


def weighted_op_qint8() -> DTypeConfig:
    """int8 activations and weight, float bias (TensorRT)."""
    return DTypeConfig(
        input_dtype=torch.int8,
        output_dtype=torch.int8,
        weight_dtype=torch.int8,
        bias_dtype=torch.float32,
    )


def default_op_qint8() -> DTypeConfig:
    """int8 in and out, no weight (TensorRT)."""
    return DTypeConfig(input_dtype=torch.int8, output_dtype=torch.int8)
