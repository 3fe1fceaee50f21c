"""Extensions: flattened-gradient optimizers (:mod:`.updates`) and training helpers (:mod:`.train`)."""

from . import train, updates

__all__ = ["updates", "train"]
