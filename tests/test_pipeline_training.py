"""Pipelined training (GPipe on sub-meshes) against the plain trainer."""

import numpy as np
import pytest

from layout_core.checkpoint import manager as checkpoint_lib
from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer
from layout_core.tasks.lm import MarkovTask
from layout_core.errors import ConfigError
from layout_core.model.lm import transformer_lm_params
from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.optim import OptimizerConfig
from layout_core.pipeline import PipelineConfig
from layout_core.layout.rules import LayoutRules
from layout_core.train.config import TrainConfig
from layout_core.run import make_trainer
from layout_core.layout.variables import to_numpy
from tests.numerics import assert_close
from tests.test_layout_scope import MEGATRON, small_lm


def lm_with_dropout():
  return transformer_lm_params(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64,
                               num_layers=2, max_len=16, dropout_rate=0.2)


def make(mesh, rules, pipeline=None, batch_size=8, params=None):
  return make_trainer(model=params or small_lm(), mesh=mesh, rules=LayoutRules(rules),
                task=MarkovTask(vocab_size=32, seq_len=16, seed=3),
                optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
                config=TrainConfig(num_steps=3, batch_size=batch_size, log_every=1,
                                   eval_every=0, eval_batches=1), pipeline=pipeline)


@pytest.fixture(scope='module')
def stage_mesh(devices8):
  return build_mesh(MeshSpec(shape={'stage': 2, 'data': 2, 'model': 2}))


def test_pipelined_training_matches_plain_training(stage_mesh, mesh_data8, tmp_path):
  """K=2 stages x (data 2 x model 2, Megatron rules), 2 micro-batches, vs pure
  data parallelism on 8 devices, both with dropout: same losses, gradient
  norms, weights (so each micro-batch drew its own rows' masks, in the forward
  and in the backward's re-computation), and the same checkpoint keys (a
  checkpoint moves between the two)."""
  piped = make(stage_mesh, MEGATRON, PipelineConfig(num_stages=2, num_micro_batches=2),
               params=lm_with_dropout())
  plain = make(mesh_data8, [], params=lm_with_dropout())
  assert {r.mesh for r in piped.engine.layout_records} == {'stage0', 'stage1'}
  piped_keys = checkpoint_lib.checkpoint_keys(piped.state())
  assert piped_keys.keys() == checkpoint_lib.checkpoint_keys(plain.state()).keys()
  for step in range(3):
    batch = piped.task.batch(step=step, batch_size=8)
    loss_a, _, norm_a, metrics_a = piped.train_step({'tokens': batch})
    loss_b, _, norm_b, metrics_b = plain.train_step({'tokens': batch})
    # measured: 7e-08 / 7e-08 / 7e-08 (default / no oneDNN / 1 thread)
    assert_close(to_numpy(loss_a), to_numpy(loss_b), rel=1e-6, what=f'loss: step {step}')
    # measured: 0 / 0 / 0 (default / no oneDNN / 1 thread)
    assert_close(to_numpy(metrics_a['accuracy']), to_numpy(metrics_b['accuracy']), rel=1e-6,
                 what=f'accuracy: step {step}')
    # measured: 1.5e-07 / 1.5e-07 / 1.5e-07 (default / no oneDNN / 1 thread)
    assert_close(to_numpy(norm_a), to_numpy(norm_b), rel=2e-6, what=f'grad norm: step {step}')
  assert piped.current_step == plain.current_step == 3
  (piped_loss, piped_metrics), (plain_loss, plain_metrics) = piped.evaluate(), plain.evaluate()
  # measured: 7e-08 / 7e-08 / 7e-08 (default / no oneDNN / 1 thread)
  assert_close(piped_loss, plain_loss, rel=1e-06, what='eval loss')
  assert piped_metrics.keys() == plain_metrics.keys() == {'accuracy'}
  # measured: 0 / 0 / 0 (default / no oneDNN / 1 thread)
  assert_close(piped_metrics['accuracy'], plain_metrics['accuracy'], rel=1e-06,
               what='eval accuracy')
  for path, variable in piped.engine.variables.items():  # Adam: see test_layout_scope
    # measured: 8e-05 / 8e-05 / 8e-05 (default / no oneDNN / 1 thread)
    assert_close(to_numpy(variable), to_numpy(plain.engine.variables[path]), rel=0.001,
                 what=f'weights: {path}')

  checkpointer = Checkpointer(directory=str(tmp_path), state=piped.state(),
                              config=CheckpointConfig())
  checkpointer.save(3, reason='final')
  fresh = make(mesh_data8, [], params=lm_with_dropout())
  assert Checkpointer(directory=str(tmp_path), state=fresh.state(),
                      config=CheckpointConfig()).restore_latest() == 3
  for key, variable in checkpoint_lib.checkpoint_keys(fresh.state()).items():
    np.testing.assert_array_equal(to_numpy(variable), to_numpy(piped_keys[key]), err_msg=key)


def test_pipeline_config_errors_name_the_knob(stage_mesh):
  with pytest.raises(ConfigError, match='num_micro_batches=3 does not divide the batch of 8'):
    make(stage_mesh, [], PipelineConfig(num_stages=2, num_micro_batches=3))
  with pytest.raises(ConfigError, match="num_stages=4 but mesh axis 'stage' has size 2"):
    make(stage_mesh, [], PipelineConfig(num_stages=4, num_micro_batches=2))
  with pytest.raises(ConfigError, match="micro-batch of 1 .* does not split over mesh axis 'data'"):
    make(stage_mesh, [], PipelineConfig(num_stages=2, num_micro_batches=8))
  with pytest.raises(ConfigError, match='micro_batch_size=3 does not divide the batch of 8'):
    make(stage_mesh, [], PipelineConfig(num_stages=2, micro_batch_size=3))
  with pytest.raises(ConfigError, match='batch_dim'):
    make(stage_mesh, [], PipelineConfig(num_stages=2, batch_dim=1))
