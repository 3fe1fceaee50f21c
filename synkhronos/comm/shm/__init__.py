"""CPU collectives through shared memory (see :mod:`.collectives`)."""

from __future__ import annotations

from .collectives import ShmComm

__all__ = ["ShmComm"]
