"""What tests/test_tf_internals.py runs in a process of its own: each case
needs TensorFlow's process-wide state as a fresh process has it (Grappler's
defaults; no all-gather lowering decided yet), which the tests' shared
process no longer has. It prints `RESULT <json>` last.

    python -m tests.tf_internals_child sums             # without keep_sums_whole
    python -m tests.tf_internals_child kept             # with it (build_mesh)
    python -m tests.tf_internals_child gathers          # a process whose first mesh is data=8
    python -m tests.tf_internals_child gathers_2d       # ... is data=2 x model=4
    python -m tests.tf_internals_child store 0 localhost:9001,localhost:9002   # one client
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

import numpy as np


def collective_ops(run: Callable[[], object]) -> set[str]:
  """The collective op types in the functions TensorFlow compiles and runs
  during `run()` (its run metadata: the graphs after DTensor's expansion)."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
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


def gather_ops(mesh) -> tuple[set[str], bool]:
  """A [16, 4] value split by rows over `mesh`'s one axis, gathered back to
  replicated in a function: the collectives it compiled to, and whether the
  gathered value is the value."""
  from layout_core.lazy import dtensor, tf  # pylint: disable=g-import-not-at-top
  from layout_core.layout.mesh import pack_global_array  # pylint: disable=g-import-not-at-top
  from layout_core.layout.variables import to_numpy  # pylint: disable=g-import-not-at-top
  value = np.arange(64, dtype=np.float32).reshape(16, 4)
  sharded = pack_global_array(value, dtensor.Layout([mesh.dim_names[0], 'unsharded'], mesh))
  gather = tf.function(lambda x: dtensor.relayout(x, dtensor.Layout.replicated(mesh, 2)))
  result = []
  ops = collective_ops(lambda: result.append(to_numpy(gather(sharded))))
  return ops, bool(np.array_equal(result[0], value))


def first_error(run: Callable[[], object]) -> str:
  try:
    run()
  except Exception as e:  # pylint: disable=broad-except
    return f'{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}'
  return ''


def sums() -> dict:
  """The sharded sum of four gradients (bench/limits/grappler_addn_limit.py) with
  TensorFlow's defaults: no `keep_sums_whole`. (Not retried with it here:
  DTensor keeps the function it compiled, failure included, by the
  function's fingerprint; `kept` runs it with it.)"""
  from bench.limits.grappler_addn_limit import sum_of_four_error  # pylint: disable=g-import-not-at-top
  from layout_core.lazy import dtensor  # pylint: disable=g-import-not-at-top
  from layout_core.layout.mesh import configure_virtual_cpus  # pylint: disable=g-import-not-at-top
  configure_virtual_cpus(8)
  mesh = dtensor.create_mesh([('data', 8)], device_type='CPU')  # not build_mesh: TF's defaults
  worst = []
  error = first_error(lambda: worst.append(sum_of_four_error(mesh, ['data', 'unsharded'], 4096)[0]))
  return {'error': error, 'max_error': worst[0] if worst else None}


def rewrites() -> dict:
  """The Grappler options functions compile with now (the eager context's)."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  options = context.context().config.graph_options.rewrite_options
  return {name: getattr(options, name) for name in (
      'memory_optimization', 'layout_optimizer', 'implementation_selector',
      'disable_tfg_optimizer', 'meta_optimizer_iterations', 'constant_folding',
      'arithmetic_optimization', 'remapping')}


def kept() -> dict:
  """The same sum on a mesh from `build_mesh`, which calls `keep_sums_whole`
  and `trim_graph_passes` first; and the Grappler options in force at three
  points: TensorFlow's, after `trim_graph_passes('GPU')` (unchanged), and
  after `build_mesh`."""
  from bench.limits.grappler_addn_limit import sum_of_four_error  # pylint: disable=g-import-not-at-top
  from layout_core.layout.mesh import MeshSpec, build_mesh, configure_virtual_cpus  # pylint: disable=g-import-not-at-top
  from layout_core import tf_internals  # pylint: disable=g-import-not-at-top
  configure_virtual_cpus(8)
  before = rewrites()
  tf_internals.trim_graph_passes('GPU')
  after_gpu = rewrites()
  mesh = build_mesh(MeshSpec(shape={'data': 8}))
  found = []
  error = first_error(lambda: found.append(sum_of_four_error(mesh, ['data', 'unsharded'], 4096)))
  return {'error': error, 'max_error': found[0][0] if found else None,
          'specs': found[0][1] if found else None,
          'rewrites': {'default': before, 'gpu': after_gpu, 'build_mesh': rewrites()}}


def gathers() -> dict:
  """A process whose first mesh is `data=8`: how its gathers compile, an
  engine's update called directly included; then what it does with a
  mesh of two axes."""
  import os  # pylint: disable=g-import-not-at-top
  from layout_core import tf_internals  # pylint: disable=g-import-not-at-top
  from layout_core.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from layout_core.lazy import dtensor, tf  # pylint: disable=g-import-not-at-top
  from layout_core.layout.mesh import MeshSpec, build_mesh, pack_global_array  # pylint: disable=g-import-not-at-top
  from layout_core.layout.rules import LayoutRules  # pylint: disable=g-import-not-at-top
  from layout_core.layout.variables import to_numpy  # pylint: disable=g-import-not-at-top
  from layout_core.model.lm import transformer_lm_params  # pylint: disable=g-import-not-at-top
  from layout_core.optim import OptimizerConfig  # pylint: disable=g-import-not-at-top
  from layout_core.run import make_trainer  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.lm import MarkovTask  # pylint: disable=g-import-not-at-top
  from layout_core.train.config import TrainConfig  # pylint: disable=g-import-not-at-top
  result = {'inherited': os.environ.get(tf_internals.GATHER_LOWERING)}
  mesh = build_mesh(MeshSpec(shape={'data': 8}))
  result['decision'] = list(tf_internals.lower_gathers_once(False, reason='a later call'))
  result['variable'] = os.environ.get(tf_internals.GATHER_LOWERING)
  result['gather_ops'], result['gather_right'] = gather_ops(mesh)

  trainer = make_trainer(
      model=transformer_lm_params(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64,
                                  num_layers=1, max_len=16),
      mesh=mesh, rules=LayoutRules([]), task=MarkovTask(vocab_size=32, seq_len=16, seed=3),
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0, shard_state=True),
      config=TrainConfig(num_steps=2, batch_size=8, eval_batches=1))
  engine = trainer.engine
  result['state_sharded'] = engine.optimizer.unsharded_state != engine.optimizer.paths
  _, _, grads = engine.loss_and_gradients(
      engine.pack({'tokens': trainer.task.batch(step=0, batch_size=8)}))
  result['update_ops'] = collective_ops(lambda: to_numpy(engine.apply_gradients(grads)[1]))

  try:
    build_mesh(MeshSpec(shape={'data': 2, 'model': 4}))
    result['two_axes_refused'] = ''
  except ConfigError as e:
    result['two_axes_refused'] = str(e)
  # Why it refuses: the same process's lowering on a 2-D mesh made without build_mesh.
  two = dtensor.create_mesh([('data', 2), ('model', 4)], device_type='CPU')
  value = np.arange(8 * 8 * 16, dtype=np.float32).reshape(8, 8, 16)
  split = pack_global_array(value, dtensor.Layout(['data', 'model', 'unsharded'], two))
  result['two_axes_error'] = first_error(lambda: to_numpy(tf.function(
      lambda x: dtensor.relayout(x, dtensor.Layout.replicated(two, 3)))(split)))
  return result


def gathers_2d() -> dict:
  """A process whose first mesh is `data=2 x model=4`, started with the
  variable set (as a parent process that chose CollectiveGatherV2 leaves
  it): what it decides, and a 2-D relayout that the variable would break."""
  import os  # pylint: disable=g-import-not-at-top
  from layout_core import tf_internals  # pylint: disable=g-import-not-at-top
  from layout_core.lazy import dtensor, tf  # pylint: disable=g-import-not-at-top
  from layout_core.layout.mesh import MeshSpec, build_mesh, pack_global_array  # pylint: disable=g-import-not-at-top
  from layout_core.layout.variables import to_numpy  # pylint: disable=g-import-not-at-top
  result = {'inherited': os.environ.get(tf_internals.GATHER_LOWERING)}
  two = build_mesh(MeshSpec(shape={'data': 2, 'model': 4}))
  result['decision'] = list(tf_internals.lower_gathers_once(True, reason='a later call'))
  result['variable'] = os.environ.get(tf_internals.GATHER_LOWERING)
  value = np.arange(8 * 8 * 16, dtype=np.float32).reshape(8, 8, 16)
  split = pack_global_array(value, dtensor.Layout(['data', 'model', 'unsharded'], two))
  gathered = []
  result['two_axes_error'] = first_error(lambda: gathered.append(to_numpy(tf.function(
      lambda x: dtensor.relayout(x, dtensor.Layout.replicated(two, 3)))(split))))
  result['two_axes_right'] = bool(gathered) and bool(np.array_equal(gathered[0], value))
  return result


def store(client_id: int, addresses: list[str]) -> dict:
  """One client of a CPU cluster of len(addresses), one device each:
  every client's value through `cluster.exchange` (the coordination
  service's key-value store), twice (a second key, as `gather_text` makes).
  Then two exchanges after which client 0 leaves, as on settings that
  differ, while the others read once more a second later: after the first,
  client 0 waits in `settle_before_leaving`; after the second (the control)
  it leaves at once, ending the service. `late` is what each late read got."""
  import time  # pylint: disable=g-import-not-at-top
  from layout_core import tf_internals  # pylint: disable=g-import-not-at-top
  from layout_core.layout import cluster  # pylint: disable=g-import-not-at-top
  spec = cluster.ClusterSpec(client_id=client_id, addresses=tuple(addresses), init_timeout=60)
  cluster.connect(spec, device_type='CPU', num_local_devices=1)
  first = cluster.exchange(spec, key='probe/1', value=f'client {client_id}', timeout=30)
  second = cluster.exchange(spec, key='probe/2', value=str(10 * client_id), timeout=30)
  result = {'first': first, 'second': second}
  for key, settle in (('probe/3', True), ('probe/4', False)):
    if client_id == 0:
      cluster.exchange(spec, key=key, value='stop', timeout=30)
      if settle:
        cluster.settle_before_leaving(spec, key=key, timeout=30)
      continue  # main() leaves after the last
    try:  # in the control, the exchange itself may be what fails
      cluster.exchange(spec, key=key, value='stop', timeout=30)
      time.sleep(1.0)
      late = tf_internals.get_key_value(f'meshgin/{key}/0', timeout_s=5)
    except Exception as e:  # pylint: disable=broad-except
      late = type(e).__name__
    result.setdefault('late', []).append(late)
    if settle:
      cluster.settle_before_leaving(spec, key=key, timeout=30)
  return result


def main(argv: list[str]) -> None:
  case, *args = argv
  if case == 'store':
    result = store(int(args[0]), args[1].split(','))
  else:
    result = {'sums': sums, 'kept': kept, 'gathers': gathers, 'gathers_2d': gathers_2d}[case]()
  result = {k: sorted(v) if isinstance(v, set) else v for k, v in result.items()}
  print('RESULT ' + json.dumps(result), flush=True)
  if case == 'store':
    os._exit(0)  # pylint: disable=protected-access  # at once, as launch.train's clients do


if __name__ == '__main__':
  main(sys.argv[1:])
