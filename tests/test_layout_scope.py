"""The layout scope on real DTensor meshes: layouts, shards, slots, numerics."""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from layout_core.tasks.lm import MarkovTask
from layout_core.model.lm import transformer_lm_params
from layout_core.layout.scope import LayoutScope
from layout_core.optim import OptimizerConfig
from layout_core.layout.rules import LayoutRules
from layout_core.train.config import TrainConfig
from layout_core.run import make_trainer
from layout_core.layout.variables import to_numpy
from tests.numerics import assert_close

MEGATRON = [
    (r'.*/attn/w[qkv]', ('unsharded', 'model', 'unsharded')),
    (r'.*/attn/wo', ('model', 'unsharded', 'unsharded')),
    (r'.*/ffn/w_in', ('unsharded', 'model')),
    (r'.*/ffn/b_in', ('model',)),
    (r'.*/ffn/w_out', ('model', 'unsharded')),
    (r'.*/emb/(pos_)?table', ('unsharded', 'model')),
    (r'.*/softmax/w', ('unsharded', 'model')),
    (r'.*/softmax/b', ('model',)),
]


def small_lm():
  return transformer_lm_params(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64,
                               num_layers=2, max_len=16)


def test_variables_are_born_with_their_layouts(mesh_2x4):
  with LayoutScope(mesh=mesh_2x4, rules=LayoutRules(MEGATRON)) as scope:
    small_lm().Instantiate()
  records = {r.path: r for r in scope.records}
  w_in = scope.variables['lm/stack/block_001/ffn/w_in']
  assert w_in.layout.sharding_specs == ['unsharded', 'model']
  shards = dtensor.unpack(w_in.read_value())
  assert len(shards) == 8 and tuple(shards[0].shape) == (32, 16)
  assert records['lm/stack/block_001/ffn/w_in'].bytes_per_device == 32 * 16 * 4
  scale = scope.variables['lm/final_ln/scale']
  assert scale.layout.is_fully_replicated()
  assert records['lm/final_ln/scale'].source == 'default: replicated'
  for path, variable in scope.variables.items():
    assert list(variable.layout.sharding_specs) == list(records[path].spec), path


def test_plain_variables_in_the_scope_are_replicated(mesh_2x4):
  with LayoutScope(mesh=mesh_2x4):
    generator = tf.random.Generator.from_seed(1)
    counter = tf.Variable(3)
  for variable in (generator.state, counter):
    assert isinstance(variable, dtensor.DVariable)
    assert variable.layout.is_fully_replicated()
  assert int(to_numpy(counter)) == 3


def lm_trainer(mesh, rules, steps=4):
  return make_trainer(model=small_lm(), mesh=mesh, rules=rules,
                 task=MarkovTask(vocab_size=32, seq_len=16, seed=3),
                 optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
                 config=TrainConfig(num_steps=steps, batch_size=8, log_every=1,
                                    eval_every=0, eval_batches=1))


def test_slots_follow_their_parameter_layout(mesh_2x4):
  trainer = lm_trainer(mesh_2x4, LayoutRules(MEGATRON))
  for path, variable in trainer.engine.variables.items():
    for slots in (trainer.engine.optimizer.m, trainer.engine.optimizer.v):
      assert slots[path].layout == variable.layout, path


def test_sharded_run_matches_replicated_run(mesh_2x4, mesh_data8):
  """2-D sharded (data x model) vs pure data parallel: same losses and weights."""
  sharded = lm_trainer(mesh_2x4, LayoutRules(MEGATRON))
  replicated = lm_trainer(mesh_data8, LayoutRules())
  for path in sharded.engine.variables:
    np.testing.assert_array_equal(to_numpy(sharded.engine.variables[path]),
                                  to_numpy(replicated.engine.variables[path]), err_msg=path)
  task = sharded.task
  for step in range(4):
    batch = {'tokens': task.batch(step=step, batch_size=8)}
    loss_a = float(to_numpy(sharded.train_step(batch)[0]))
    loss_b = float(to_numpy(replicated.train_step(batch)[0]))
    # measured: 0 / 0 / 0 (default / no oneDNN / 1 thread)
    assert_close(loss_a, loss_b, rel=1e-05, what=f'loss: step {step}')
  final = {'tokens': task.batch(step=9, batch_size=8)}
  final_a = float(to_numpy(sharded.engine.evaluate(sharded.engine.pack(final))[0]))
  final_b = float(to_numpy(replicated.engine.evaluate(replicated.engine.pack(final))[0]))
  # measured: 0 / 0 / 0 (default / no oneDNN / 1 thread)
  assert_close(final_a, final_b, rel=1e-05, what='eval loss')
  assert final_a < float(np.log(32))  # it trained
  # Sharded reductions sum in another order; Adam divides by sqrt(v), which
  # turns a near-zero gradient's rounding into up to a full lr step.
  # measured: 2.6e-04 / 2.6e-04 / 2.6e-04 (default / no oneDNN / 1 thread)
  for path in sharded.engine.variables:
    assert_close(to_numpy(sharded.engine.variables[path]),
                 to_numpy(replicated.engine.variables[path]), rel=3e-3, what=f'weights: {path}')
