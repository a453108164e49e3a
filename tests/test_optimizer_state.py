"""Adafactor against a NumPy reference, and sharded optimizer state (ZeRO-1)
against unsharded state: the same training, checkpoints that move both ways."""

import numpy as np
import pytest

from layout_core.checkpoint import manager as checkpoint_lib
from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer
from layout_core.lazy import dtensor, tf
from layout_core.layout import mesh as mesh_lib
from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model.lm import transformer_lm_params
from layout_core.optim import OptimizerConfig, make_optimizer
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig
from layout_core.run import make_trainer
from tests.numerics import assert_close
from tests.test_layout_scope import MEGATRON
from tests.test_precision import SETUPS, lm, stage_mesh, values  # noqa: F401 (a fixture)


# -- Adafactor, step by step ----------------------------------------------------------
def numpy_adafactor(params, grad_steps, config: OptimizerConfig, lr: float):
  """Adafactor written from the paper, in float64 NumPy (independent of the
  TensorFlow code): factored second moments for matrices (rank >= 2) whose
  last two dims reach the threshold, update clipping, first moment, relative
  step size, decoupled weight decay; clipping by the global gradient norm first."""
  params = {k: v.astype(np.float64) for k, v in params.items()}
  state = {k: {} for k in params}
  for t, grads in enumerate(grad_steps, start=1):
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values()))
    scale = min(1.0, config.clip_norm / (norm + 1e-12)) if config.clip_norm else 1.0
    beta2 = 1.0 - t ** -config.adafactor_decay_rate
    for k, p in params.items():
      g = grads[k].astype(np.float64) * scale
      g2 = g * g + config.adafactor_epsilon1
      s = state[k]
      if p.ndim >= 2 and min(p.shape[-2:]) >= config.adafactor_min_dim_to_factor:
        s['r'] = beta2 * s.get('r', 0) + (1 - beta2) * g2.mean(axis=-1)
        s['c'] = beta2 * s.get('c', 0) + (1 - beta2) * g2.mean(axis=-2)
        v = (s['r'][..., :, None] * s['c'][..., None, :]
             / s['r'].mean(axis=-1)[..., None, None])
      else:
        s['v'] = v = beta2 * s.get('v', 0) + (1 - beta2) * g2
      u = g / np.sqrt(v)
      u /= max(1.0, np.sqrt(np.mean(u * u)) / config.adafactor_clipping_threshold)
      if config.adafactor_beta1:
        s['m'] = u = config.adafactor_beta1 * s.get('m', 0) + (1 - config.adafactor_beta1) * u
      rms = np.sqrt(np.mean(p * p))
      params[k] = p - lr * max(config.adafactor_epsilon2, rms) * u - lr * config.weight_decay * p
  return params


def test_adafactor_matches_a_numpy_reference_over_three_steps(mesh_2x4):
  config = OptimizerConfig(name='adafactor', learning_rate=0.05, warmup_steps=0,
                           decay='constant', clip_norm=2.0, weight_decay=0.01,
                           adafactor_beta1=0.5, adafactor_min_dim_to_factor=4)
  rng = np.random.RandomState(0)
  shapes = {'matrix': ((8, 12), ['unsharded', 'model']),   # factored, sharded columns
            'tensor': ((2, 4, 6), ['unsharded', 'unsharded', 'unsharded']),  # factored
            'narrow': ((3, 8), ['unsharded', 'model']),    # a dim < 4: a full v
            'vector': ((8,), ['model'])}
  initial = {k: rng.randn(*shape).astype(np.float32) for k, (shape, _) in shapes.items()}
  variables = {k: dtensor.DVariable(mesh_lib.pack_global_array(
      initial[k], dtensor.Layout(spec, mesh_2x4))) for k, (_, spec) in shapes.items()}
  optimizer = make_optimizer(config, variables=list(variables.values()), paths=list(variables),
                             total_steps=3, mesh_axes={'data': 2, 'model': 4})
  assert set(optimizer.v_row) == {'matrix', 'tensor'} and set(optimizer.v) == {'narrow', 'vector'}
  assert optimizer.v_col['matrix'].layout.sharding_specs == ['model']  # the column's sharding
  grad_steps = [{k: rng.randn(*v.shape).astype(np.float32) for k, v in initial.items()}
                for _ in range(3)]
  step = tf.function(lambda grads, t: optimizer.apply(grads, t))
  for t, grads in enumerate(grad_steps):
    step([mesh_lib.pack_global_array(grads[k], variables[k].layout) for k in variables],
         dtensor.copy_to_mesh(tf.constant(t, tf.int64), dtensor.Layout.replicated(mesh_2x4, 0)))
  expected = numpy_adafactor(initial, grad_steps, config, lr=0.05)
  for k, variable in variables.items():
    # measured: - / 1e-07 / 1e-07 (default / no oneDNN / 1 thread)
    assert_close(to_numpy(variable), expected[k], rel=2e-06, what=f'weights: {k}')


def test_slot_checkpoint_keys_stay_those_earlier_checkpoints_hold(mesh_2x4):
  """The keys (written out, as checkpoints before the optimizer package held
  them) of Adam's and Adafactor's slots, and that the slots are the ones
  `slot_specs` describes: a renamed slot attribute would orphan old state."""
  variables = {'lm/ffn/w_in': dtensor.DVariable(mesh_lib.pack_global_array(
                   np.zeros((8, 12), np.float32), dtensor.Layout(['unsharded', 'model'], mesh_2x4))),
               'lm/norm/b': dtensor.DVariable(mesh_lib.pack_global_array(
                   np.zeros((8,), np.float32), dtensor.Layout(['model'], mesh_2x4)))}
  suffix = '/.ATTRIBUTES/VARIABLE_VALUE'
  for config, keys in (
      (OptimizerConfig(), ['m/lm.Sffn.Sw_in', 'v/lm.Sffn.Sw_in', 'm/lm.Snorm.Sb', 'v/lm.Snorm.Sb']),
      (OptimizerConfig(name='adafactor', adafactor_min_dim_to_factor=4, adafactor_beta1=0.5),
       ['v_row/lm.Sffn.Sw_in', 'v_col/lm.Sffn.Sw_in', 'm/lm.Sffn.Sw_in', 'v/lm.Snorm.Sb',
        'm/lm.Snorm.Sb'])):
    optimizer = make_optimizer(config, variables=list(variables.values()), paths=list(variables),
                               total_steps=1, mesh_axes={'data': 2, 'model': 4})
    saved = checkpoint_lib.checkpoint_keys({'optimizer': optimizer})
    assert sorted(saved) == sorted(f'optimizer/{key}{suffix}' for key in keys)
    for path, variable in variables.items():
      described = type(optimizer).slot_specs(variable.shape.as_list(), config)
      assert [tuple(s.shape) for s in optimizer.slots_for(path)] == [s.shape for s in described]


# -- sharded state -------------------------------------------------------------------
@pytest.fixture(scope='module')
def mesh_4x2(devices8):
  return build_mesh(MeshSpec(shape={'data': 4, 'model': 2}))


def sharded_and_plain(mesh, rules=MEGATRON, **optimizer):

  def make(shard_state):
    return make_trainer(
        model=transformer_lm_params(vocab_size=30, model_dim=32, num_heads=4, ffn_dim=64,
                                    num_layers=2, max_len=16),
        mesh=mesh, rules=LayoutRules(rules),
        task=MarkovTask(vocab_size=30, seq_len=16, seed=3),
        optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0, shard_state=shard_state,
                                  **optimizer),
        config=TrainConfig(num_steps=10, batch_size=8, log_every=1, eval_every=0,
                           eval_batches=1))
  return make(True), make(False)


def test_sharded_state_trains_as_unsharded_state_and_checkpoints_move_both_ways(
    mesh_4x2, tmp_path):
  """10 steps on data 4 x model 2: ZeRO-1 state (slots split over 'data')
  equals unsharded state within 1e-5; its checkpoint restores into an
  unsharded run and back, bit-exactly."""
  sharded, plain = sharded_and_plain(mesh_4x2)
  optimizer = sharded.engine.optimizer
  # Independently: which parameters have a dimension the layout leaves free and 4 divides.
  splittable = {r.path for r in sharded.engine.layout_records
                if any(a == 'unsharded' and n % 4 == 0 for a, n in zip(r.spec, r.shape))}
  assert set(optimizer.unsharded_state) == set(optimizer.paths) - splittable
  assert 'lm/softmax/b' in optimizer.unsharded_state          # [30]: 4 does not divide it
  w_in = optimizer.m['lm/stack/block_000/ffn/w_in']            # [32, 64], model on dim 1
  assert w_in.layout.sharding_specs == ['data', 'model']
  assert optimizer.m['lm/softmax/b'].layout.sharding_specs == ['model']
  assert plain.engine.optimizer.m['lm/stack/block_000/ffn/w_in'].layout.sharding_specs == [
      'unsharded', 'model']
  for step in range(10):
    batch = {'tokens': sharded.task.batch(step=step, batch_size=8)}
    loss_a = float(to_numpy(sharded.train_step(batch)[0]))
    loss_b = float(to_numpy(plain.train_step(batch)[0]))
    # measured: - / 2e-07 / 2e-07 (default / no oneDNN / 1 thread)
    assert_close(loss_a, loss_b, rel=2e-06, what=f'loss: step {step}')
  for path, value in values(plain.engine.variables).items():
    # measured: - / 2e-06 / 2e-06 (default / no oneDNN / 1 thread)
    assert_close(to_numpy(sharded.engine.variables[path]), value, rel=2e-05,
                 what=f'weights: {path}')

  fresh_sharded, fresh_plain = sharded_and_plain(mesh_4x2)
  move_checkpoint(sharded, fresh_plain, tmp_path / 'to_plain', step=10)
  move_checkpoint(fresh_plain, fresh_sharded, tmp_path / 'back', step=10)


def move_checkpoint(source, target, directory, *, step: int) -> tuple[dict, dict]:
  """Saves trainer `source` at `step` into `directory`, restores it into
  trainer `target` and checks every value `target` holds equals the saved
  one. Returns (saved, restored): checkpoint key -> variable."""
  Checkpointer(directory=str(directory), state=source.state(),
               config=CheckpointConfig()).save(step, reason='final')
  assert Checkpointer(directory=str(directory), state=target.state(),
                      config=CheckpointConfig()).restore_latest() == step
  saved = checkpoint_lib.checkpoint_keys(source.state())
  restored = checkpoint_lib.checkpoint_keys(target.state())
  for key, variable in restored.items():
    np.testing.assert_array_equal(to_numpy(variable), to_numpy(saved[key]), err_msg=key)
  return saved, restored


def test_pipelines_train_with_adafactor_and_sharded_state(request, mesh_2x2):
  """Both pipeline engines with Adafactor (factored matrices) and ZeRO-1
  state: two steps equal the 2-D sharded run's with the same optimizer."""
  adafactor = dict(name='adafactor', adafactor_min_dim_to_factor=16)
  plain = optimizer_trainer(mesh_2x2, MEGATRON, None, **adafactor)
  piped = {setup: optimizer_trainer(request.getfixturevalue(SETUPS[setup][0]), SETUPS[setup][1],
                                    SETUPS[setup][2], shard_state=True, **adafactor)
           for setup in ('spmd', 'gpipe')}
  for t in piped.values():
    optimizer = t.engine.optimizer
    assert optimizer.v_row and optimizer.v
    assert any('data' in slot.layout.sharding_specs
               for p in optimizer.paths for slot in optimizer.slots_for(p))
  for step in range(2):
    batch = {'tokens': plain.task.batch(step=step, batch_size=8)}
    loss = float(to_numpy(plain.train_step(batch)[0]))
    for setup, t in piped.items():
      # measured: - / 0 / 0 (default / no oneDNN / 1 thread)
      assert_close(float(to_numpy(t.train_step(batch)[0])), loss, rel=1e-05,
                   what=f'loss: {setup}')
  after = values(plain.engine.variables)
  for setup, t in piped.items():
    piped_values = t.engine.program.stack.unstacked_values() if setup == 'spmd' else {}
    piped_values.update(values(t.engine.variables))
    for path, value in after.items():
      # measured: - / 1e-06 / 1e-06 (default / no oneDNN / 1 thread)
      assert_close(piped_values[path], value, rel=2e-05, what=f'weights: {setup} {path}')


def optimizer_trainer(mesh, rules, pipeline, **optimizer):
  return make_trainer(
      model=lm(dropout_rate=0.0), mesh=mesh, rules=LayoutRules(list(rules)),
      task=MarkovTask(vocab_size=32, seq_len=16, seed=3),
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0, **optimizer),
      config=TrainConfig(num_steps=2, batch_size=8, log_every=1, eval_every=0,
                         eval_batches=1), pipeline=pipeline)


def test_sharded_state_on_a_one_axis_mesh_equals_unsharded_state(mesh_data4):
  """On a one-axis mesh, sharded state gives the values of unsharded state.
  (This process keeps DTensor's default all-gather lowering, tests/conftest.py;
  a trainer's, whose first mesh is this one, compiles CollectiveGatherV2, with
  the same values: tests/test_tf_internals.py.)"""
  sharded, plain = sharded_and_plain(mesh_data4, rules=[])
  assert sharded.engine.optimizer.m['lm/stack/block_000/ffn/w_in'].layout.sharding_specs == [
      'data', 'unsharded']  # [32, 64]: its first dim 4 divides
  for step in range(3):
    batch = {'tokens': sharded.task.batch(step=step, batch_size=8)}
    loss_a = float(to_numpy(sharded.train_step(batch)[0]))
    loss_b = float(to_numpy(plain.train_step(batch)[0]))
    # measured: - / 0 / 0 (default / no oneDNN / 1 thread)
    assert_close(loss_a, loss_b, rel=1e-05, what=f'loss: step {step}')
  for path, value in values(plain.engine.variables).items():
    # measured: - / 1e-06 / 1e-06 (default / no oneDNN / 1 thread)
    assert_close(to_numpy(sharded.engine.variables[path]), value, rel=2e-05,
                 what=f'weights: {path}')
