"""The error class every rejected input raises (or TypeError for wrong types)."""


class RopePoolError(ValueError):
    """A value, shape or dtype that ropepool cannot take.

    A subclass of ValueError, so ``except ValueError`` keeps working for code
    written against the seed's wrapper.
    """
