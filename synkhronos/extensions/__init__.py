"""Extensions: flattened-gradient optimizers (:mod:`.updates`), training helpers and device-driven
loops (:mod:`.train`) and their sync rules (:mod:`.sync`)."""

from __future__ import annotations

from . import sync, train, updates

__all__ = ["updates", "train", "sync"]
