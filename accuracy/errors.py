"""Domain errors of the accuracy core. They carry a user-facing sentence; callers map them once."""


class OpbandError(Exception):
    """Base class: the message says what was wrong and, where possible, what to do next."""


class BundleError(OpbandError):
    """A bundle file is malformed, hostile, or of an unsupported version."""


class ConfigError(OpbandError):
    """A budget/band configuration is incomplete or contradictory."""
