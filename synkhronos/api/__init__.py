"""What users call: ``fork``/``close``, ``function``, ``data``, the collectives; all validation.

The modules here are the top layer: they validate in the master, then hand
work to the runtime (:mod:`synkhronos.runtime`). Nothing below imports them.
"""

from __future__ import annotations
