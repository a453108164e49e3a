"""The optimizer a config names, with its state split as `shard_state` says.

    optimizer = make_optimizer(OptimizerConfig(learning_rate=3e-3), variables=trainable,
                               paths=paths, total_steps=1000, mesh_axes={'data': 8})
    lr, grad_norm = optimizer.apply(grads, step)   # inside a tf.function
    optimizer_class('adafactor').slot_specs((512, 2048), config)   # no TensorFlow needed
"""

from __future__ import annotations

from typing import Mapping, Sequence

from layout_core.lazy import tf
from layout_core.optim.adafactor import Adafactor
from layout_core.optim.adam import Adam
from layout_core.optim.base import Optimizer
from layout_core.optim.config import NAMES, OptimizerConfig, state_axis

OPTIMIZERS: dict[str, type[Optimizer]] = {'adam': Adam, 'adafactor': Adafactor}
assert tuple(OPTIMIZERS) == NAMES, 'config.NAMES lists the optimizers made here'


def optimizer_class(name: str) -> type[Optimizer]:
  """The class of `optimizer.name` (a name OptimizerConfig has already checked)."""
  return OPTIMIZERS[name]


def make_optimizer(config: OptimizerConfig, *, variables: Sequence[tf.Variable],
                   paths: Sequence[str], total_steps: int,
                   mesh_axes: Mapping[str, int] | None = None,
                   batch_axis: str = 'data',
                   lead_dims: Mapping[str, int] | None = None,
                   fsdp_axis: str | None = None) -> Optimizer:
  """The optimizer `config.name` names, its state split as `shard_state` says
  (`state_axis`, counting the parameters it is given; with `fsdp_axis` the
  parameters are split over that axis already, and their slots with them)."""
  axis = state_axis(config, batch_axis=batch_axis, mesh_axes=mesh_axes or {},
                    parameter_shapes=[v.shape.as_list() for v in variables],
                    fsdp_axis=fsdp_axis)
  return optimizer_class(config.name)(config, variables=variables, paths=paths,
                                      total_steps=total_steps, shard_axis=axis,
                                      lead_dims=lead_dims)
