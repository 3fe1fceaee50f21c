"""Shared memory between the processes of one node: segments, semaphores, buffers, packing."""

from __future__ import annotations
