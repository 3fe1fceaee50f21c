"""The processes and their conversation: the master's one :class:`~.state.State`, the command
:class:`~.channel.Channel`, the Data segments, and the worker process (:mod:`.worker`)."""

from __future__ import annotations
