"""CPU collectives through shared memory (see :mod:`.collectives`)."""

from .collectives import ShmComm

__all__ = ["ShmComm"]
