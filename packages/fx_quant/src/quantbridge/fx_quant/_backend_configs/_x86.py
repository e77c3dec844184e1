"""The x86 backend (torch.ao's x86 engine: fbgemm plus onednn kernels)."""

from __future__ import annotations

from quantbridge.fx_quant._backend_configs import _common as c
from quantbridge.fx_quant._backend_configs import _dtype_configs as d
from quantbridge.qconfig import BackendConfig


def get_x86_backend_config() -> BackendConfig:
    """The BackendConfig of the x86 backend: fbgemm's patterns, with binary ops and
    fixed-qparams ops accepting the weighted-op dtype config as torch.ao has it."""
    weighted = d.weighted_op_quint8()
    default_op = d.default_op_quint8()
    dynamic = [d.dynamic_int8(), d.dynamic_float16()]
    return (
        BackendConfig("x86")
        .set_backend_pattern_configs(c.conv_configs([weighted]))
        .set_backend_pattern_configs(c.linear_configs([weighted, *dynamic]))
        .set_backend_pattern_configs(c.binary_op_configs([weighted]))
        .set_backend_pattern_configs(c.cat_configs([default_op]))
        .set_backend_pattern_configs(c.default_op_configs([default_op]))
        .set_backend_pattern_configs(c.fixed_qparams_op_configs([weighted]))
        .set_backend_pattern_configs(c.share_qparams_op_configs([default_op]))
        .set_backend_pattern_configs(c.tensor_info_op_configs([default_op]))
        .set_backend_pattern_configs(c.bn_configs([default_op]))
        .set_backend_pattern_configs(c.rnn_configs(dynamic))
        .set_backend_pattern_configs(
            c.embedding_configs([d.weight_only_quint8(), d.weight_only_quint4x2()])
        )
    )
