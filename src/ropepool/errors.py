"""The error class every rejected input raises (or TypeError for wrong types)."""


class RopePoolError(ValueError):
    """A value, shape or dtype that ropepool cannot take.

    A subclass of ValueError, so ``except ValueError`` keeps working for code
    written against the seed's wrapper.
    """


class OtherLayout(RopePoolError):
    """Raised by a runner that checks its own layout (the native CPU kernel's) when a call's arrays are not laid
    out as those it was bound to, before it reads or writes anything. The api catches it where the layout cache
    gave that runner by the call's key alone (plan/cache.py) and checks the call in full; anywhere else it is a
    bug of ropepool's."""

