"""Layers: declared variables, output shapes and FLOPs against independent counts.

The FLOPs reference is counted from the traced TensorFlow graph (every Einsum
/ MatMul op's index sizes, every elementwise op's output size), so it checks
the hand-written `fprop_meta` formulas against what the layer really runs.
"""

import math
import re

import numpy as np
import pytest
import tensorflow as tf

from layout_core import model
from layout_core.errors import ConfigError
from tests.numerics import assert_close

ELEMENTWISE_COST = {'AddV2': 1, 'Add': 1, 'Sub': 1, 'Mul': 1, 'RealDiv': 1,
                    'Relu': 1, 'Softmax': 3}


def graph_flops(fn, *inputs):
  """(matmul FLOPs, elementwise FLOPs) of the ops `fn` runs, from its graph."""
  graph = tf.function(fn).get_concrete_function(*inputs).graph
  matmul = elementwise = 0
  for op in graph.get_operations():
    if op.type == 'Einsum':
      equation = op.get_attr('equation').decode()
      lhs, _ = equation.split('->')
      sizes = {}
      for operand, tensor in zip(lhs.split(','), op.inputs):
        sizes.update(zip(operand, tensor.shape.as_list()))
      matmul += 2 * math.prod(sizes.values())
    elif op.type in ('MatMul', 'BatchMatMulV2'):
      a, b = (t.shape.as_list() for t in op.inputs)
      matmul += 2 * math.prod(op.outputs[0].shape.as_list()) * a[-1]
    elif op.type in ELEMENTWISE_COST:
      shape = op.outputs[0].shape.as_list()
      elementwise += ELEMENTWISE_COST[op.type] * math.prod(shape)
  return matmul, elementwise


def textbook_attention_matmul_flops(batch, length, dim, heads, head_dim):
  """Kaplan et al. (2020), Table 1: 2 * (4 d_model d_attn + 2 n_ctx d_attn) per token."""
  d_attn = heads * head_dim
  return batch * length * 2 * (4 * dim * d_attn + 2 * length * d_attn)


@pytest.mark.parametrize('batch,length,dim,heads', [(2, 16, 32, 4), (3, 8, 48, 6)])
def test_attention_flops_and_shape(batch, length, dim, heads):
  p = model.MultiHeadAttention.Params().Set(model_dim=dim, num_heads=heads)
  meta = p.cls.fprop_meta(p, (batch, length, dim))
  layer = p.Instantiate()
  x = tf.random.normal([batch, length, dim])
  matmul, elementwise = graph_flops(layer.fprop, x)
  assert meta.matmul_flops == matmul
  assert meta.matmul_flops == textbook_attention_matmul_flops(
      batch, length, dim, heads, dim // heads)
  # Elementwise work on the [B, H, T, T] scores dominates; small mask ops aside.
  assert abs(meta.flops - (matmul + elementwise)) <= 0.02 * meta.flops
  assert meta.out_shapes == (tuple(layer(x).shape),)


@pytest.mark.parametrize('shape,hidden', [((4, 8, 16), 64), ((5, 12), 20)])
def test_feed_forward_flops_and_shape(shape, hidden):
  p = model.FeedForward.Params().Set(input_dim=shape[-1], hidden_dim=hidden)
  meta = p.cls.fprop_meta(p, shape)
  layer = p.Instantiate()
  x = tf.random.normal(shape)
  matmul, elementwise = graph_flops(layer.fprop, x)
  tokens = math.prod(shape[:-1])
  assert meta.matmul_flops == matmul == 4 * tokens * shape[-1] * hidden
  assert meta.flops == matmul + elementwise
  assert meta.out_shapes == (tuple(layer(x).shape),)


def test_lm_meta_matches_running_it():
  p = model.transformer_lm_params(vocab_size=32, model_dim=16, num_heads=2,
                                   ffn_dim=32, num_layers=2, max_len=8)
  meta = p.cls.fprop_meta(p, (3, 8))
  lm = p.Instantiate()
  ids = tf.constant(np.random.RandomState(0).randint(0, 32, (3, 8)), tf.int32)
  assert meta.out_shapes == ((3, 8, 32),) == (tuple(lm(ids).shape),)
  matmul, _ = graph_flops(lm.fprop, ids)
  assert meta.matmul_flops == matmul


def test_variable_specs_match_created_variables_and_paths():
  p = model.transformer_lm_params(num_layers=3)
  specs = p.cls.variable_specs(p)
  lm = p.Instantiate()
  created = {v.name.split(':')[0]: tuple(v.shape) for v in lm.variables}
  assert {s.path.replace('/', '.'): s.shape for s in specs} == created
  paths = [s.path for s in specs]
  assert 'lm/stack/block_002/ffn/w_in' in paths and 'lm/emb/table' in paths
  assert model.num_parameters(p) == sum(math.prod(s) for s in created.values())


def test_sequential_rejects_duplicate_names_and_bad_counts():
  ffn = model.FeedForward.Params()
  with pytest.raises(ConfigError, match="two sub-layers named 'ffn'"):
    model.Sequential.Params().Set(sub=[ffn, ffn.Copy()]).Instantiate()
  with pytest.raises(ConfigError, match='repeat is 0'):
    model.Sequential.Params().Set(sub=[ffn], repeat=0).cls.variable_specs(
        model.Sequential.Params().Set(sub=[ffn], repeat=0))


def test_flatten_layers_unrolls_nested_repeats():
  p = model.transformer_lm_params(num_layers=3)
  names = [q.name for q in model.flatten_layers(p)]
  assert names == ['emb', 'block_000', 'block_001', 'block_002', 'final_ln', 'softmax']


def test_initial_values_do_not_depend_on_layout(mesh_2x4):
  from tensorflow.experimental import dtensor
  from layout_core.layout.variables import Normal, VariableSpec, initial_value, to_numpy
  spec = VariableSpec(path='w', shape=(16, 32), initializer=Normal(1.0))
  reference = initial_value(spec, seed=3).numpy()
  assert 0.8 < reference.std() < 1.2 and abs(reference.mean()) < 0.2
  for sharding in (['unsharded', 'model'], ['model', 'data'], ['data', 'unsharded']):
    value = dtensor.call_with_layout(tf.function(lambda: initial_value(spec, 3)),
                                     dtensor.Layout(sharding, mesh_2x4))
    np.testing.assert_array_equal(to_numpy(value), reference)
  assert not np.array_equal(initial_value(spec, seed=4).numpy(), reference)


def test_dropout_masks_follow_rows_and_seeds_and_are_off_outside_training():
  layer = model.Dropout.Params().Set(name='drop', rate=0.25).Instantiate(parent_path='lm')
  x = tf.ones([8, 16, 32])
  np.testing.assert_array_equal(layer(x).numpy(), x.numpy())  # evaluation: identity
  with model.random_context(seed=tf.constant(7, tf.int64)):
    full = layer(x).numpy()
  kept = full != 0
  assert abs(kept.mean() - 0.75) < 0.02
  np.testing.assert_allclose(full[kept], 1 / 0.75)
  # A micro-batch of rows 4..7 draws exactly those rows' masks (pipelining),
  # distinct from rows 0..3; the same seed repeats, another seed does not.
  with model.random_context(seed=tf.constant(7, tf.int64), batch_offset=4):
    np.testing.assert_array_equal(layer(x[4:]).numpy(), full[4:])
  assert (full[:4] != full[4:]).any()
  with model.random_context(seed=tf.constant(7, tf.int64)):
    np.testing.assert_array_equal(layer(x).numpy(), full)
  with model.random_context(seed=tf.constant(8, tf.int64)):
    assert (layer(x).numpy() != full).mean() > 0.2


def test_embedding_positions_follow_the_step_context():
  """Packed documents: each token gets the position row of its place in its
  own document (the step context's sequence), checked against numpy; without
  a context, rows 0..T-1."""
  from layout_core.step_context import SequenceInputs, StepContext, entered
  layer = model.Embedding.Params().Set(vocab_size=11, dim=4, max_len=6).Instantiate(
      parent_path='lm')
  ids = np.array([[3, 1, 4, 1, 5, 9]], np.int32)
  positions = np.array([[0, 1, 2, 0, 1, 0]], np.int32)  # three documents in one row
  table, pos_table = layer.table.numpy(), layer.pos_table.numpy()
  with entered(StepContext(sequence=SequenceInputs(tf.constant([[1, 1, 1, 2, 2, 3]]),
                                                   tf.constant(positions)))):
    packed = layer(tf.constant(ids)).numpy()
  np.testing.assert_allclose(packed, table[ids] + pos_table[positions], rtol=1e-6)
  plain = layer(tf.constant(ids)).numpy()
  np.testing.assert_allclose(plain, table[ids] + pos_table[np.arange(6)][None], rtol=1e-6)
  assert not np.allclose(plain, packed)


def test_one_body_serves_a_layer_and_stacked_cells():
  """TransformerBlock.apply on weights stacked over 2 slots (the SPMD engine's
  SlotWeights) equals each slot's own block run plainly on its own rows, with
  dropout: each slot draws the masks of its own cell path and global rows."""
  from layout_core.pipeline.spmd import SlotRandom, SlotWeights
  p = model.TransformerBlock.Params().Set(model_dim=8, num_heads=2, ffn_dim=16,
                                          dropout_rate=0.3)
  blocks = [p.Copy().Set(name=f'block_{s:03d}').Instantiate(parent_path='lm/stack')
            for s in range(2)]
  x = tf.random.stateless_normal([2, 4, 3, 8], seed=[1, 2])
  seed, first_rows = tf.constant(11, tf.int64), [4, 12]

  def weight(block, relative):
    value = block
    for part in relative.split('/'):
      value = getattr(value, part)
    return value
  stacked = SlotWeights(lambda name: tf.stack([weight(b, name) for b in blocks]),
                        SlotRandom(seed, [b.path for b in blocks], first_rows))
  together = model.TransformerBlock.apply(p, stacked, x)
  for s, block in enumerate(blocks):
    with model.random_context(seed=seed, batch_offset=first_rows[s]):
      alone = block(x[s])
    # measured: - / 6e-09 / 6e-09 (default / no oneDNN / 1 thread)
    assert_close(together[s].numpy(), alone.numpy(), rel=1e-07, what='outputs')
  # The masks are really on: without a random context the outputs differ.
  assert not np.allclose(together[0].numpy(), blocks[0](x[0]).numpy(), atol=1e-3)
