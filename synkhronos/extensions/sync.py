"""The sync rules of :func:`synkhronos.extensions.train.run`: how devices keep their parameters together.

``AllReduce()`` (synchronous SGD), ``Average(every=k)`` (BSP weight averaging,
local SGD), ``DiLoCo(every=H, outer_lr, outer_momentum, nesterov)`` (local steps, then an
outer Nesterov step on the devices' mean change), ``EASGD(alpha, every=tau, asynchronous=False)`` (elastic averaging),
``Downpour(every=k)`` (ASGD with central parameters) and
``RateLimited(every_n_batches, alpha, beta, max_rate)`` (Legion's rule). Their
maths and what each device runs are in :mod:`synkhronos.rank.sync`.

Examples
--------
>>> from synkhronos.extensions import sync
>>> sync.EASGD(alpha=0.3, every=4, asynchronous=True)
EASGD(alpha=0.3, every=4, asynchronous=True)
"""

from __future__ import annotations

from ..rank.sync import EASGD, AllReduce, Average, DiLoCo, Downpour, RateLimited
from ..seams.rule import Rule, RuleState

__all__ = ["Rule", "RuleState", "AllReduce", "Average", "DiLoCo", "EASGD", "Downpour", "RateLimited"]
