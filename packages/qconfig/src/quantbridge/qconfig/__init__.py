"""quantbridge.qconfig: backend description types, QConfig, QConfigMapping, observers."""

from quantbridge.qconfig._errors import QConfigError
from quantbridge.qconfig._qconfig import QConfig, QConfigAny, qconfig_equals
from quantbridge.qconfig._qconfig_mapping import QConfigMapping, QConfigMatch

__all__ = [
    "QConfig",
    "QConfigAny",
    "QConfigError",
    "QConfigMapping",
    "QConfigMatch",
    "qconfig_equals",
]
