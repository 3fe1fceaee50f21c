"""What every rank runs, the master included: compiled functions, its share of a call, its part
of a collective."""

from __future__ import annotations
