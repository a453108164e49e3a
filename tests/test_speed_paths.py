"""The residual-stream speed path gives the losses of the path it replaced:
8 steps of lm_2d (on `data=2 x model=2`, Megatron) and lm_pipeline_spmd (on
`stage=2 x model=2`, cut to one repeat of 2 blocks in 2 micro-batches: a
third of the compile, the same stage slots), each run both ways in this
process, within 1e-5:
transformer blocks' residual stream pinned to the batch split
(`layout_core.model.activations`) vs left to DTensor.

The other speed path, optimizer state sharded on a one-axis mesh (`'auto'`
picks it for models of 1M parameters and more), is held to unsharded state
by tests/test_optimizer_state.py. The sub-mesh pipeline (lm_pipeline) takes
neither: its mesh has two axes and its stages run outside the residual
context."""

import os

import pytest

from layout_core.layout.variables import to_numpy
from layout_core.model import layers
from plugins import gin_setup, plan as plan_lib
from plugins.training import build_trainer
from tests.numerics import assert_close
from tests.conftest import REPO_ROOT, SPMD_ON_FOUR

STEPS = 8


def losses(config: str, *bindings: str) -> list[float]:
  gin_setup.parse_gin(files=[os.path.join(REPO_ROOT, 'configs', 'experiments', f'{config}.gin')],
                      bindings=[f'train.num_steps = {STEPS}', *bindings])
  plan = plan_lib.make_plan()
  trainer = build_trainer(plan)
  batch_size = plan.train.batch_size
  return [float(to_numpy(trainer.train_step(
      plan.task.features(split='train', step=step, batch_size=batch_size))[0]))
          for step in range(STEPS)]


# Each on 4 devices, 'model' still splitting the blocks the pin holds to their layout (a step
# function compiles once per device).
SMALLER = {'lm_2d': ("mesh.shape = {'data': 2, 'model': 2}",),
           'lm_pipeline_spmd': (SPMD_ON_FOUR.removeprefix('--gin_bindings='),
                                'pipeline.num_micro_batches = 2', 'pipeline.circular_repeats = 1',
                                'transformer_lm.num_layers = 2')}


@pytest.mark.parametrize('config', list(SMALLER))
def test_pinned_residual_keeps_the_losses(config, devices8, monkeypatch):
  new = losses(config, *SMALLER[config])
  monkeypatch.setattr(layers, 'residual', lambda x, pin: x)
  old = losses(config, *SMALLER[config])
  assert new[-1] < new[0]  # it trains
  # the same math with and without the pin. measured on 4 devices: 0 / 0 / 0 (default / no
  # oneDNN / 1 thread; 5.7e-08 on 8)
  assert_close(new, old, rel=1e-05, what='losses')
