"""quantbridge.qconfig: backend description types, QConfig, QConfigMapping, observers."""

from quantbridge.qconfig._errors import QConfigError

__all__ = ["QConfigError"]
