"""What one process needs from its platform: JAX start-up and shut-down, CPU tuning, and the
one adapter over PyTensor's and JAX's internals (:mod:`.internals`)."""

from __future__ import annotations
