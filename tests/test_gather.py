"""`gather_together` against DTensor's own relayout, one tensor at a time;
and the gather lowering an engine's update compiles with (`gather_lowering`)."""

import os
from typing import Callable

import numpy as np
import pytest
from tensorflow.python.eager import context  # run metadata: the compiled graphs

from layout_core.lazy import dtensor, tf
from layout_core.layout.gather import gather_together
from layout_core.layout.mesh import GATHER_LOWERING, pack_global_array
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model.lm import transformer_lm_params
from layout_core.optim import OptimizerConfig
from layout_core.run import make_trainer
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig


def cases(mesh_data8, mesh_2x4):
  """(global value, its layout, target layout): shards split on their first,
  middle and last dims, several dtypes, a replicated value, a partly sharded
  target and a 2-D mesh (relaid one by one, or bucketed by axis)."""
  rng = np.random.RandomState(0)
  L = dtensor.Layout
  u = 'unsharded'
  return [
      (rng.randn(16, 3), L(['data', u], mesh_data8), L([u, u], mesh_data8)),
      (rng.randn(5, 24), L([u, 'data'], mesh_data8), L([u, u], mesh_data8)),
      (rng.randn(2, 8, 3), L([u, 'data', u], mesh_data8), L([u, u, u], mesh_data8)),
      (rng.randn(8), L(['data'], mesh_data8), L([u], mesh_data8)),
      (rng.randint(0, 9, (8, 2)).astype(np.int32), L(['data', u], mesh_data8),
       L([u, u], mesh_data8)),
      (rng.randn(4, 4), L([u, u], mesh_data8), L([u, u], mesh_data8)),
      (rng.randn(4, 8), L(['data', 'model'], mesh_2x4), L([u, 'model'], mesh_2x4)),
      (rng.randn(4, 8), L(['data', u], mesh_2x4), L([u, u], mesh_2x4)),
      (rng.randn(6, 8), L([u, 'model'], mesh_2x4), L([u, u], mesh_2x4)),
  ]


@pytest.mark.parametrize('bucket_bytes', [1 << 20, 200])
def test_gather_together_equals_relayout_one_by_one(mesh_data8, mesh_2x4, bucket_bytes):
  """Every value and layout is what `dtensor.relayout` gives, whether all
  shards share one bucket or most get their own (200 bytes)."""
  setups = cases(mesh_data8, mesh_2x4)
  values = [pack_global_array(v.astype(v.dtype if v.dtype == np.int32 else np.float32), src)
            for v, src, _ in setups]
  sources = [src for _, src, _ in setups]
  targets = [dst for _, _, dst in setups]
  together = tf.function(lambda *xs: gather_together(xs, sources, targets,
                                                     bucket_bytes=bucket_bytes))(*values)
  one_by_one = tf.function(
      lambda *xs: [dtensor.relayout(x, t) for x, t in zip(xs, targets)])(*values)
  for (expected, _, target), got, reference in zip(setups, together, one_by_one):
    assert dtensor.fetch_layout(got) == target
    np.testing.assert_array_equal(to_numpy(got), expected.astype(to_numpy(got).dtype))
    # Each device's local piece too, not only the assembled value.
    for mine, theirs in zip(dtensor.unpack(got), dtensor.unpack(reference)):
      np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def collective_ops(run: Callable[[], object]) -> set[str]:
  """The collective op types in the functions TensorFlow compiles and runs
  during `run()` (its run metadata: the graphs after DTensor's expansion)."""
  context.enable_run_metadata()
  try:
    run()
    metadata = context.export_run_metadata()
  finally:
    context.disable_run_metadata()
  found = set()
  for function in metadata.function_graphs:
    for graph in (*function.partition_graphs, function.pre_optimization_graph,
                  function.post_optimization_graph):
      found |= {node.op for node in graph.node}
      found |= {node.op for library in graph.library.function for node in library.node_def}
  return {op for op in found if op.startswith('Collective')}


def test_an_engine_update_called_directly_compiles_its_gathers_to_collective_gather(
    mesh_data8):
  """`engine.apply_gradients` called on its own, as the engine docstring
  shows (no training loop around it), compiles sharded state's gather back
  on a one-axis mesh as CollectiveGatherV2: the update owns its lowering.
  Positive control: a gather compiled outside any engine's update is
  DTensor's default, a CollectiveReduceV2, so the op seen is the lowering's."""
  trainer = make_trainer(
      model=transformer_lm_params(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64,
                                  num_layers=1, max_len=16),
      mesh=mesh_data8, rules=LayoutRules([]), task=MarkovTask(vocab_size=32, seq_len=16, seed=3),
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0, shard_state=True),
      config=TrainConfig(num_steps=2, batch_size=8, eval_batches=1))
  engine = trainer.engine
  assert engine.optimizer.unsharded_state != engine.optimizer.paths  # some state is sharded
  _, _, grads = engine.loss_and_gradients(
      engine.pack({'tokens': trainer.task.batch(step=0, batch_size=8)}))
  update_ops = collective_ops(lambda: to_numpy(engine.apply_gradients(grads)[1]))
  assert 'CollectiveGatherV2' in update_ops, update_ops
  assert GATHER_LOWERING not in os.environ  # the lowering lasted the call only

  sharded = pack_global_array(np.ones((16, 4), np.float32),
                              dtensor.Layout(['data', 'unsharded'], mesh_data8))
  gather = tf.function(lambda x: dtensor.relayout(x, dtensor.Layout.replicated(mesh_data8, 2)))
  plain_ops = collective_ops(lambda: to_numpy(gather(sharded)))
  assert 'CollectiveReduceV2' in plain_ops and 'CollectiveGatherV2' not in plain_ops, plain_ops
