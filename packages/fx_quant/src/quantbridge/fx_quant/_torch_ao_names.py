"""torch.ao.nn classes in configs: their quantbridge equivalents, found by name.

Code ported from torch.ao names ``torch.ao.nn.intrinsic.ConvReLU2d``,
``torch.ao.nn.quantized.reference.Linear``, ``torch.nn.qat.Linear`` ... inside BackendConfigs
and custom configs. quantbridge.fx_quant.nn mirrors torch.ao.nn's layout, so each such class
has an equivalent with the same name in the mirrored subpackage. They are recognised by their
``__module__``/``__qualname__`` strings (runtime code never imports torch.ao), replaced when
fx_quant consumes a config (qconfig, which holds BackendConfig, cannot know fx_quant's
modules), and refused with the class to use when there is no equivalent: torch.ao's quantized
modules (``torch.ao.nn.quantized.Linear``, ``.dynamic``) compute on quantized tensors, which
quantbridge does not have.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.qconfig import BackendConfig, BackendPatternConfig

__all__ = ["is_torch_ao", "port_backend_config", "port_class", "port_module"]

# torch.ao.nn subpackage (``__module__`` up to ``.modules``) -> quantbridge's mirror
_PACKAGES = {
    "torch.ao.nn.intrinsic": "quantbridge.fx_quant.nn.intrinsic",
    "torch.ao.nn.intrinsic.qat": "quantbridge.fx_quant.nn.intrinsic.qat",
    "torch.ao.nn.qat": "quantbridge.fx_quant.nn.qat",
    "torch.ao.nn.quantized.reference": "quantbridge.fx_quant.nn.reference",
    "torch.ao.nn.quantizable": "quantbridge.fx_quant.nn.quantizable",
}
_QUANTIZED_PACKAGES = (
    "torch.ao.nn.quantized",
    "torch.ao.nn.quantized.dynamic",
    "torch.ao.nn.intrinsic.quantized",
    "torch.ao.nn.intrinsic.quantized.dynamic",
)


def is_torch_ao(obj: object) -> bool:
    """Whether ``obj`` (a class or function) is defined in torch.ao."""
    return str(getattr(obj, "__module__", "") or "").startswith("torch.ao.")


def _name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _package(module: str) -> str:
    """``torch.ao.nn.intrinsic.qat.modules.conv_fused`` -> ``torch.ao.nn.intrinsic.qat``."""
    head, sep, _ = module.partition(".modules.")
    return head if sep else module


def _mirror(package: str, qualname: str) -> type | None:
    target = _PACKAGES.get(package)
    if target is None:
        return None
    found = getattr(importlib.import_module(target), qualname, None)
    return found if isinstance(found, type) else None


@functools.cache
def _equivalent(module: str, qualname: str) -> type | str:
    """The quantbridge class for a torch.ao class, or why there is none (text)."""
    package = _package(module)
    found = _mirror(package, qualname)
    if found is not None:
        return found
    if package in _QUANTIZED_PACKAGES:
        base = (
            qualname.removesuffix("ReLU")
            if package.startswith("torch.ao.nn.intrinsic")
            else qualname
        )
        ref = _mirror("torch.ao.nn.quantized.reference", base)
        use = (
            f"quantbridge.fx_quant.nn.reference.{ref.__qualname__} (a reference module; the "
            "lowering registered for the backend picks the fast kernel)"
            if ref is not None
            else "a module of your own that computes on float or plain integer tensors"
        )
        return (
            "it is a torch.ao quantized module, which computes on quantized tensors; "
            f"quantbridge has none. Use {use}"
        )
    mirror = _PACKAGES.get(package, "quantbridge.fx_quant.nn")
    return (
        f"{mirror} (quantbridge's mirror of {package}) has no {qualname}; use a "
        "quantbridge.fx_quant.nn class or a module of your own"
    )


def port_class(cls: Any, where: str) -> Any:
    """``cls`` itself unless it is a torch.ao class: then its quantbridge equivalent, or an
    ``FxQuantError`` naming ``where`` and what to use instead."""
    if not isinstance(cls, type) or not is_torch_ao(cls):
        return cls
    found = _equivalent(cls.__module__, cls.__qualname__)
    if isinstance(found, str):
        raise FxQuantError(f"{where}: {_name(cls)} cannot be used: {found}")
    return found


def port_module(module: Any, where: str) -> Any:
    """A module instance of a torch.ao fused class rebuilt as the quantbridge class from the
    same children (fused modules are sequential containers); other torch.ao instances refused."""
    if not isinstance(module, nn.Module) or not is_torch_ao(type(module)):
        return module
    cls = port_class(type(module), where)
    if isinstance(module, nn.Sequential) and issubclass(cls, nn.Sequential):
        ported: nn.Module = cls(*module.children())
        return ported.train(module.training)
    raise FxQuantError(
        f"{where}: returned a {_name(type(module))} instance; return "
        f"{_name(cls)} (quantbridge's equivalent) instead"
    )


def _port_pattern(pattern: Any, where: str) -> Any:
    if isinstance(pattern, tuple):
        return tuple(_port_pattern(p, where) for p in pattern)
    return port_class(pattern, where)


def _port_fuser(fuser: Callable[..., Any], where: str) -> Callable[..., Any]:
    """Fuser methods written for torch.ao (the tutorial's, torch.ao's own) build torch.ao
    fused modules: their results are rebuilt as quantbridge's."""

    @functools.wraps(fuser)
    def fuser_method(*args: Any, **kwargs: Any) -> Any:
        return port_module(fuser(*args, **kwargs), f"{where} fuser method {fuser!r}")

    return fuser_method


def _needs_port(config: BackendPatternConfig) -> bool:
    def any_ao(pattern: Any) -> bool:
        if isinstance(pattern, tuple):
            return any(any_ao(p) for p in pattern)
        return isinstance(pattern, type) and is_torch_ao(pattern)

    modules = (
        config.root_module,
        config.qat_module,
        config.reference_quantized_module,
        config.fused_module,
    )
    fuser = config.fuser_method
    foreign_fuser = fuser is not None and not str(
        getattr(fuser, "__module__", "") or ""
    ).startswith("quantbridge.")
    return (
        any_ao(config.pattern)
        or any_ao(config.pattern_complex_format)
        or foreign_fuser
        or any(map(is_torch_ao, modules))
    )


def _port_pattern_config(config: BackendPatternConfig, where: str) -> BackendPatternConfig:
    ported = copy.copy(config)
    if config.pattern is not None:
        ported.set_pattern(_port_pattern(config.pattern, where))
    else:
        ported.set_pattern_complex_format(_port_pattern(config.pattern_complex_format, where))
    ported.set_root_module(port_class(config.root_module, f"{where} root_module"))
    ported.set_qat_module(port_class(config.qat_module, f"{where} qat_module"))
    ported.set_reference_quantized_module(
        port_class(config.reference_quantized_module, f"{where} reference_quantized_module")
    )
    ported.set_fused_module(port_class(config.fused_module, f"{where} fused_module"))
    if config.fuser_method is not None and _needs_port(config):
        ported.set_fuser_method(_port_fuser(config.fuser_method, where))
    return ported


def port_backend_config(config: BackendConfig) -> BackendConfig:
    """``config`` itself when it names no torch.ao class and no foreign fuser method; else a
    copy with every torch.ao class replaced by quantbridge's equivalent (the error for one
    without names the pattern and the field)."""
    if not any(_needs_port(c) for c in config.configs):
        return config
    ported = BackendConfig(config.name)
    for c in config.configs:
        pattern = c.pattern if c.pattern is not None else c.pattern_complex_format
        where = f"BackendConfig {config.name!r}, BackendPatternConfig for {pattern!r}"
        ported.set_backend_pattern_config(_port_pattern_config(c, where) if _needs_port(c) else c)
    return ported
