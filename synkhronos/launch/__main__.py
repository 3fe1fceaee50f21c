"""``python -m synkhronos.launch``: see :mod:`synkhronos.launch`."""

from __future__ import annotations

from .cli import main

main()
