"""The one exception family of quantbridge.kernels."""


class KernelError(ValueError):
    """Input a kernel refuses (checked before any compiled code runs), or an unusable target."""


class TargetUnavailableError(KernelError):
    """The requested kernel target cannot run on this CPU."""
