"""The ready-made observer and fake-quantize factories torch.ao 2.13 exports, same arguments.

Dtypes are spelled canonically (``torch.uint8`` for ``torch.quint8``, ``torch.int8`` for
``torch.qint8``); the 4-bit ones use the ``"quint4x2"`` alias resolved by name, because the
4-bit range (0..15) is not implied by a plain uint8.
"""

from __future__ import annotations

import torch

from quantbridge.qconfig._dtypes import QScheme
from quantbridge.qconfig._fake_quantize import (
    FakeQuantize,
    FixedQParamsFakeQuantize,
    FusedMovingAvgObsFakeQuantize,
)
from quantbridge.qconfig._histogram import HistogramObserver
from quantbridge.qconfig._minmax import MinMaxObserver, MovingAverageMinMaxObserver
from quantbridge.qconfig._passthrough import (
    FixedQParamsObserver,
    NoopObserver,
    PlaceholderObserver,
    RecordingObserver,
    ReuseInputObserver,
)
from quantbridge.qconfig._per_channel import (
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)

# torch.quint4x2, by name: src never spells torch's quantized dtypes as attributes.
_QUINT4X2: object = getattr(torch, "quint4x2", "quint4x2")

# -- observers ------------------------------------------------------------------------------

#: Static activations (debugging): MinMax over uint8 [0, 127].
default_observer = MinMaxObserver.with_args(quant_min=0, quant_max=127)
#: Float16 / pass-through configs.
default_placeholder_observer = PlaceholderObserver
#: Records every tensor it sees.
default_debug_observer = RecordingObserver
#: Per-tensor symmetric int8 weights.
default_weight_observer = MinMaxObserver.with_args(
    dtype=torch.int8, qscheme=QScheme.PER_TENSOR_SYMMETRIC
)
#: Symmetric int8 weights restricted to [-127, 127].
weight_observer_range_neg_127_to_127 = MinMaxObserver.with_args(
    dtype=torch.int8,
    qscheme=QScheme.PER_TENSOR_SYMMETRIC,
    quant_min=-127,
    quant_max=127,
    eps=2**-12,
)
#: Histogram activations over uint8 [0, 127].
default_histogram_observer = HistogramObserver.with_args(quant_min=0, quant_max=127)
#: Per-channel symmetric int8 weights.
default_per_channel_weight_observer = PerChannelMinMaxObserver.with_args(
    dtype=torch.int8, qscheme=QScheme.PER_CHANNEL_SYMMETRIC
)
#: Per-channel symmetric int8 weights restricted to [-127, 127].
per_channel_weight_observer_range_neg_127_to_127 = PerChannelMinMaxObserver.with_args(
    dtype=torch.int8,
    qscheme=QScheme.PER_CHANNEL_SYMMETRIC,
    quant_min=-127,
    quant_max=127,
    eps=2**-12,
)
#: Dynamic quantization of activations (range chosen at run time).
default_dynamic_quant_observer = PlaceholderObserver.with_args(
    dtype=torch.uint8, quant_min=0, quant_max=255, is_dynamic=True
)
#: Embedding weights with float zero points (uint8).
default_float_qparams_observer = PerChannelMinMaxObserver.with_args(
    dtype=torch.uint8, qscheme=QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS, ch_axis=0
)
#: Embedding weights with float zero points (4-bit).
default_float_qparams_observer_4bit = PerChannelMinMaxObserver.with_args(
    dtype=_QUINT4X2, qscheme=QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS, ch_axis=0
)
#: Output of tanh-like ops: [-1, 1] on uint8.
default_fixed_qparams_range_neg1to1_observer = FixedQParamsObserver.with_args(
    scale=2.0 / 256.0, zero_point=128, dtype=torch.uint8, quant_min=0, quant_max=255
)
#: Output of sigmoid-like ops: [0, 1] on uint8.
default_fixed_qparams_range_0to1_observer = FixedQParamsObserver.with_args(
    scale=1.0 / 256.0, zero_point=0, dtype=torch.uint8, quant_min=0, quant_max=255
)
default_symmetric_fixed_qparams_observer = default_fixed_qparams_range_neg1to1_observer
default_affine_fixed_qparams_observer = default_fixed_qparams_range_0to1_observer
#: Ops like reshape that reuse their input's observer.
default_reuse_input_observer = ReuseInputObserver
#: Float16 placeholders (static and dynamic).
default_float16_placeholder_observer = PlaceholderObserver.with_args(dtype=torch.float16)
default_float16_dynamic_placeholder_observer = PlaceholderObserver.with_args(
    dtype=torch.float16, is_dynamic=True
)
default_noop_observer = NoopObserver

# -- fake quantize --------------------------------------------------------------------------

default_fake_quant = FakeQuantize.with_args(
    observer=MovingAverageMinMaxObserver,
    quant_min=0,
    quant_max=255,
    dtype=torch.uint8,
    qscheme=QScheme.PER_TENSOR_AFFINE,
    reduce_range=True,
)
default_weight_fake_quant = FakeQuantize.with_args(
    observer=MovingAverageMinMaxObserver,
    quant_min=-128,
    quant_max=127,
    dtype=torch.int8,
    qscheme=QScheme.PER_TENSOR_SYMMETRIC,
    reduce_range=False,
)
default_dynamic_fake_quant = FakeQuantize.with_args(
    observer=MovingAverageMinMaxObserver,
    quant_min=0,
    quant_max=255,
    is_dynamic=True,
    dtype=torch.uint8,
    averaging_constant=1,
)
default_fixed_qparams_range_neg1to1_fake_quant = FixedQParamsFakeQuantize.with_args(
    observer=default_fixed_qparams_range_neg1to1_observer
)
default_fixed_qparams_range_0to1_fake_quant = FixedQParamsFakeQuantize.with_args(
    observer=default_fixed_qparams_range_0to1_observer
)
default_symmetric_fixed_qparams_fake_quant = default_fixed_qparams_range_neg1to1_fake_quant
default_affine_fixed_qparams_fake_quant = default_fixed_qparams_range_0to1_fake_quant
default_per_channel_weight_fake_quant = FakeQuantize.with_args(
    observer=MovingAveragePerChannelMinMaxObserver,
    quant_min=-128,
    quant_max=127,
    dtype=torch.int8,
    qscheme=QScheme.PER_CHANNEL_SYMMETRIC,
    reduce_range=False,
    ch_axis=0,
)
default_embedding_fake_quant = FakeQuantize.with_args(
    observer=MovingAveragePerChannelMinMaxObserver,
    qscheme=QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS,
    dtype=torch.uint8,
    quant_min=0,
    quant_max=255,
    ch_axis=0,
    averaging_constant=1,
)
default_embedding_fake_quant_4bit = FakeQuantize.with_args(
    observer=MovingAveragePerChannelMinMaxObserver,
    qscheme=QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS,
    ch_axis=0,
    dtype=_QUINT4X2,
    averaging_constant=1,
)
default_histogram_fake_quant = FakeQuantize.with_args(
    observer=HistogramObserver,
    quant_min=0,
    quant_max=255,
    dtype=torch.uint8,
    qscheme=QScheme.PER_TENSOR_AFFINE,
    reduce_range=True,
)
default_fused_act_fake_quant = FusedMovingAvgObsFakeQuantize.with_args(
    observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.uint8
)
default_fused_wt_fake_quant = FusedMovingAvgObsFakeQuantize.with_args(
    observer=MovingAverageMinMaxObserver,
    quant_min=-128,
    quant_max=127,
    dtype=torch.int8,
    qscheme=QScheme.PER_TENSOR_SYMMETRIC,
)
default_fused_per_channel_wt_fake_quant = FusedMovingAvgObsFakeQuantize.with_args(
    observer=MovingAveragePerChannelMinMaxObserver,
    quant_min=-128,
    quant_max=127,
    dtype=torch.int8,
    qscheme=QScheme.PER_CHANNEL_SYMMETRIC,
)
fused_wt_fake_quant_range_neg_127_to_127 = FusedMovingAvgObsFakeQuantize.with_args(
    observer=MovingAverageMinMaxObserver,
    quant_min=-127,
    quant_max=127,
    dtype=torch.int8,
    qscheme=QScheme.PER_TENSOR_SYMMETRIC,
    eps=2**-12,
)
fused_per_channel_wt_fake_quant_range_neg_127_to_127 = FusedMovingAvgObsFakeQuantize.with_args(
    observer=MovingAveragePerChannelMinMaxObserver,
    quant_min=-127,
    quant_max=127,
    dtype=torch.int8,
    qscheme=QScheme.PER_CHANNEL_SYMMETRIC,
    eps=2**-12,
)
