"""Observer base classes: the module interface and the uniform (scale, zero point) base."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quantbridge.qconfig._dtypes import QScheme, canonical_dtype, canonical_qscheme
from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._factory import PartialWrapper, with_args, with_callable_args
from quantbridge.qconfig._qparams import QuantRange, compute_qparams, resolve_quant_range

_FLOAT32_EPS = float(torch.finfo(torch.float32).eps)


def buffer_kwargs(factory_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``device``/``dtype`` keywords for buffer creation (torch.nn.factory_kwargs, typed)."""
    result: dict[str, Any] = torch.nn.factory_kwargs(factory_kwargs)  # type: ignore[no-untyped-call]
    return result


def reject_unknown_kwargs(where: str, kwargs: dict[str, Any]) -> None:
    """Observers keep torch.ao's ``**kwargs`` slot but, like torch.ao, accept nothing in it."""
    if kwargs:
        raise QConfigError(
            f"{where}: unexpected argument(s) {sorted(kwargs)}; check the spelling against "
            "the constructor's signature"
        )


def check_flag(value: object, name: str, where: str) -> bool:
    """``value`` if it is a bool (``reduce_range="no"`` would otherwise count as True)."""
    if not isinstance(value, bool):
        raise QConfigError(f"{where}: {name} must be True or False, got {value!r}")
    return value


def check_eps(value: object, where: str) -> float:
    """A positive, finite smallest scale (an infinite eps makes every scale infinite)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise QConfigError(f"{where}: eps must be a positive finite float, got {value!r}")
    return float(value)


def check_averaging_constant(value: object, where: str) -> float:
    """A moving-average weight in (0, 1]: 0 would freeze the first range forever, NaN or a
    value outside the interval turns min/max into NaN or makes them diverge."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and 0 < value <= 1)
    ):
        raise QConfigError(
            f"{where}: averaging_constant must be a number in (0, 1] (the weight of each new "
            f"batch; 1 keeps only the latest), got {value!r}"
        )
    return value


def moving_average(
    current: torch.Tensor, observed: torch.Tensor, averaging_constant: float
) -> torch.Tensor:
    """One exponential moving-average step: ``current + c * (observed - current)``."""
    return current + averaging_constant * (observed - current)


def resize_for_state_dict(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, names: tuple[str, ...]
) -> None:
    """Resize ``module``'s buffers ``names`` to the shapes ``state_dict`` holds for them.

    Buffers whose shape depends on what was observed (per-channel ``[C]``) start out with
    another shape; resizing first lets ``load_state_dict`` copy the values in.
    """
    for name in names:
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor):
            getattr(module, name).resize_(value.shape)


class ObserverBase(nn.Module, metaclass=abc.ABCMeta):
    """An observer: ``forward`` records statistics and returns its input unchanged;
    ``calculate_qparams`` turns the statistics into quantization parameters.

    ``dtype`` is stored canonical (``torch.quint8`` becomes ``torch.uint8``).
    """

    dtype: torch.dtype
    is_dynamic: bool

    def __init__(self, dtype: object, is_dynamic: bool = False) -> None:
        super().__init__()
        self.dtype = canonical_dtype(dtype, where=f"{type(self).__name__}: dtype")
        self.is_dynamic = bool(is_dynamic)

    @abc.abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Record statistics of ``x``; return ``x``."""

    @abc.abstractmethod
    def calculate_qparams(self) -> Any:
        """The quantization parameters for what was observed."""

    @classmethod
    def with_args(cls, **kwargs: Any) -> PartialWrapper:
        """A factory building this observer with ``kwargs`` (``functools.partial``-like)."""
        return with_args(cls, **kwargs)

    @classmethod
    def with_callable_args(cls, **kwargs: Callable[[], Any]) -> PartialWrapper:
        """A factory whose ``kwargs`` are computed by calling each value at build time."""
        return with_callable_args(cls, **kwargs)


class UniformQuantizationObserverBase(ObserverBase):
    """Base of the observers that compute affine or symmetric (scale, zero point).

    Arguments are torch.ao 2.13's: ``dtype`` (uint8/int8/uint16/int16/int32 or the
    torch.ao aliases), ``qscheme`` (a :class:`QScheme`, its name or a torch qscheme object),
    ``reduce_range`` (drop one bit of an 8-bit range), ``quant_min``/``quant_max`` (a custom
    range; both or neither), ``factory_kwargs`` (device/dtype of the buffers), ``eps`` (the
    smallest scale), ``is_dynamic``.
    """

    # Serialization version of the buffers, as torch.ao's: 2 added the eps buffer, 3 gave
    # the per-channel buffers their current names and the histogram its 0-dim min/max.
    _version = 3

    eps: torch.Tensor
    qscheme: QScheme
    quant_min: int
    quant_max: int
    reduce_range: bool
    has_customized_qrange: bool

    def __init__(
        self,
        dtype: object = torch.uint8,
        qscheme: object = QScheme.PER_TENSOR_AFFINE,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = _FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        where = type(self).__name__
        reject_unknown_kwargs(where, kwargs)
        super().__init__(dtype=dtype, is_dynamic=check_flag(is_dynamic, "is_dynamic", where))
        self.qscheme = canonical_qscheme(qscheme, where=f"{where}: qscheme")
        self.reduce_range = check_flag(reduce_range, "reduce_range", where)
        self._qrange: QuantRange = resolve_quant_range(
            dtype, quant_min, quant_max, self.reduce_range, where
        )
        self.has_customized_qrange = self._qrange.has_customized_qrange
        self.quant_min = self._qrange.quant_min
        self.quant_max = self._qrange.quant_max
        eps = check_eps(eps, where)
        self.register_buffer("eps", torch.tensor([eps], **buffer_kwargs(factory_kwargs)))

    def _check_qscheme(self, per_channel: bool, per_group: bool = False) -> None:
        def kind(q: QScheme) -> tuple[bool, bool]:
            return q.is_per_channel, q.is_per_group

        if kind(self.qscheme) != (per_channel, per_group):
            allowed = [q.value for q in QScheme if kind(q) == (per_channel, per_group)]
            raise QConfigError(
                f"{type(self).__name__}: qscheme {self.qscheme.value} is not supported; "
                f"use one of {allowed}"
            )

    def _init_per_tensor_range(self, factory_kwargs: dict[str, Any] | None) -> None:
        """Check the arguments of a per-tensor observer and register its running range:
        0-dim ``min_val``/``max_val``, ``inf``/``-inf`` until something is observed."""
        self._check_qscheme(per_channel=False)
        self._check_symmetric_reduce_range()
        fk = buffer_kwargs(factory_kwargs)
        self.register_buffer("min_val", torch.tensor(float("inf"), **fk))
        self.register_buffer("max_val", torch.tensor(float("-inf"), **fk))

    def _check_symmetric_reduce_range(self) -> None:
        # The symmetric uint8 zero point is 128, outside the reduced range [0, 127].
        if self.qscheme.is_symmetric and self.reduce_range and self.dtype == torch.uint8:
            raise QConfigError(
                f"{type(self).__name__}: reduce_range=True is not supported for symmetric "
                "uint8 (quint8) quantization; use int8 or reduce_range=False"
            )

    def _calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return compute_qparams(
            min_val, max_val, self._qrange, self.qscheme, self.eps, type(self).__name__
        )

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # args: local_metadata, strict, missing_keys, unexpected_keys, error_msgs (nn.Module's)
        local_metadata: dict[str, Any] = args[0]
        version = local_metadata.get("version")
        if version is None or version == 1:
            # Version 1 state_dicts predate the eps buffer: use the default eps.
            state_dict[prefix + "eps"] = torch.tensor([_FLOAT32_EPS])
        super()._load_from_state_dict(state_dict, prefix, *args)

    def reset_min_max_vals(self) -> None:
        raise QConfigError(f"{type(self).__name__} has no min/max values to reset")
