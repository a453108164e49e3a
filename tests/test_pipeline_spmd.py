"""The SPMD stage-axis engine against plain TF (no DTensor, no pipeline)."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from layout_core.checkpoint import manager as checkpoint_lib
from layout_core.layout import mesh as mesh_lib
from layout_core.tasks.lm import MarkovTask
from layout_core.errors import ConfigError
from layout_core.model.base import Sequential
from layout_core.model.layers import FeedForward
from layout_core.model.lm import transformer_lm_params
from layout_core.model.random import random_context
from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.optim import OptimizerConfig
from layout_core.pipeline import PipelineConfig, clock_order
from layout_core.pipeline.spmd import STACKED, SpmdPipeline, StackedCells
from layout_core.layout.rules import LayoutRules
from layout_core.tasks import softmax_cross_entropy as cross_entropy
from layout_core.train.config import TrainConfig
from layout_core.run import make_trainer
from layout_core.layout.variables import to_numpy
from tests.numerics import assert_close
from tests.test_layout_scope import MEGATRON

MESH_SHAPES = {2: {'stage': 2, 'data': 2, 'model': 2}, 4: {'stage': 4, 'data': 2}}
BATCH, SEQ, VOCAB, SEED = 16, 4, 16, 123


def tiny_lm(num_layers: int, dropout_rate: float = 0.2):
  return transformer_lm_params(vocab_size=VOCAB, model_dim=8, num_heads=2, ffn_dim=16,
                               num_layers=num_layers, max_len=SEQ,
                               dropout_rate=dropout_rate)


@pytest.fixture(scope='module')
def meshes(devices8):
  return {s: build_mesh(MeshSpec(shape=shape)) for s, shape in MESH_SHAPES.items()}


def spmd_trainer(mesh, params, *, stages, micro, repeats, bubble_fill=float('nan'),
                 batch_size=BATCH):
  rules = MEGATRON if 'model' in mesh.dim_names else []  # Megatron cells on the 3-D mesh
  return make_trainer(
      pipeline=PipelineConfig(num_stages=stages, num_micro_batches=micro, engine='spmd',
                              circular_repeats=repeats),
      bubble_fill=bubble_fill, model=params, mesh=mesh,
      rules=LayoutRules(rules), task=MarkovTask(vocab_size=VOCAB, seq_len=SEQ, seed=3),
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
      config=TrainConfig(num_steps=3, batch_size=batch_size, log_every=1, eval_every=0,
                         eval_batches=1))


def spmd_loss_and_gradients(trainer, tokens):
  """Loss and per-cell gradients (path -> array) of one training step's loss."""
  seed = mesh_lib.pack_global_array(np.int64(SEED),
                                    dtensor.Layout.replicated(trainer.engine.mesh, 0))

  @tf.function
  def run(tokens, seed):
    with tf.GradientTape() as tape, random_context(seed=seed):
      loss = trainer.engine.loss_and_metrics(tokens)[0]
    return loss, tape.gradient(loss, trainer.engine.trainable)

  loss, grads = run(trainer.engine.pack({'tokens': tokens}), seed)
  by_path = dict(zip((p for p, v in trainer.engine.variables.items() if v.trainable), grads))
  result = {}
  for path, grad in by_path.items():
    value = to_numpy(grad)
    if f'/{STACKED}/' not in path:
      result[path] = value
      continue
    relative = path.split(f'/{STACKED}/', 1)[1]
    for layer, slot in enumerate(trainer.engine.program.stack.slots):
      result[trainer.engine.program.stack.cell_variable_path(layer, relative)] = value[slot.stage, slot.row]
  return float(to_numpy(loss)), result


def plain_loss_and_gradients(params, tokens):
  model = params.Instantiate()  # plain tf.Variables; initial values are layout-free
  tokens = tf.constant(tokens)
  with tf.GradientTape() as tape, random_context(seed=tf.constant(SEED, tf.int64)):
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
  grads = tape.gradient(loss, model.trainable_variables)
  return float(loss), {v.name.split(':')[0].replace('.', '/'): tf.convert_to_tensor(g).numpy()
                       for v, g in zip(model.trainable_variables, grads)}


# (stages, circular repeats) -> the micro-batch counts run: fewer, as many and more
# micro-batches than stages, one micro-batch alone, and 4 stages with 2 repeats.
CASES = {(2, 1): [1, 2, 8], (4, 1): [2, 4, 8], (4, 2): [4, 8]}
WIDTH = 8


def feed_forward_cells(count: int) -> list:
  return [FeedForward.Params().Set(name=f'fc_{i:03d}', input_dim=WIDTH, hidden_dim=2 * WIDTH)
          for i in range(count)]


@pytest.mark.parametrize('stages,repeats', list(CASES))
def test_spmd_loss_and_every_gradient_equal_plain_tf(stages, repeats, meshes):
  """The engine on a stack of feed-forward cells (Megatron-sharded on the 3-D
  mesh) against the same cells in plain TF, for each case's M. Bubble slots hold
  NaN, so reading one anywhere would poison the loss or a gradient. Two cells
  per chunk, so chunks are more than one cell."""
  mesh = meshes[stages]
  cells = feed_forward_cells(2 * stages * repeats)
  rules = LayoutRules([(r'.*/w_in', ('unsharded', 'model')),
                       (r'.*/w_out', ('model', 'unsharded'))] if 'model' in mesh.dim_names
                      else [])
  stack = StackedCells(cells, parent_path='net', mesh=mesh, rules=rules, num_stages=stages,
                       repeats=repeats, batch_axis='data')
  plain = Sequential.Params().Set(name='stack', sub=cells).Instantiate(parent_path='net')
  rng = np.random.RandomState(stages * 10 + repeats)
  x = rng.randn(BATCH, SEQ, WIDTH).astype(np.float32)
  target = rng.randn(BATCH, SEQ, WIDTH).astype(np.float32)
  with tf.GradientTape() as tape:
    ref_loss = tf.reduce_mean((plain(tf.constant(x)) - target) ** 2)
  ref_grads = dict(zip((v.name.split(':')[0].replace('.', '/') for v in plain.trainable_variables),
                       (g.numpy() for g in tape.gradient(ref_loss, plain.trainable_variables))))
  variables = list(stack.stacked_variables.values())
  for micro in CASES[stages, repeats]:
    engine = SpmdPipeline(stack, num_micro_batches=micro, bubble_fill=float('nan'))
    layout = dtensor.Layout(['unsharded', 'data', 'unsharded', 'unsharded'], mesh)
    xs = mesh_lib.pack_global_array(x.reshape((micro, -1, SEQ, WIDTH)), layout)
    ts = mesh_lib.pack_global_array(target.reshape((micro, -1, SEQ, WIDTH)), layout)

    @tf.function
    def run(xs, ts):
      with tf.GradientTape() as tape:
        outputs = engine([tf.gather(xs, m) for m in range(micro)])  # not xs[m]: see spmd.py
        loss = tf.add_n([tf.reduce_mean((y - tf.gather(ts, m)) ** 2)
                         for m, y in enumerate(outputs)]) / micro
      return loss, tape.gradient(loss, variables)

    loss, grads = run(xs, ts)
    # measured: - / 1e-07 / 1e-07 (default / no oneDNN / 1 thread)
    assert_close(float(to_numpy(loss)), float(ref_loss), rel=2e-06,
                 what=f'loss: M={micro}')
    for path, grad in zip(stack.stacked_variables, grads):
      value, relative = to_numpy(grad), path.split(f'/{STACKED}/', 1)[1]
      for layer, slot in enumerate(stack.slots):
        cell_path = stack.cell_variable_path(layer, relative)
        # measured: - / 5e-07 / 5e-07 (default / no oneDNN / 1 thread)
        assert_close(value[slot.stage, slot.row], ref_grads[cell_path], rel=5e-06,
                     what=f'gradients: M={micro} {cell_path}')


def test_spmd_lm_with_dropout_equals_plain_tf(meshes):
  """The whole LM (embedding and softmax outside the stack, attention, layer
  norms and dropout in the stacked cells), 2 circular repeats, M = 4 > S (so
  stage S-1's outputs wait before they return to stage 0)."""
  params = tiny_lm(4)
  trainer = spmd_trainer(meshes[2], params, stages=2, micro=4, repeats=2)
  tokens = trainer.task.batch(step=0, batch_size=BATCH)
  ref_loss, ref_grads = plain_loss_and_gradients(params, tokens)
  loss, grads = spmd_loss_and_gradients(trainer, tokens)
  # measured: - / 9e-08 / 9e-08 (default / no oneDNN / 1 thread)
  assert_close(loss, ref_loss, rel=1e-06, what='loss')
  assert grads.keys() == ref_grads.keys()
  for path, ref in ref_grads.items():
    # measured: - / 4e-07 / 4e-07 (default / no oneDNN / 1 thread)
    assert_close(grads[path], ref, rel=5e-06, what=f'gradients: {path}')


def test_the_nan_poison_is_live(meshes, monkeypatch):
  """Without masking bubble slots the NaN fill reaches the gradients: the
  equality tests above would see a schedule that reads a bubble."""
  from layout_core.pipeline import spmd
  trainer = spmd_trainer(meshes[2], tiny_lm(2), stages=2, micro=2, repeats=1)
  monkeypatch.setattr(spmd.SpmdPipeline, '_busy_mask', lambda self, items, rank: None)
  _, grads = spmd_loss_and_gradients(trainer, trainer.task.batch(step=0, batch_size=BATCH))
  assert any(np.isnan(g).any() for g in grads.values())


def test_circular_placement_and_bubble():
  from layout_core.pipeline.spmd import cell_slot
  # 8 cells, 2 stages, 2 repeats, 2 cells per chunk: stage 0 holds chunks 0 and 2.
  stages = [cell_slot(l, num_stages=2, cells_per_chunk=2).stage for l in range(8)]
  assert stages == [0, 0, 1, 1, 0, 0, 1, 1]
  order = clock_order(2, 4, repeats=2)
  assert len(order) == 2 * 4 + 2 - 1
  busy = sum(len(work) for work in order)
  assert 1 - busy / (2 * len(order)) == pytest.approx(1 / 9)


def test_spmd_config_errors(meshes):
  with pytest.raises(ConfigError, match='needs at least as many micro-batches as stages'):
    spmd_trainer(meshes[4], tiny_lm(8), stages=4, micro=2, repeats=2, batch_size=8)
  with pytest.raises(ConfigError, match='3 cells do not split into 2 stages x 1'):
    spmd_trainer(meshes[2], tiny_lm(3), stages=2, micro=2, repeats=1)
  with pytest.raises(ConfigError, match='4 cells do not split into 2 stages x 4'):
    spmd_trainer(meshes[2], tiny_lm(4), stages=2, micro=4, repeats=4)
  from layout_core.model.lm import transformer_block_params
  cells = [transformer_block_params(ffn_dim=16), transformer_block_params(ffn_dim=32)]
  mixed = transformer_lm_params(vocab_size=VOCAB, model_dim=8, num_layers=2, max_len=SEQ,
                                cells=cells)
  with pytest.raises(ConfigError, match='stacks identical cells, but block_001 differs'):
    spmd_trainer(meshes[2], mixed, stages=2, micro=2, repeats=1)
  with pytest.raises(ConfigError, match='circular_repeats=2 needs the SPMD engine'):
    PipelineConfig(num_stages=2, circular_repeats=2)


def key_values(trainer) -> dict:
  """Checkpoint key -> the value a save would write (a slice of a stacked variable)."""
  return checkpoint_lib.checkpoint_values(trainer.state())


def scramble(trainer, seed: int) -> None:
  """Every variable a checkpoint holds set to its own random values, the step
  counters to `seed` + 1: what training would change, without compiling a step."""
  from layout_core.checkpoint.shard_io import assign_global, checkpoint_entries
  rng = np.random.default_rng(seed)
  for entry in checkpoint_entries(trainer.state()):
    variable = entry.variable
    if variable.dtype.is_floating:
      value = rng.normal(size=variable.shape.as_list())
    else:
      value = np.full(variable.shape.as_list(), seed + 1)
    assign_global(variable, value.astype(variable.dtype.as_numpy_dtype))


def test_checkpoints_move_between_spmd_plain_and_submesh_runs(meshes, tmp_path):
  from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer

  params = tiny_lm(4)
  kwargs = dict(model=params, rules=LayoutRules(MEGATRON),
                task=MarkovTask(vocab_size=VOCAB, seq_len=SEQ, seed=3),
                optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
                config=TrainConfig(num_steps=3, batch_size=BATCH, eval_every=0))
  spmd = spmd_trainer(meshes[2], params, stages=2, micro=2, repeats=2, bubble_fill=None)
  scramble(spmd, seed=0)  # weights and slots move
  saved = key_values(spmd)
  assert 'model/stack/block_003/ffn/w_in/.ATTRIBUTES/VARIABLE_VALUE' in saved
  assert not any(STACKED in key for key in saved)

  def round_trip(source, target, directory) -> None:
    Checkpointer(directory=str(directory), state=source.state(),
                 config=CheckpointConfig()).save(source.current_step, reason='final')
    restored = Checkpointer(directory=str(directory), state=target.state(),
                            config=CheckpointConfig()).restore_latest()
    assert restored == source.current_step
    expected, actual = key_values(source), key_values(target)
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
      np.testing.assert_array_equal(actual[key], value, err_msg=key)

  plain = make_trainer(mesh=build_mesh(MeshSpec(shape={'data': 4, 'model': 2})), **kwargs)
  round_trip(spmd, plain, tmp_path / 'spmd_to_plain')
  submesh = make_trainer(pipeline=PipelineConfig(num_stages=2, num_micro_batches=2),
                            mesh=meshes[2], **kwargs)
  round_trip(spmd, submesh, tmp_path / 'spmd_to_submesh')
  scramble(plain, seed=1)  # now unlike spmd's
  round_trip(plain, spmd, tmp_path / 'plain_to_spmd')
  round_trip(submesh, spmd, tmp_path / 'submesh_to_spmd')  # back to seed 0's values
