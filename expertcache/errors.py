"""Errors raised by the cache. Each message names the argument, field or flag to change."""


class EnsureError(ValueError):
    """A call to `ensure` that the contract refuses; the cache state is left unchanged."""


class PolicyError(ValueError):
    """An unknown policy name or a bad policy constant."""


class FormatError(ValueError):
    """An unknown expert format, or a matrix / quantized part a format cannot take."""
