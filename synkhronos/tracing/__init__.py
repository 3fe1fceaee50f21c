"""Recording a timeline of what every process does (spans and their phases)."""

from __future__ import annotations
