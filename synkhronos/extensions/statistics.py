r"""Model statistics (batch norm's running mean and variance) carried through the flat gradient.

A stateful layer writes its statistics back from each batch
(:func:`pytensor_ml.pytensorf.collect_non_trainable_updates` finds those
write-backs). In a data-parallel step every device sees only its own rows, so
its write-back is that of its share of the batch. The rules of
:mod:`synkhronos.extensions.updates` therefore append each device's
contribution to the flat gradient vector: the one all-reduce of a step then
combines them over the devices, with the gradient's own row weights, and the
step's update function writes the combined statistics on every device.

For pytensor-ml's ``BatchNorm`` (running mean :math:`r_\mu`, running variance
:math:`r_\sigma`, momentum :math:`m`) the combination is exact: with device
:math:`d` holding the fraction :math:`w_d` of the batch's rows, batch mean
:math:`\mu_d` and (biased) batch variance :math:`\sigma_d^2`,

.. math::

    A_d = m \mu_d + (1 - m) r_\mu, \qquad
    C_d = m \left(\sigma_d^2 + (\mu_d - r_\mu)^2\right) + (1 - m) r_\sigma,

and after the all-reduce (:math:`\bar A = \sum_d w_d A_d`, likewise :math:`\bar C`)

.. math::

    r_\mu \leftarrow \bar A, \qquad r_\sigma \leftarrow \bar C - (\bar A - r_\mu)^2 / m,

which is :math:`m\mu + (1-m) r_\mu` and :math:`m\sigma^2 + (1-m) r_\sigma` for the
mean :math:`\mu` and variance :math:`\sigma^2` of the whole batch: the
single-process update. Without the all-reduce (a sync rule that steps on each
device's own gradient) the same write-back gives the device's own statistics.
Any other stateful layer's write-back is averaged over the devices, row-weighted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pytensor.tensor as pt
from pytensor_ml.layers.norm import BatchNormLayer
from pytensor_ml.pytensorf import collect_non_trainable_updates

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.tensor.variable import TensorVariable

__all__ = ["Carried", "carried_statistics"]


@dataclass(frozen=True)
class Carried:
    """One statistic as the flat vector carries it.

    Attributes
    ----------
    target : SharedVariable
        The statistic (a ``NonTrainableParameter``).
    contribution : TensorVariable
        What each device puts into the flat vector (shaped like ``target``).
    written : callable
        ``written(reduced)``: the statistic's new value, where ``reduced(statistic)``
        is any statistic's slice of the reduced flat vector (shaped like it).
    """

    target: Any
    contribution: Any
    written: Callable[[Callable[[Any], Any]], Any]

    @property
    def shape(self) -> tuple[int, ...]:
        return np.shape(self.target.get_value(borrow=True))

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def carried_statistics(loss: TensorVariable, already_written: Container[SharedVariable] = ()) -> list[Carried]:
    """The write-backs that the stateful layers of ``loss`` declare, as the flat vector carries them.

    Parameters
    ----------
    loss : TensorVariable
    already_written : container of SharedVariable
        Statistics the caller writes itself (left out, as pytensor-ml's collector does).

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> from pytensor_ml.layers import BatchNorm, Linear, Sequential
    >>> x = pt.matrix("x")
    >>> out = Sequential(Linear("fc", n_in=3, n_out=2), BatchNorm("bn", n_in=2))(x)
    >>> sorted(c.target.name for c in carried_statistics(out.sum()))
    ['bn_running_mean', 'bn_running_var']
    """
    write_backs = collect_non_trainable_updates(loss, already_written)
    return [_carried(target, new, write_backs) for target, new in write_backs.items()]


def _carried(target: SharedVariable, new: TensorVariable,
             write_backs: Mapping[SharedVariable, TensorVariable]) -> Carried:
    pair = _batch_norm_variance(target, new, write_backs)
    if pair is None:                 # a mean, or a statistic of another layer: averaged
        return Carried(target, new, lambda reduced: reduced(target))
    running_mean, new_mean, momentum = pair
    # the batch's second moment about the running mean (which every device shares): the
    # devices' contributions then combine exactly, and the reduced mean recovers the variance
    contribution = new + pt.sqr(new_mean - running_mean) / momentum

    def written(reduced: Callable[[Any], Any]) -> Any:
        return reduced(target) - pt.sqr(reduced(running_mean) - running_mean) / momentum
    return Carried(target, contribution, written)


def _batch_norm_variance(target: SharedVariable, new: TensorVariable,
                         write_backs: Mapping[SharedVariable, TensorVariable]
                         ) -> tuple[TensorVariable, TensorVariable, float] | None:
    """``(running mean, its new value, momentum)`` if ``new`` is the running-variance write-back of
    a ``BatchNorm`` that reads its statistics themselves and whose mean is carried too; else None."""
    node = getattr(new, "owner", None)
    if node is None or not isinstance(node.op, BatchNormLayer) or node.op.momentum <= 0:
        return None
    (mean_out, mean_in), (var_out, var_in) = sorted(node.op.update_map().items())
    running_mean, running_var = node.inputs[mean_in], node.inputs[var_in]
    # a layer applied twice in one graph reads the first application's write-back, not the
    # variable itself: the combination needs every device to start from the same value
    if new is not node.outputs[var_out] or target is not running_var or \
            write_backs.get(running_mean) is not node.outputs[mean_out]:
        return None
    return running_mean, node.outputs[mean_out], float(node.op.momentum)
