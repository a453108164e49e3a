"""Keras 3 models trained model-parallel by meshgin, against plain Keras on TF."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from layout_core.checkpoint import manager as checkpoint_lib
from layout_core.model import keras as keras_models
from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer
from layout_core.optim import OptimizerConfig
from layout_core.layout.rules import LayoutRules
from layout_core.train.config import TrainConfig
from layout_core.run import make_trainer
from layout_core.layout.variables import to_numpy
from tests.numerics import assert_close
from tests.conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, 'tests', 'fixtures'))
from my_project import models, tasks  # noqa: E402  pylint: disable=g-import-not-at-top

keras = keras_models.import_keras()

RULES = [(r'embed/embeddings', ('unsharded', 'model')),
         (r'hidden/kernel', ('unsharded', 'model')),
         (r'hidden/bias', ('model',)),
         (r'scale/scale', ('model',)),
         (r'logits/kernel', ('model', 'unsharded'))]
# Plain Adam (no warmup, decay or clipping) so Keras' own Adam is the reference.
ADAM = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, decay='constant', clip_norm=0.0,
                       beta1=0.9, beta2=0.99, epsilon=1e-8)
BATCH, STEPS, SEED = 8, 3, 5


def keras_trainer(mesh, rules):
  return make_trainer(model=keras_models.KerasModel(build_fn=models.token_classifier),
                 mesh=mesh, rules=LayoutRules(rules), task=tasks.FirstTokenTask(),
                 optimizer=ADAM,
                 config=TrainConfig(num_steps=STEPS, batch_size=BATCH, seed=SEED,
                                    eval_every=0, eval_batches=1, log_every=1))


def reference_training(task):
  """The same model and data in plain Keras on TF (no DTensor): losses, weights."""
  keras.backend.clear_session()
  keras.utils.set_random_seed(SEED)
  model = models.token_classifier()
  optimizer = keras.optimizers.Adam(learning_rate=1e-2, beta_1=0.9, beta_2=0.99,
                                    epsilon=1e-8)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  losses = []
  for step in range(STEPS):
    batch = task.features(split='train', step=step, batch_size=BATCH)
    with tf.GradientTape() as tape:
      loss = loss_fn(batch['label'], model(batch['tokens'], training=True))
    grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    losses.append(float(loss))
  return losses, {w.path: w.numpy() for w in model.weights}, model


@pytest.fixture(scope='module')
def sharded(mesh_2x4):
  trainer = keras_trainer(mesh_2x4, RULES)
  losses = [float(to_numpy(trainer.train_step(trainer.task.features(
      split='train', step=step, batch_size=BATCH))[0])) for step in range(STEPS)]
  return trainer, losses


def test_weights_are_born_with_their_rule_layouts(sharded):
  trainer, _ = sharded
  specs = {path: tuple(v.layout.sharding_specs) for path, v in trainer.engine.variables.items()}
  assert specs == {'embed/embeddings': ('unsharded', 'model'),
                   'hidden/kernel': ('unsharded', 'model'), 'hidden/bias': ('model',),
                   'scale/scale': ('model',), 'logits/kernel': ('model', 'unsharded'),
                   'logits/bias': ('unsharded',)}
  # Optimizer slots follow the weights' layouts.
  assert trainer.engine.optimizer.m['hidden/kernel'].layout == trainer.engine.variables['hidden/kernel'].layout
  assert [r.source.split(':')[0] for r in trainer.engine.layout_records][-1] == 'default'


def test_sharded_training_equals_plain_keras(sharded):
  trainer, losses = sharded
  ref_losses, ref_weights, _ = reference_training(trainer.task)
  # measured: - / 9e-08 / 9e-08 (default / no oneDNN / 1 thread)
  assert_close(losses, ref_losses, rel=1e-06, what='losses')
  assert losses[-1] < losses[0]
  assert set(ref_weights) == set(trainer.engine.variables)
  for path, value in ref_weights.items():
    # measured: - / 8e-07 / 8e-07 (default / no oneDNN / 1 thread)
    assert_close(to_numpy(trainer.engine.variables[path]), value, rel=1e-05,
                 what=f'weights: {path}')


def test_checkpoint_restores_into_another_mesh_exactly(tmp_path, sharded, mesh_data8):
  trainer, _ = sharded
  saver = Checkpointer(directory=str(tmp_path / 'ckpt'), state=trainer.state(),
                       config=CheckpointConfig())
  saver.save(STEPS, reason='final')
  expected = {k: to_numpy(v) for k, v in checkpoint_lib.checkpoint_keys(trainer.state()).items()}
  assert 'model/by_path/hidden.Skernel/.ATTRIBUTES/VARIABLE_VALUE' in expected

  fresh = keras_trainer(mesh_data8, [(r'hidden/kernel', ('data', 'unsharded'))])
  restorer = Checkpointer(directory=str(tmp_path / 'ckpt'), state=fresh.state(),
                          config=CheckpointConfig())
  assert restorer.restore_latest() == STEPS
  assert fresh.engine.variables['hidden/kernel'].layout.sharding_specs == ['data', 'unsharded']
  for key, value in checkpoint_lib.checkpoint_keys(fresh.state()).items():
    np.testing.assert_array_equal(to_numpy(value), expected[key], err_msg=key)
  # The Keras model itself computes with the restored weights.
  batch = fresh.task.features(split='eval', step=0, batch_size=BATCH)
  # measured: - / 0 / 0 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(fresh.engine.evaluate(fresh.engine.pack(batch))[0]),
               to_numpy(trainer.engine.evaluate(trainer.engine.pack(batch))[0]), rel=1e-06,
               what='eval loss')


def test_plan_lists_the_weights_without_allocating(sharded):
  trainer, _ = sharded
  created = []

  def counting_creator(next_creator, **kwargs):
    created.append(kwargs.get('name'))
    return next_creator(**kwargs)

  with tf.variable_creator_scope(counting_creator):
    records = keras_models.plan(keras_models.KerasModel(build_fn=models.token_classifier),
                                rules=LayoutRules(RULES), mesh_axes={'data': 2, 'model': 4},
                                input_specs=trainer.task.input_specs(BATCH))
  assert created == []
  assert [(r.path, r.shape, r.spec) for r in records] == [
      (r.path, r.shape, r.spec) for r in trainer.engine.layout_records]


def test_subclassed_model_built_on_first_call_is_laid_out_and_planned(mesh_data8):
  model = keras_models.KerasModel(build_fn=models.subclassed_point_classifier)
  task = tasks.CentroidTask()
  rules = LayoutRules([(r'.*hidden/kernel', ('unsharded', 'data'))])
  trainer = make_trainer(model=model, mesh=mesh_data8, rules=rules, task=task,
                    optimizer=ADAM, config=TrainConfig(num_steps=1, batch_size=BATCH, seed=SEED))
  [kernel_path] = [p for p in trainer.engine.variables if p.endswith('hidden/kernel')]
  assert trainer.engine.variables[kernel_path].layout.sharding_specs == ['unsharded', 'data']
  planned = keras_models.plan(model, rules=rules, mesh_axes={'data': 8},
                              input_specs=task.input_specs(BATCH))
  assert [(r.path, r.shape, r.spec) for r in planned] == [
      (r.path, r.shape, r.spec) for r in trainer.engine.layout_records]

  keras.backend.clear_session()
  keras.utils.set_random_seed(SEED)
  reference = models.subclassed_point_classifier()      # plain Keras, no DTensor
  batch = task.features(split='eval', step=0, batch_size=BATCH)
  outputs = trainer.engine.program.model.call(trainer.task.model_inputs(trainer.engine.pack(batch)), False)
  # measured: - / 6e-08 / 6e-08 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(outputs), reference(batch['x']).numpy(), rel=1e-06,
               what='outputs')
