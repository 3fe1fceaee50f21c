"""``python -m synkhronos.runtime.centers HOST``: node 0's center server (see :mod:`.server`).

An entry point of its own: the package's modules are imported before ``-m`` runs one of them, so
the server module itself is never the ``__main__`` that runs.
"""

import sys

from .server import serve

serve(sys.argv[1])
