"""quantbridge.lowering: backends that turn reference models into fast int8 models.

``get_backend(name)`` returns a :class:`Backend` (``.name``, ``.backend_config``,
``.qconfig_mapping(qat=False)``, ``.lower(reference_model)``, ``.convert(prepared_model)``,
``.supported_ops()``); ``available_backends()`` lists those that run on this machine. Every
backend is registered in fx_quant's lowering registry, so ``convert_fx(prepared,
backend_config=get_backend(name).backend_config)`` lowers with it. The torch.ao-named CPU
configs (``get_backend_config("x86")``, fbgemm, onednn, native) lower with ``numba`` too.

The lowering pass onto the kernels (``lower_to_kernels``) is driven by a table of
:class:`LoweringRule` (a quantbridge.patterns pattern and a builder); ``default_lowering_rules()``
is the built-in table, and ``lower_to_kernels(model, target, rules=...)`` takes an extended one.
"""

import importlib

from quantbridge.fx_quant import register_lowering
from quantbridge.lowering._auto_quantize import (
    AutoQuantizeError,
    AutoQuantizeReport,
    SearchStep,
    auto_quantize,
)
from quantbridge.lowering._backend import (
    Backend,
    BackendUnavailableError,
    SupportedOp,
    available_backends,
    get_backend,
    register_backend,
    unregister_backend,
)
from quantbridge.lowering._context import LoweringContext, NotLowerableError
from quantbridge.lowering._errors import LoweringError
from quantbridge.lowering._lower import LoweringReport, lower_to_kernels, lowering_report
from quantbridge.lowering._modules import LoweredModule
from quantbridge.lowering._numba_backend import (
    TORCH_AO_CPU_CONFIGS,
    NumbaBackend,
    numba_backend_config,
    torch_ao_cpu_lowering,
)
from quantbridge.lowering._reference import ReferenceBackend, reference
from quantbridge.lowering._rules import LoweringRule, RuleMatch
from quantbridge.lowering._table import default_lowering_rules

# built-in instances; the pyproject's entry points name these objects
numba = NumbaBackend("numba", None)
numba_avx512_vnni = NumbaBackend("numba_avx512_vnni", "avx512_vnni")
numba_avx2 = NumbaBackend("numba_avx2", "avx2")
numba_generic = NumbaBackend("numba_generic", "generic")


def _register_builtins() -> None:
    for backend in (reference, numba, numba_avx512_vnni, numba_avx2, numba_generic):
        register_backend(backend)
    # convert_fx with get_backend_config("x86") etc. lowers to numba, as torch.ao lowered
    # these configs to its engines (the pyproject's entry points name the same object)
    for name in TORCH_AO_CPU_CONFIGS:
        register_lowering(name, torch_ao_cpu_lowering)
    # torch_native is the one module touching quantized tensors: imported only here, guarded
    try:
        native = importlib.import_module("quantbridge.lowering._torch_native")
    except ModuleNotFoundError as e:
        if e.name != "quantbridge.lowering._torch_native":
            raise
        return
    # contract with _torch_native: is_available() and a Backend instance named torch_native
    if native.is_available():
        register_backend(native.torch_native)


_register_builtins()

__all__ = [
    "AutoQuantizeError",
    "AutoQuantizeReport",
    "Backend",
    "BackendUnavailableError",
    "LoweredModule",
    "LoweringContext",
    "LoweringError",
    "LoweringReport",
    "LoweringRule",
    "NotLowerableError",
    "NumbaBackend",
    "ReferenceBackend",
    "RuleMatch",
    "SearchStep",
    "SupportedOp",
    "available_backends",
    "auto_quantize",
    "default_lowering_rules",
    "get_backend",
    "lower_to_kernels",
    "lowering_report",
    "numba",
    "numba_avx2",
    "numba_avx512_vnni",
    "numba_backend_config",
    "numba_generic",
    "reference",
    "register_backend",
    "unregister_backend",
]
