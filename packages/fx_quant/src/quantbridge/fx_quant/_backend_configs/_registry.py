"""Backend configs by name: the seven built-ins, plus any a lowering backend registers."""

from __future__ import annotations

import re
from collections.abc import Callable

from quantbridge.fx_quant._backend_configs._executorch import get_executorch_backend_config
from quantbridge.fx_quant._backend_configs._fbgemm import get_fbgemm_backend_config
from quantbridge.fx_quant._backend_configs._native import get_native_backend_config
from quantbridge.fx_quant._backend_configs._onednn import get_onednn_backend_config
from quantbridge.fx_quant._backend_configs._qnnpack import get_qnnpack_backend_config
from quantbridge.fx_quant._backend_configs._tensorrt import get_tensorrt_backend_config
from quantbridge.fx_quant._backend_configs._x86 import get_x86_backend_config
from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.qconfig import BackendConfig

BackendConfigFactory = Callable[[], BackendConfig]

BUILTIN_BACKEND_CONFIGS: dict[str, BackendConfigFactory] = {
    "native": get_native_backend_config,
    "fbgemm": get_fbgemm_backend_config,
    "x86": get_x86_backend_config,
    "qnnpack": get_qnnpack_backend_config,
    "onednn": get_onednn_backend_config,
    "executorch": get_executorch_backend_config,
    "tensorrt": get_tensorrt_backend_config,
}
_registry: dict[str, BackendConfigFactory] = dict(BUILTIN_BACKEND_CONFIGS)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def _valid_names() -> str:
    return ", ".join(sorted(_registry))


def get_backend_config(name: str) -> BackendConfig:
    """A new BackendConfig for the backend called ``name`` (``"native"``, ``"fbgemm"``,
    ``"x86"``, ``"qnnpack"``, ``"onednn"``, ``"executorch"``, ``"tensorrt"``, or a name given to
    :func:`register_backend_config`)."""
    if not isinstance(name, str):
        raise FxQuantError(
            f"get_backend_config: the backend name must be a string, got {name!r}; valid names "
            f"are {_valid_names()}"
        )
    factory = _registry.get(name)
    if factory is None:
        raise FxQuantError(
            f"get_backend_config: unknown backend {name!r}; valid names are {_valid_names()} "
            "(register more with register_backend_config(name, factory))"
        )
    config = factory()
    if not isinstance(config, BackendConfig):
        raise FxQuantError(
            f"get_backend_config({name!r}): the registered factory {factory!r} returned "
            f"{type(config).__name__}, not a quantbridge.qconfig.BackendConfig"
        )
    return config


def register_backend_config(
    name: str, factory: BackendConfigFactory, *, replace: bool = False
) -> None:
    """Make ``get_backend_config(name)`` call ``factory()`` (a function taking no arguments and
    returning a new BackendConfig). Registering a taken name is an error unless ``replace``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise FxQuantError(
            f"register_backend_config: {name!r} is not a valid backend name; use letters, "
            "digits, '_', '-' or '.', starting with a letter or '_' (e.g. 'my_backend')"
        )
    if not callable(factory) or isinstance(factory, BackendConfig):
        raise FxQuantError(
            f"register_backend_config({name!r}): factory must be a function returning a "
            f"BackendConfig, got {factory!r}; pass e.g. lambda: my_backend_config()"
        )
    if name in _registry and not replace:
        raise FxQuantError(
            f"register_backend_config: a backend config called {name!r} is already registered; "
            "pass replace=True to replace it"
        )
    _registry[name] = factory


def backend_config_names() -> list[str]:
    """The names :func:`get_backend_config` accepts, sorted."""
    return sorted(_registry)
