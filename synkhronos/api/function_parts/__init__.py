"""What a :class:`~synkhronos.api.function.Function` is made of, apart from the class itself.

- :mod:`.recording`: a graph checked, compiled on the master and shipped;
- :mod:`.givens`: the tutorials' idiom (``givens`` slicing a shared dataset
  by scalar inputs), read as rows;
- :mod:`.split_axes`: which axis of each input and output holds the rows;
- :mod:`.shapes`: argument shapes against the graph's;
- :mod:`.batch`: a call's ``batch``, ``batch_s`` and ``num_slices`` arguments;
- :mod:`.batch_shaped`: the warning for updates that depend on the batch size;
- :mod:`.kept_plans`: the plans of repeated calls, kept;
- :mod:`.hints`: the likely cause named under a failed call.

:mod:`synkhronos.api.data` and :mod:`synkhronos.api.collectives` use some of
them too (the row axis of a Data, the batch and shape checks of a collective).
"""
