"""What a lowered module accepts from ``load_state_dict``.

A lowered module's buffers feed numba kernels that trust them: a weight cast from int32
wraps around, a subnormal scale saturates every output. So each entry of a state dict must
have exactly the dtype and shape of the buffer it replaces (the module's own buffers are the
expectation: genuine state dicts of the same float model always match) and a value the
kernels accept. Nothing is cast.
"""

from __future__ import annotations

import torch

from quantbridge.lowering._errors import LoweringError

__all__ = ["check_state_entry"]

# Scales must be normal float32 numbers: the kernels compute in float32, where a subnormal
# or zero scale turns every requantized value into a saturated one.
_SCALE_MIN = float(torch.finfo(torch.float32).tiny)
_SCALE_MAX = float(torch.finfo(torch.float32).max)

# Value rules by buffer name (lowered activations are uint8, weights int8).
_SCALES = frozenset(
    {
        "scale", "input_scale", "input2_scale", "input3_scale", "add_scale", "weight_scale",
        "row_scale", "activation_scale",
    }
)  # fmt: skip
_ZERO_POINT_RANGES = {
    "zero_point": (0, 255),
    "input_zero_point": (0, 255),
    "input2_zero_point": (0, 255),
    "input3_zero_point": (0, 255),
    "add_zero_point": (0, 255),
    "activation_zero_point": (0, 255),
    "weight_zero_point": (-128, 127),
}
_FINITE = frozenset({"bias", "row_bias"})

_HOW_TO_FIX = (
    "load a state dict saved from a lowered model of the same float model and backend, "
    "unconverted (torch.save(model.state_dict()) / torch.load(..., weights_only=True))"
)


def _first_bad(bad: torch.Tensor, value: torch.Tensor) -> str:
    """``value[i] = v`` for the first element flagged in ``bad`` (or ``v`` for a scalar)."""
    flat = bad.reshape(-1).nonzero()
    index = int(flat[0, 0])
    item = value.reshape(-1)[index].item()
    count = int(bad.sum())
    where = f"[{index}]" if value.dim() > 0 else ""
    more = f" ({count} bad values)" if count > 1 else ""
    return f"value{where} = {item!r}{more}"


def check_state_entry(key: str, name: str, value: object, current: torch.Tensor) -> None:
    """Raise :class:`LoweringError` unless ``value`` may replace buffer ``name`` (``current``).

    ``key`` is the full state-dict key, named in the error.
    """
    if not isinstance(value, torch.Tensor):
        raise LoweringError(
            f"load_state_dict: '{key}': expected a tensor, found {type(value).__name__}; "
            f"{_HOW_TO_FIX}"
        )
    expected = f"a {current.dtype} tensor of shape {tuple(current.shape)}"
    if value.dtype != current.dtype or value.shape != current.shape:
        raise LoweringError(
            f"load_state_dict: '{key}': expected {expected}, found {value.dtype} of shape "
            f"{tuple(value.shape)}; values are never cast on load: {_HOW_TO_FIX}"
        )
    if value.device.type == "meta":
        raise LoweringError(f"load_state_dict: '{key}': expected {expected}, found a meta tensor")
    if name in _SCALES:
        v = value.detach().to(torch.float64)
        bad = ~(torch.isfinite(v) & (v >= _SCALE_MIN) & (v <= _SCALE_MAX))
        if bool(bad.any()):
            raise LoweringError(
                f"load_state_dict: '{key}': expected scales that are finite, positive and "
                f"normal in float32 (between {_SCALE_MIN:.6g} and {_SCALE_MAX:.6g}), found "
                f"{_first_bad(bad, v)}; {_HOW_TO_FIX}"
            )
    elif name in _ZERO_POINT_RANGES:
        low, high = _ZERO_POINT_RANGES[name]
        bad = (value < low) | (value > high)
        if bool(bad.any()):
            raise LoweringError(
                f"load_state_dict: '{key}': expected zero points in [{low}, {high}], found "
                f"{_first_bad(bad, value)}; {_HOW_TO_FIX}"
            )
    elif name in _FINITE:
        bad = ~torch.isfinite(value)
        if bool(bad.any()):
            raise LoweringError(
                f"load_state_dict: '{key}': expected finite values, found "
                f"{_first_bad(bad, value)}; {_HOW_TO_FIX}"
            )
