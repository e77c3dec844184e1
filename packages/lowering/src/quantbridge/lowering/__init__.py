"""quantbridge.lowering: backends that turn reference models into fast int8 models.

Not built yet. It will hold get_backend, available_backends and the built-in backends
(reference, numba, numba_avx512_vnni, numba_avx2, numba_generic, torch_native). Only its
exception class exists today.
"""

from quantbridge.lowering._errors import LoweringError

__all__ = ["LoweringError"]
