"""quantbridge.lowering: backends that turn reference models into fast int8 models.

``get_backend(name)`` returns a :class:`Backend`; ``available_backends()`` lists those that run
here. The numba backends are their table of :class:`LoweringRule` (``default_lowering_rules()``),
which gives their BackendConfig, their support table and the pass (``lower_to_kernels``).
"""

import importlib

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
from quantbridge.lowering._lower import (
    LoweringReport,
    lower_to_kernels,
    lowering_report,
    use_array_forward,
)
from quantbridge.lowering._modules import LoweredModule, WeightOnlyLinear
from quantbridge.lowering._numba_backend import NumbaBackend, numba_backend_config
from quantbridge.lowering._reference import ReferenceBackend, reference_backend
from quantbridge.lowering._rules import LoweringRule, RuleMatch
from quantbridge.lowering._table import default_lowering_rules
from quantbridge.lowering._weight_only import lower_weight_only

# built-in instances (named so they shadow neither the numba library nor
# quantbridge.fx_quant.nn.reference); the pyproject's entry points name these objects
numba_backend = NumbaBackend("numba", None)
numba_avx512_vnni_backend = NumbaBackend("numba_avx512_vnni", "avx512_vnni")
numba_avx_vnni_backend = NumbaBackend("numba_avx_vnni", "avx_vnni")
numba_avx2_backend = NumbaBackend("numba_avx2", "avx2")
numba_generic_backend = NumbaBackend("numba_generic", "generic")


def _register_builtins() -> None:
    builtins: tuple[Backend, ...] = (
        reference_backend,
        numba_backend,
        numba_avx512_vnni_backend,
        numba_avx_vnni_backend,
        numba_avx2_backend,
        numba_generic_backend,
    )
    for backend in builtins:
        register_backend(backend)
    # get_backend("x86") etc.: torch.ao's configs, lowered by numba as torch.ao lowered them
    # to its engines (the pyproject's entry points name the same objects)
    from quantbridge.lowering import _torch_ao_backends as torch_ao

    for torch_ao_backend in (
        torch_ao.x86_backend,
        torch_ao.fbgemm_backend,
        torch_ao.onednn_backend,
        torch_ao.native_backend,
    ):
        register_backend(torch_ao_backend)
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
    "numba_avx2_backend",
    "numba_avx_vnni_backend",
    "numba_avx512_vnni_backend",
    "numba_backend",
    "numba_backend_config",
    "numba_generic_backend",
    "reference_backend",
    "register_backend",
    "unregister_backend",
    "use_array_forward",
    "WeightOnlyLinear",
    "lower_weight_only",
]
