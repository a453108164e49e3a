"""Every workaround in `layout_core.tf_internals`, each with a positive
control: the TensorFlow problem is first shown happening on this machine
without the workaround (a test skips, saying so, only where it cannot show
here), then gone with it.

A case that needs TensorFlow's process-wide state as a fresh process has it
(Grappler's defaults, no all-gather lowering decided yet) runs in a process
of its own, `tests/tf_internals_child.py`, forked from the tests' zygote.

    python -m pytest tests/test_tf_internals.py -q
"""

from __future__ import annotations

import json
import os
import types

import pytest

from layout_core import tf_internals
from layout_core.lazy import tf
from tests.conftest import run_module, run_modules
from tests.tf_internals_child import gather_ops


def child_result(done) -> dict:
  assert done.returncode == 0 and 'RESULT ' in done.stdout, (done.stdout + done.stderr)[-3000:]
  return json.loads(done.stdout.split('RESULT ', 1)[1])


def child(*args: str, env: dict | None = None) -> dict:
  return child_result(run_module('tests.tf_internals_child', *args, env=env))


@pytest.fixture(scope='module')
def grappler_children() -> tuple[dict, dict]:
  """(`sums`, `kept`) of tests/tf_internals_child.py, run side by side."""
  return tuple(child_result(done) for done in run_modules(
      [('tests.tf_internals_child', 'sums'), ('tests.tf_internals_child', 'kept')]))


def test_keep_sums_whole_lets_a_sharded_sum_of_four_gradients_run(grappler_children):
  """The gradient of a weight used four times is an AddN of four sharded
  tensors. With TensorFlow's defaults Grappler's memory optimizer turns it
  into adds to a variable of the global shape, which fails on every shard
  ([4096, 4096] sharded 8 ways: the smallest size bench/limits/grappler_addn_limit.py
  measured to trigger it). With `keep_sums_whole`, which `build_mesh` calls,
  the same gradient is right. Both in processes of their own, with
  Grappler's defaults (this one has its meta optimizer off: tests/conftest.py)."""
  control, kept = grappler_children
  if not control['error']:
    pytest.skip('without keep_sums_whole the sharded sum of four came out right here (max '
                f"error {control['max_error']}): Grappler's memory optimizer did not rewrite "
                'it on this machine, so the problem cannot show')
  assert 'Parameters and update must be the same size' in control['error'], control

  assert not kept['error'], kept
  assert kept['specs'] == ['data', 'unsharded']
  assert kept['max_error'] <= 1e-5


def test_build_mesh_trims_grapplers_passes_on_cpu(grappler_children):
  """`trim_graph_passes`, through `build_mesh` on a CPU mesh: the layout
  optimizer, the implementation selector and the TFG pass off, one round,
  the memory optimizer off (`keep_sums_whole`), the other passes as
  TensorFlow sets them; asked for a GPU mesh, it changes nothing. (Same
  losses bit for bit and the compile it saves: bench/grappler_passes.py.)"""
  from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=g-import-not-at-top
  config = rewriter_config_pb2.RewriterConfig
  rewrites = grappler_children[1]['rewrites']
  default, trimmed = rewrites['default'], rewrites['build_mesh']
  assert rewrites['gpu'] == default, rewrites
  assert trimmed == {**default, 'memory_optimization': config.NO_MEM_OPT,
                     'layout_optimizer': config.OFF, 'implementation_selector': config.OFF,
                     'disable_tfg_optimizer': True, 'meta_optimizer_iterations': config.ONE}, \
      rewrites
  assert default['layout_optimizer'] != config.OFF and not default['disable_tfg_optimizer']


def test_a_process_whose_first_mesh_has_one_axis_gathers_with_collective_gather_v2(mesh_data8):
  """Control, this process (it decided DTensor's default up front,
  tests/conftest.py): a sharded -> replicated relayout compiles to a
  CollectiveReduceV2, the zero-padded all-reduce whose replicated copies
  bench/all_gather_memory.py measures. A process whose first mesh is
  `data=8`: `build_mesh` set the variable once; the same gather, and an
  engine's update called on its own (no training loop around it), compile
  to CollectiveGatherV2, with the same values; a later decision changes
  nothing; a 2-D mesh is refused, because a 2-D relayout under that
  lowering fails to compile."""
  ops, right = gather_ops(mesh_data8)
  assert right and 'CollectiveReduceV2' in ops and 'CollectiveGatherV2' not in ops, ops
  assert tf_internals.lower_gathers_once(True, reason='too late')[0] is False
  assert tf_internals.GATHER_LOWERING not in os.environ

  got = child('gathers')
  assert got['inherited'] is None  # this process's variable was not passed on
  assert got['decision'] == [True, 'its first mesh is CPU mesh 8=8 (data=8)']
  assert got['variable'] == '1'
  assert got['gather_right'] and got['gather_ops'] == ['CollectiveGatherV2'], got
  assert got['state_sharded'] and 'CollectiveGatherV2' in got['update_ops'], got
  assert 'has 2 axes, but this process compiles DTensor all-gathers to CollectiveGatherV2' in (
      got['two_axes_refused']), got
  assert "'tf.Reshape' op requires 'output' number of elements" in got['two_axes_error'], got


def test_a_process_whose_first_mesh_has_two_axes_removes_an_inherited_lowering():
  """The variable inherited from a parent process would make 2-D relayouts
  fail (the control: the same relayout with the variable, by a process that
  kept it, in the test above); a process whose first mesh is 2-D removes it
  before anything compiles, and the relayout is right."""
  got = child('gathers_2d', env={tf_internals.GATHER_LOWERING: '1'})
  assert got['inherited'] == '1'
  assert got['decision'] == [False, 'its first mesh is CPU mesh 2x4=8 (data=2, model=4)']
  assert got['variable'] is None
  assert got['two_axes_error'] == '' and got['two_axes_right'], got


def public_names(module: types.ModuleType, seen: set[int], depth: int = 0) -> list[str]:
  """Public attribute names of TensorFlow's API modules under `module`."""
  if id(module) in seen or depth > 5:
    return []
  seen.add(id(module))
  names = []
  for name in dir(module):
    if name.startswith('_') or name in ('keras', 'compat'):
      continue
    try:
      value = getattr(module, name)
      names.append(name)
      if isinstance(value, types.ModuleType) and value.__name__.startswith('tensorflow'):
        names += public_names(value, seen, depth + 1)
    except Exception:  # pylint: disable=broad-except  # lazy loaders that refuse
      continue
  return names


def test_the_key_value_store_has_no_public_api_and_carries_every_clients_value():
  """Control: TensorFlow's public API has nothing that reaches the
  coordination service's key-value store (were one added, this fails: use
  it instead). Then two one-device CPU clients exchange two values each
  through `cluster.exchange`, which reaches it by `put_key_value` and
  `get_key_value`. Last, client 0 leaves after an exchange while client 1
  still reads: with `settle_before_leaving` the read gets its value; without
  it (the control) client 0's exit ends the store and the read fails."""
  names = public_names(tf, set())
  assert 'function' in names and 'create_mesh' in names  # the walk reached tf and dtensor
  assert not [n for n in names if 'config_key' in n.lower() or 'key_value_store' in n.lower()]

  from launch.local_cluster import free_ports  # pylint: disable=import-outside-toplevel
  cluster = ','.join(f'localhost:{port}' for port in free_ports(2))
  results = [child_result(done) for done in run_modules(
      [('tests.tf_internals_child', 'store', str(client), cluster) for client in range(2)],
      timeout=180)]
  for got in results:
    assert got['first'] == ['client 0', 'client 1'] and got['second'] == ['0', '10'], results
  assert 'late' not in results[0]
  settled, control = results[1]['late']
  assert settled == 'stop', results
  assert control in ('UnavailableError', 'TimeoutError'), results  # the store is gone
