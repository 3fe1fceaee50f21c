"""Shared memory between the processes of one node: segments, semaphores, buffers, packing."""
