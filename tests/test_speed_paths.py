"""The speed paths give the losses of the paths they replaced: 20 steps of
the shipped configs, each run both ways in this process, within 1e-5.

* quickstart (`data=8`): optimizer state sharded (`'auto'` picks it on a
  one-axis mesh for models of 1M parameters and more: gradients sliced where
  they are made, parameters gathered back in buckets) vs unsharded;
* lm_2d (`data=2 x model=4`, Megatron) and lm_pipeline_spmd: transformer
  blocks' residual stream pinned to the batch split
  (`layout_core.model.activations`) vs left to DTensor.

The sub-mesh pipeline (lm_pipeline) takes neither path: its mesh has two axes
and its stages run outside the residual context."""

import os

import pytest

from layout_core.layout.variables import to_numpy
from layout_core.model import layers
from plugins import gin_setup, plan as plan_lib
from plugins.training import build_trainer
from tests.conftest import REPO_ROOT

STEPS = 20


def losses(config: str, *bindings: str) -> list[float]:
  gin_setup.parse_gin(files=[os.path.join(REPO_ROOT, 'configs', 'experiments', f'{config}.gin')],
                      bindings=[f'train.num_steps = {STEPS}', *bindings])
  plan = plan_lib.make_plan()
  trainer = build_trainer(plan)
  batch_size = plan.train.batch_size
  return [float(to_numpy(trainer.train_step(
      plan.task.features(split='train', step=step, batch_size=batch_size))[0]))
          for step in range(STEPS)]


@pytest.mark.parametrize('config, old_path', [
    ('quickstart', 'unsharded state'),
    ('lm_2d', 'free residual'),
    ('lm_pipeline_spmd', 'free residual'),
])
def test_speed_path_keeps_the_losses(config, old_path, devices8, monkeypatch):
  if old_path == 'unsharded state':
    new = losses(config, 'optimizer.shard_state = True')
    old = losses(config, 'optimizer.shard_state = False')
  else:
    new = losses(config)
    monkeypatch.setattr(layers, 'residual', lambda x: x)
    old = losses(config)
  assert new[-1] < new[0]  # it trains
  assert new == pytest.approx(old, rel=1e-5)
