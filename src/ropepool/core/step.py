"""The arrays of one serving step, registered by an engine integration, and what was made of them once."""


class Step:
    """Arrays a serving step passes to every layer's call, unchanged until the next step (``begin``).

    An engine integration that makes one positions array (and one slots array per group of layers) per
    step registers them with ``begin``; calls given exactly these objects then check their values once
    per step, and the CPU path makes their cos/sin once per step (``memo``), for every layer. The
    caller promises not to change them until it calls ``begin`` again; nothing else is ever reused (an
    array not registered, however equal, is checked and computed in full). The registry keeps the
    arrays alive, so no other array can take their identity.
    """

    def __init__(self):
        self.arrays: tuple = ()
        self.memo: dict = {}

    def begin(self, *arrays) -> None:
        self.arrays, self.memo = arrays, {}

    def add(self, *arrays) -> None:
        """More arrays of the same step (e.g. the slots of another group of layers): what was made for the
        arrays registered so far stays."""
        self.arrays += arrays

    def holds(self, *arrays) -> bool:
        mine = self.arrays
        for x in arrays:  # (loops, not all/any of generators: this runs in every layer's call)
            for y in mine:
                if x is y:
                    break
            else:
                return False
        return bool(mine)


STEP = Step()
