"""The QNNPACK backend (ARM and mobile CPUs), including XNNPACK-style symmetric int8."""

from __future__ import annotations

from quantbridge.fx_quant._backend_configs import _common as c
from quantbridge.fx_quant._backend_configs import _dtype_configs as d
from quantbridge.qconfig import BackendConfig


def get_qnnpack_backend_config() -> BackendConfig:
    """The BackendConfig of the QNNPACK backend: every family accepts symmetric int8
    (scale >= 2**-12, weight in [-127, 127]) before uint8; no layer norm, no shape ops."""
    symmetric_weighted = d.weighted_op_qint8_symmetric()
    symmetric_op = d.default_op_qint8_symmetric()
    weighted = d.weighted_op_quint8()
    default_op = d.default_op_quint8()
    dynamic = [d.dynamic_int8(), d.dynamic_float16()]
    ops = [symmetric_op, default_op]
    return (
        BackendConfig("qnnpack")
        .set_backend_pattern_configs(c.conv_configs([symmetric_weighted, weighted]))
        .set_backend_pattern_configs(c.linear_configs([symmetric_weighted, weighted, *dynamic]))
        .set_backend_pattern_configs(c.binary_op_configs(ops))
        .set_backend_pattern_configs(c.cat_configs(ops))
        .set_backend_pattern_configs(c.default_op_configs(ops))
        .set_backend_pattern_configs(c.fixed_qparams_op_configs(ops))
        .set_backend_pattern_configs(c.share_qparams_op_configs(ops))
        .set_backend_pattern_configs(c.bn_configs(ops))
        .set_backend_pattern_configs(c.rnn_configs(dynamic))
        .set_backend_pattern_configs(
            c.embedding_configs([d.weight_only_quint8(), d.weight_only_quint4x2()])
        )
    )
