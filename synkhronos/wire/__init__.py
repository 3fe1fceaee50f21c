"""What travels between the master and the ranks through shared memory: the control block,
a function's spec, a call's plan and a collective's words."""

from __future__ import annotations
