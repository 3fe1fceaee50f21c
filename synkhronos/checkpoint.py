"""``synkhronos.checkpoint``: save and restore shared variables (see :mod:`synkhronos.api.checkpoint`).

Importable as a module of its own (``import synkhronos.checkpoint``, ``from synkhronos.checkpoint
import save``) and reached as ``synk.checkpoint``; both are the functions of
:mod:`synkhronos.api.checkpoint`.
"""

from __future__ import annotations

from .api.checkpoint import ARRAY_PREFIX, default_variables, exists, read, restore, save

__all__ = ["save", "restore", "read", "exists", "default_variables", "ARRAY_PREFIX"]
