"""Turning a user's graph into what every rank compiles: rewrites, shipping, threaded updates, random streams."""

from __future__ import annotations
