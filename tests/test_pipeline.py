"""GPipe: partitioning, and the pipelined schedule against plain sequential runs."""

import itertools
import math
import random

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from layout_core import pipeline
from layout_core.errors import ConfigError
from layout_core.model.base import Sequential, flatten_layers
from layout_core.model.layers import FeedForward, LayerNorm
from layout_core.model.lm import transformer_lm_params
from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from tests.numerics import assert_close


def brute_force_best(costs, k):
  best = math.inf
  for cuts in itertools.combinations(range(1, len(costs)), k - 1):
    bounds = (0,) + cuts + (len(costs),)
    best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
  return best


def test_balanced_is_optimal_and_never_worse_than_lingvo():
  rng = random.Random(0)
  strictly_better = 0
  for _ in range(200):
    costs = [rng.choice([0, 1, 5, 20, 100]) * rng.randint(1, 9) for _ in range(rng.randint(2, 9))]
    k = rng.randint(1, len(costs))
    counts = pipeline.balanced_counts(costs, k)
    assert len(counts) == k and min(counts) >= 1 and sum(counts) == len(costs)
    bounds = np.cumsum([0] + counts)
    balanced_max = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert balanced_max == brute_force_best(costs, k)
    lingvo = np.cumsum([0] + pipeline.lingvo_counts(costs, k))
    lingvo_max = max(sum(costs[a:b]) for a, b in zip(lingvo, lingvo[1:]))
    assert balanced_max <= lingvo_max
    strictly_better += balanced_max < lingvo_max
  assert strictly_better > 0


def test_lingvo_heuristic_reproduces_its_known_flaws():
  assert pipeline.lingvo_counts([1] * 8, 2) == [3, 5]        # loads the last stage
  assert pipeline.balanced_counts([1] * 8, 2) == [4, 4]
  skewed = [24, 0, 0, 488, 488]
  assert 0 in pipeline.lingvo_counts(skewed, 4)              # leaves a stage empty
  assert min(pipeline.balanced_counts(skewed, 4)) >= 1


def test_partition_of_a_real_lm_and_errors():
  lm = transformer_lm_params(num_layers=4)
  layers = flatten_layers(lm)
  plan = pipeline.partition(layers, num_stages=2, input_shapes=[(8, 32)])
  assert sum(len(s.layers) for s in plan.stages) == 7 and plan.balance < 1.3
  assert 'stage 0' in plan.describe() and '%' in plan.describe()
  with pytest.raises(ConfigError, match='num_stages=8 is more than the 7 layers'):
    pipeline.partition(layers, num_stages=8, input_shapes=[(8, 32)])
  with pytest.raises(ConfigError, match='must give 2 positive layer counts summing to 7'):
    pipeline.partition(layers, num_stages=2, input_shapes=[(8, 32)], method=[3, 3])
  explicit = pipeline.partition(layers, num_stages=2, input_shapes=[(8, 32)], method=[2, 5])
  assert [len(s.layers) for s in explicit.stages] == [2, 5]


def test_which_pipelines_run_across_clients():
  """The sub-mesh engine gives every stage an equal share of each client's
  devices (a stage per client cannot take DTensor's cross-mesh copy); the
  SPMD engine is one program and runs on any split."""
  submesh = pipeline.PipelineConfig(num_stages=2, num_micro_batches=2)
  assert submesh.clients_problem(num_clients=1, devices_per_client=8) is None
  assert submesh.clients_problem(num_clients=2, devices_per_client=4) is None
  problem = submesh.clients_problem(num_clients=8, devices_per_client=1)
  assert "each of its 2 stages an equal share of every client's devices" in problem
  assert "a client's 1 device(s) do not split 2 ways" in problem
  spmd = pipeline.PipelineConfig(num_stages=2, num_micro_batches=2, engine='spmd')
  assert spmd.clients_problem(num_clients=8, devices_per_client=1) is None


def heterogeneous_stack(dim=8):
  """Mixed widths and kinds, so stages differ in cost and content."""
  widths = [16, 4, 32, 8, 24, 12, 8, 40]
  layers = []
  for i, width in enumerate(widths):
    layers.append(FeedForward.Params().Set(name=f'ffn_{i}', input_dim=dim, hidden_dim=width))
    if i % 3 == 1:
      layers.append(LayerNorm.Params().Set(name=f'ln_{i}', dim=dim))
  return layers


def reference_and_pipelined(k, m, batch_dim, devices8):
  layers = heterogeneous_stack()
  shape = [8, 3, 8] if batch_dim == 0 else [3, 8, 8]
  plan = pipeline.partition(layers, num_stages=k, input_shapes=[tuple(shape)])
  pipe = pipeline.Pipeline(plan, placement=pipeline.DevicePlacement(
      [f'/CPU:{i}' for i in range(k)]), num_micro_batches=m, batch_dim=batch_dim,
      bubble_fill=float('nan'))
  x = tf.constant(np.random.RandomState(k * 10 + m).randn(*shape), tf.float32)
  target = tf.constant(np.random.RandomState(1).randn(*shape), tf.float32)
  variables = [v for stage in pipe.stages for v in stage.trainable_variables]
  with tf.GradientTape(persistent=True) as tape:
    out = pipe(x)
    loss = tf.reduce_mean((out - target) ** 2)
    ref = x
    for stage in pipe.stages:  # the same layers, whole batch, no pipelining
      ref = stage(ref)
    ref_loss = tf.reduce_mean((ref - target) ** 2)
  return (out, loss, tape.gradient(loss, variables)), (ref, ref_loss,
                                                        tape.gradient(ref_loss, variables))


@pytest.mark.parametrize('k', [1, 2, 4])
@pytest.mark.parametrize('m', [1, 2, 4, 8])
@pytest.mark.parametrize('batch_dim', [0, 1])
def test_pipelined_equals_sequential_forward_loss_and_gradients(k, m, batch_dim, devices8):
  (out, loss, grads), (ref, ref_loss, ref_grads) = reference_and_pipelined(k, m, batch_dim,
                                                                           devices8)
  assert not np.isnan(out.numpy()).any()  # no bubble slot (NaN-filled) leaked in
  # measured: - / 6e-07 / 6e-07 (default / no oneDNN / 1 thread)
  assert_close(out.numpy(), ref.numpy(), rel=1e-05, what='outputs')
  # measured: - / 0 / 0 (default / no oneDNN / 1 thread)
  assert_close(loss.numpy(), ref_loss.numpy(), rel=1e-05, what='loss')
  for i, (g, r) in enumerate(zip(grads, ref_grads)):
    # Summation order differs (micro-batches are summed apart), so an element
    # that cancels to near zero is off by float32 rounding of the largest terms.
    # measured: 1.5e-06 / 1.5e-06 (default / no oneDNN)
    assert_close(g.numpy(), r.numpy(), rel=2e-05, what=f'gradients: {i}')


def test_a_schedule_that_reads_a_bubble_slot_is_caught(devices8):
  """The NaN fill is live: reading a buffer one clock early poisons the output."""
  layers = heterogeneous_stack()
  plan = pipeline.partition(layers, num_stages=2, input_shapes=[(8, 3, 8)])
  pipe = pipeline.Pipeline(plan, placement=pipeline.DevicePlacement(['/CPU:0', '/CPU:1']),
                           num_micro_batches=4, bubble_fill=float('nan'))
  x = tf.ones([8, 3, 8])
  buffer = pipe._fill(1, [2, 3, 8])
  assert np.isnan(pipe.stages[1](buffer).numpy()).all()
  assert not np.isnan(pipe(x).numpy()).any()


def test_micro_batches_must_divide_the_batch(devices8):
  plan = pipeline.partition(heterogeneous_stack(), num_stages=2, input_shapes=[(6, 8)])
  pipe = pipeline.Pipeline(plan, placement=pipeline.DevicePlacement(['/CPU:0', '/CPU:1']),
                           num_micro_batches=4)
  with pytest.raises(ConfigError, match='num_micro_batches=4 does not divide the batch of 6'):
    pipe(tf.ones([6, 8]))


def test_stage_fetches_inner_activations():
  p = pipeline.Stage.Params().Set(sub=heterogeneous_stack()[:3], fetch=['ffn_0'])
  stage = p.Instantiate()
  x = tf.ones([2, 8])
  out, fetched = stage(x)
  np.testing.assert_allclose(fetched.numpy(), stage.ffn_0(x).numpy())
  assert p.cls.fprop_meta(p, (2, 8)).out_shapes == ((2, 8), (2, 8))


def test_crossing_sub_meshes_with_sharded_activations_gives_plain_tf_values(devices8):
  mesh = build_mesh(MeshSpec(shape={'stage': 2, 'data': 2, 'model': 2}))
  rules = LayoutRules([(r'.*/w_in', ('unsharded', 'model')), (r'.*/w_out', ('model', 'unsharded')),
                       (r'.*/b_in', ('model',))])
  placement = pipeline.SubMeshPlacement(mesh=mesh, rules=rules)
  layers = heterogeneous_stack()
  plan = pipeline.partition(layers, num_stages=2, input_shapes=[(8, 8)])
  pipe = pipeline.Pipeline(plan, placement=placement, num_micro_batches=4,
                           bubble_fill=float('nan'))
  # Plain TF twin with the same weights.
  plain = [pipeline.Stage.Params().Set(name=f'stage_{k}', sub=[p.Copy() for p in s.layers])
           .Instantiate() for k, s in enumerate(plan.stages)]
  for dstage, pstage in zip(pipe.stages, plain):
    for dv, pv in zip(dstage.variables, pstage.variables):
      pv.assign(to_numpy(dv))
  x_value = np.random.RandomState(0).randn(8, 8).astype(np.float32)
  x = dtensor.pack([x_value[loc['data'] * 4:(loc['data'] + 1) * 4]
                    for loc in placement.meshes[0].local_device_locations()],
                   placement.batch_layout(0, 2))
  h = pipe.stages[0](x)  # activations sharded over 'data' on stage 0's devices
  assert dtensor.fetch_layout(h).sharding_specs[0] == 'data'
  moved = placement.cross(h, 0, 1)
  np.testing.assert_allclose(to_numpy(moved), to_numpy(h), rtol=0, atol=0)

  @tf.function
  def run(x):
    return tf.reduce_sum(pipe(x) ** 2), pipe(x)
  loss, out = run(x)
  ref = tf.constant(x_value)
  for stage in plain:
    ref = stage(ref)
  # measured: - / 6e-07 / 6e-07 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(out), ref.numpy(), rel=1e-05, what='outputs')
  # measured: - / 5e-07 / 5e-07 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(loss), tf.reduce_sum(ref ** 2).numpy(), rel=5e-06, what='loss')


@pytest.mark.parametrize('shape,num_micro', [
    ({'stage': 2, 'data': 2, 'model': 2}, 1),
    ({'stage': 2, 'data': 2, 'model': 2}, 4),
    ({'stage': 4, 'data': 2}, 2),
])
def test_gpipe_training_on_sub_meshes_equals_plain_tf(shape, num_micro, devices8):
  """Loss and every gradient of the GPipe schedule on sub-meshes (sharded
  weights and activations, crossings both ways) against plain TF, no DTensor."""
  num_stages = shape['stage']
  params = Sequential.Params().Set(name='net', sub=heterogeneous_stack())
  rules = LayoutRules([(r'.*/w_in', ('unsharded', 'model')),
                       (r'.*/w_out', ('model', 'unsharded')), (r'.*/b_in', ('model',))]
                      if 'model' in shape else [])
  staged = pipeline.build_staged_model(params, mesh=build_mesh(MeshSpec(shape=shape)),
                                      rules=rules, num_stages=num_stages,
                                      input_shapes=[(8, 8)])
  runners, placement, scope = staged.runners, staged.placement, staged.scope
  assert {r.mesh for r in scope.records} == {f'stage{k}' for k in range(num_stages)}
  loss_fn = lambda out, target: tf.reduce_mean((out - target) ** 2)
  gpipe = pipeline.GPipe(stages=runners, placement=placement, loss_fn=loss_fn,
                         num_micro_batches=num_micro)
  x = np.random.RandomState(0).randn(8, 8).astype(np.float32)
  target = np.random.RandomState(1).randn(8, 8).astype(np.float32)
  micro_x = [placement.put(0, a, batch_dim=0) for a in np.split(x, num_micro)]
  micro_t = [placement.put(num_stages - 1, a, batch_dim=0) for a in np.split(target, num_micro)]
  loss, grads, squared_norms = gpipe.loss_and_gradients(micro_x, micro_t)

  plain = params.Instantiate()  # plain tf.Variables; initial values are layout-free
  with tf.GradientTape() as tape:
    ref_loss = loss_fn(plain(tf.constant(x)), tf.constant(target))
  ref_grads = dict(zip((v.name for v in plain.trainable_variables),
                       tape.gradient(ref_loss, plain.trainable_variables)))
  # measured: - / 1e-07 / 1e-07 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(loss), ref_loss.numpy(), rel=2e-06, what='loss')
  # measured: - / 1e-07 / 1e-07 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(gpipe.loss(micro_x, micro_t)), ref_loss.numpy(), rel=2e-06,
               what='micro-batched loss')
  path_of = {id(v): path for path, v in scope.variables.items()}

  def reference(variable):  # a plain variable is named by its path, a DVariable by its last part
    return ref_grads[path_of[id(variable)].replace('/', '.') + ':0'].numpy()
  checked = 0
  for variables, stage_grads, squared in zip(gpipe.variables, grads, squared_norms):
    for variable, grad in zip(variables, stage_grads):
      # measured: - / 8e-07 / 8e-07 (default / no oneDNN / 1 thread)
      assert_close(to_numpy(grad), reference(variable), rel=1e-05,
                   what=f'gradients: {path_of[id(variable)]}')
      checked += 1
    # measured: - / 8e-07 / 8e-07 (default / no oneDNN / 1 thread)
    assert_close(to_numpy(squared), sum(np.sum(reference(v) ** 2) for v in variables), rel=1e-05,
                 what='squared gradient norm')
  assert checked == len(plain.trainable_variables)


def fetching_stages(dim=8):
  """Two stages; the first also fetches an inner activation (Stage.fetch)."""
  layers = heterogeneous_stack(dim)
  first = pipeline.Stage.Params().Set(name='stage_0', sub=[p.Copy() for p in layers[:3]],
                                      fetch=['ffn_0'])
  second = pipeline.Stage.Params().Set(name='stage_1', sub=[p.Copy() for p in layers[3:]])
  return first, second


@pytest.mark.parametrize('kind', ['devices', 'sub_meshes'])
@pytest.mark.parametrize('m', [1, 4])
def test_fetched_activations_reach_the_pipeline_output(kind, m, devices8):
  """A stage's fetched activation comes out after the pipeline's output, over
  all micro-batches, and is never fed to the next stage (plain TF twin)."""
  first, second = fetching_stages()
  plan = pipeline.partition(heterogeneous_stack(), num_stages=2, input_shapes=[(8, 8)],
                            method=[3, len(heterogeneous_stack()) - 3])
  if kind == 'devices':
    placement = pipeline.DevicePlacement(['/CPU:0', '/CPU:1'])
  else:
    placement = pipeline.SubMeshPlacement(
        mesh=build_mesh(MeshSpec(shape={'stage': 2, 'data': 2, 'model': 2})))
  stages = [placement.build(k, p, parent_path='net') for k, p in enumerate((first, second))]
  pipe = pipeline.Pipeline(plan, placement=placement, num_micro_batches=m, stages=stages,
                           bubble_fill=float('nan'))
  x_value = np.random.RandomState(0).randn(8, 8).astype(np.float32)
  x = (tf.constant(x_value) if kind == 'devices'
       else placement.put(0, x_value, batch_dim=0))
  out, fetched = tf.function(pipe)(x)
  plain = [p.Instantiate(parent_path='net') for p in (first, second)]
  ref_hidden, ref_fetched = plain[0](tf.constant(x_value))
  ref_out = plain[1](ref_hidden)
  # measured: - / 4e-07 / 4e-07 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(out), ref_out.numpy(), rel=5e-06, what='outputs')
  # measured: - / 2e-07 / 2e-07 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(fetched), ref_fetched.numpy(), rel=3e-06, what='fetched')
  assert to_numpy(fetched).shape == (8, 8)


def test_training_refuses_fetching_stages(devices8):
  first, second = fetching_stages()
  placement = pipeline.DevicePlacement(['/CPU:0', '/CPU:1'])
  stages = [placement.build(k, p, parent_path='net') for k, p in enumerate((first, second))]
  with pytest.raises(ConfigError, match='stage 0 fetches 1 inner activation'):
    pipeline.GPipe(stages=stages, placement=placement, num_micro_batches=2,
                   loss_fn=lambda out, target: tf.reduce_mean((out - target) ** 2))
