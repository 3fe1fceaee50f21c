"""The asynchronous rules' central parameters, in one place.

- :mod:`.shared`: a center in node 0's shared memory (:class:`~.shared.Center`),
  which node 0's devices exchange with;
- :mod:`.server`: the process that serves node 0's centers to the other nodes
  over ZeroMQ, its format, and a device's handle on a center there
  (:class:`~.server.RemoteCenter`, :func:`~.server.attach_center`);
- :mod:`.process`: node 0's master's handle on that process
  (:class:`~.process.CenterServer`);
- :mod:`.loop_centers`: the master's side of its loops' centers: made, served,
  watched, closed (:class:`~.loop_centers.LoopCenters`).

A rule's ``merge`` (:class:`synkhronos.seams.rule.Rule`) says how a push meets
a center block; what a device may do with a center is
:class:`synkhronos.seams.loop.CenterClient`.
"""

from __future__ import annotations
