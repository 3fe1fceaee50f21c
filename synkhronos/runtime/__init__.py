"""The processes and their conversation: the master's one :class:`~.master.State`, the command
:class:`~.channel.Channel`, the Data segments, and the worker process (:mod:`.worker`)."""
