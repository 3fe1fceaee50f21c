"""The contracts the extension points are written against, below everything that uses them.

- :mod:`.rule`: what a sync rule is (:class:`~.rule.Rule`: settings in a frozen
  dataclass, its hooks, its ``merge`` for a center) and one rank's state apart
  from it (:class:`~.rule.RuleState`);
- :mod:`.loop`: what a rule may use of the loop it runs in
  (:class:`~.loop.RuleLoop`) and a device's handle on a center
  (:class:`~.loop.CenterClient`).

The rules themselves are :mod:`synkhronos.rank.sync`; the loop that runs them is
:class:`synkhronos.rank.loop.DeviceLoop`; a loop's spec
(:class:`synkhronos.wire.loop.LoopSpec`) carries a rule to every rank.
"""
