"""``python -m synkhronos.launch``: see :mod:`synkhronos.launch`."""

from .cli import main

main()
