"""The native backend (fbgemm and qnnpack together), torch.ao's default."""

from __future__ import annotations

from typing import Any

from quantbridge.fx_quant._backend_configs import _common as c
from quantbridge.fx_quant._backend_configs import _dtype_configs as d
from quantbridge.qconfig import BackendConfig, DTypeConfig


def native_family(
    name: str,
    *,
    fp16_ops: bool = False,
    layer_norm: bool = True,
    weighted_binary_and_fixed: bool = False,
) -> BackendConfig:
    """The native backend's patterns, which fbgemm and x86 share with small differences.

    ``fp16_ops`` adds float16 static ops (the legacy test config), ``layer_norm=False`` drops
    layer norm (fbgemm, x86), and ``weighted_binary_and_fixed`` gives binary and fixed-qparams
    ops the weighted-op dtype config instead of the default-op one (x86).
    """
    weighted = d.weighted_op_quint8()
    default_op = d.default_op_quint8()
    dynamic = [d.dynamic_int8(), d.dynamic_float16()]
    fp16: list[DTypeConfig] = [d.default_op_fp16()] if fp16_ops else []
    binary_fixed = weighted if weighted_binary_and_fixed else default_op
    config = (
        BackendConfig(name)
        .set_backend_pattern_configs(c.conv_configs([weighted]))
        .set_backend_pattern_configs(c.linear_configs([weighted, *dynamic, *fp16]))
        .set_backend_pattern_configs(c.binary_op_configs([binary_fixed, *fp16]))
        .set_backend_pattern_configs(c.cat_configs([default_op]))
        .set_backend_pattern_configs(c.default_op_configs([default_op]))
        .set_backend_pattern_configs(c.fixed_qparams_op_configs([binary_fixed, *fp16]))
        .set_backend_pattern_configs(c.share_qparams_op_configs([default_op, *fp16]))
        .set_backend_pattern_configs(c.tensor_info_op_configs([default_op]))
        .set_backend_pattern_configs(c.bn_configs([default_op]))
    )
    if layer_norm:
        config.set_backend_pattern_configs(c.layer_norm_configs([d.input_output_only_quint8()]))
    return config.set_backend_pattern_configs(c.rnn_configs(dynamic)).set_backend_pattern_configs(
        c.embedding_configs([d.weight_only_quint8(), d.weight_only_quint4x2()])
    )


def get_native_backend_config() -> BackendConfig:
    """The BackendConfig of PyTorch's native backend (what fbgemm and qnnpack both run):
    uint8 activations, int8 weights, dynamic int8/float16 linear and RNNs, 8/4-bit
    weight-only embeddings."""
    return native_family("native")


def get_native_backend_config_dict() -> dict[str, Any]:
    """:func:`get_native_backend_config` in dict form (``BackendConfig.to_dict()``)."""
    return get_native_backend_config().to_dict()


def get_test_only_legacy_native_backend_config() -> BackendConfig:
    """The native config plus float16 static ops (torch.ao keeps it for its own tests)."""
    return native_family("_native_and_fp16", fp16_ops=True)


def get_test_only_legacy_native_backend_config_dict() -> dict[str, Any]:
    """:func:`get_test_only_legacy_native_backend_config` in dict form."""
    return get_test_only_legacy_native_backend_config().to_dict()
