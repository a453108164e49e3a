"""The optimizers (Adam, Adafactor): global-norm clipping, a warmup + decay
learning-rate schedule, and optionally sharded state (ZeRO-1).

    from layout_core.optim import OptimizerConfig, make_optimizer
    optimizer = make_optimizer(OptimizerConfig(learning_rate=3e-3), variables=trainable,
                               paths=paths, total_steps=1000, mesh_axes={'data': 8})
    lr, grad_norm = optimizer.apply(grads, step)   # inside a tf.function

Written here rather than taken from Keras because Keras 3 optimizers do not
build DTensor slot variables. One concept per module:

  config.py     OptimizerConfig, the state-sharding policy (`state_axis`,
                `add_axis`), `count_parameters`, `SlotSpec` (TensorFlow-free)
  schedule.py   the learning-rate schedule
  base.py       what every optimizer shares: slots, clipping, the update loop
  adam.py       Adam(W)
  adafactor.py  Adafactor
  make.py       `make_optimizer`: the class a config names

Each optimizer class describes its slots for a parameter shape
(`Adam.slot_specs(shape, config)`), without TensorFlow: the optimizer creates
its slots from that description and the memory estimate counts them from it.
"""

from layout_core.optim.adafactor import Adafactor
from layout_core.optim.adam import Adam
from layout_core.optim.base import Optimizer, global_norm, squared_norm
from layout_core.optim.config import (AUTO, AUTO_MIN_PARAMETERS, DECAYS, NAMES,
                                      OptimizerConfig, SlotSpec, add_axis, check_shard_state,
                                      count_parameters, state_axis)
from layout_core.optim.make import OPTIMIZERS, make_optimizer, optimizer_class
from layout_core.optim.schedule import learning_rate

__all__ = ['AUTO', 'AUTO_MIN_PARAMETERS', 'Adafactor', 'Adam', 'DECAYS', 'NAMES', 'OPTIMIZERS',
           'Optimizer', 'OptimizerConfig', 'SlotSpec', 'add_axis', 'check_shard_state',
           'count_parameters', 'global_norm', 'learning_rate', 'make_optimizer',
           'optimizer_class', 'squared_norm', 'state_axis']
