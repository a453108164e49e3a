"""Fully sharded parameters (`train.fsdp`): every engine trains as it does
without FSDP (the independent reference: the same run, parameters whole),
each device holds 1/N of every split parameter, its slots and its gradient,
checkpoints move between FSDP on and off, and the run record says where
each slice is stored and the layout it is used in."""

import json
import os

import numpy as np
import pytest

from layout_core.errors import ConfigError
from layout_core.layout import fsdp
from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.layout import scope as layout_scope
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.lazy import dtensor
from layout_core.model import keras as keras_models
from layout_core.model.lm import transformer_lm_params
from layout_core.optim import OptimizerConfig
from layout_core.pipeline import PipelineConfig
from layout_core.run import make_trainer
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig
from plugins import gin_setup, plan as plan_lib
from plugins.record import record_run
from plugins.report import describe_plan
from plugins.training import build_trainer
from tests.conftest import REPO_ROOT
from tests.numerics import assert_close
from tests.test_layout_scope import MEGATRON
from tests.test_mesh_tab import layouts_txt
from tests.test_optimizer_state import move_checkpoint
from tests.test_precision import models, tasks  # the user fixtures (tests/fixtures/my_project)

BATCH, STEPS = 16, 8
# FSDP's reduce-scatter sums each gradient's pieces in another order than the
# all-reduce of a run without it (tests/numerics.py), relative to the values' scale.
# measured over 8 steps on the 4-device meshes: loss 8.0e-08, weights 2.8e-06, the same
# under each setting (default / no oneDNN / 1 thread).
LOSS = 2e-6
WEIGHTS = 2e-5


# The equality tests' meshes have 4 devices (and 'data' 4 or 2 wide): a step
# function compiles once per device, and a split over 4 shows what one over 8
# does (`mesh_data4`, tests/conftest.py). The tests of what each device holds
# keep data=2 x model=4 and data=8.


@pytest.fixture(scope='module')
def stage_mesh(devices8):
  return build_mesh(MeshSpec(shape={'stage': 2, 'data': 2}))


SETUPS = {  # name -> (mesh fixture, rules, pipeline, train config overrides)
    'data=4': ('mesh_data4', [], None, {}),
    'data=2 x model=4, Megatron': ('mesh_2x4', MEGATRON, None, {}),
    'accumulation, remat': ('mesh_data4', [], None, dict(grad_accum_steps=2, remat='block')),
    'spmd pipeline': ('stage_mesh', [], PipelineConfig(num_stages=2, num_micro_batches=2,
                                                      engine='spmd'), {}),
    'gpipe': ('stage_mesh', [], PipelineConfig(num_stages=2, num_micro_batches=2), {}),
}


def lm():
  return transformer_lm_params(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64,
                               num_layers=2, max_len=16)


def trainer(mesh, *, rules=(), pipeline=None, optimizer=None, **train):
  return make_trainer(
      model=lm(), mesh=mesh, rules=LayoutRules(list(rules)),
      task=MarkovTask(vocab_size=32, seq_len=16, seed=3),
      optimizer=optimizer or OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
      config=TrainConfig(num_steps=STEPS, batch_size=BATCH, log_every=1, eval_every=0,
                         eval_batches=1, **train), pipeline=pipeline)


def model_values(t) -> dict:
  """path -> value of every parameter, per cell for the SPMD engine's stack."""
  program = getattr(t.engine, 'program', None)
  found = program.stack.unstacked_values() if hasattr(program, 'stack') else {}
  found.update({p: to_numpy(v) for p, v in t.engine.variables.items()})
  return found


def split_records(t):
  return [r for r in t.engine.layout_records if r.use_spec is not None]


def assert_stored_split(t, axis='data'):
  """Every variable the records say FSDP splits is split on the devices,
  read from its local shards (`dtensor.unpack`), not from the records alone:
  each shard, and each of its optimizer slots', is the block the recorded
  stored layout gives, and 1/n of what its layout at use leaves on a device
  (n: `axis`'s size), so a variable whose record claims a split it does not
  have fails here."""
  for record in split_records(t):
    variable = t.engine.variables[record.path]
    mesh = variable.layout.mesh  # a stage's sub-mesh under the sub-mesh engine
    axes = dict(zip(mesh.dim_names, mesh.shape()))
    block = [n if a == 'unsharded' else n // axes[a] for n, a in zip(record.shape, record.spec)]
    at_use = np.prod(record.shape) // np.prod(
        [axes[a] for a in record.use_spec if a != 'unsharded'], dtype=int)
    for held in [variable, *t.engine.optimizer.slots_for(record.path)]:
      for shard in dtensor.unpack(held.read_value()):
        assert shard.shape.as_list() == block, record.path
        assert shard.shape.num_elements() * axes[axis] == at_use, record.path


@pytest.mark.parametrize('setup', list(SETUPS))
def test_fsdp_trains_as_the_same_run_with_whole_parameters(setup, request):
  mesh, rules, pipeline, train = SETUPS[setup]
  mesh = request.getfixturevalue(mesh)
  sharded = trainer(mesh, rules=rules, pipeline=pipeline, fsdp=True, **train)
  whole = trainer(mesh, rules=rules, pipeline=pipeline, **train)
  split = split_records(sharded)
  assert len(split) > len(sharded.engine.layout_records) // 2, setup  # FSDP did split
  assert_stored_split(sharded)  # and the devices hold what the records say
  assert not split_records(whole)
  for step in range(STEPS):
    batch = {'tokens': whole.task.batch(step=step, batch_size=BATCH)}
    loss = float(to_numpy(whole.train_step(batch)[0]))
    assert_close(float(to_numpy(sharded.train_step(batch)[0])), loss, rel=LOSS,
                 what=f'loss: {setup} step {step}')
  reference = model_values(whole)
  for path, value in model_values(sharded).items():
    assert_close(value, reference[path], rel=WEIGHTS, what=f'weights: {setup} {path}')


def test_bfloat16_fsdp_stays_within_bfloat16_rounding_of_the_run_without_it(mesh_data4):
  """bfloat16 gradients are summed over the batch in bfloat16, and FSDP's
  reduce-scatter sums them in another order than the all-reduce: not 1e-5.
  The bound: STEPS (8) steps of FSDP move the loss less than a tenth of what
  bfloat16 itself moves it from float32."""
  runs = {'float32': trainer(mesh_data4),
          'bf16': trainer(mesh_data4, compute_dtype='bfloat16', grad_accum_steps=2),
          'bf16 fsdp': trainer(mesh_data4, compute_dtype='bfloat16', grad_accum_steps=2,
                               fsdp=True)}
  losses = {name: [] for name in runs}
  for step in range(STEPS):
    batch = {'tokens': runs['float32'].task.batch(step=step, batch_size=BATCH)}
    for name, t in runs.items():
      losses[name].append(float(to_numpy(t.train_step(batch)[0])))
  bf16_error = max(abs(a - b) for a, b in zip(losses['bf16'], losses['float32']))
  fsdp_error = max(abs(a - b) for a, b in zip(losses['bf16 fsdp'], losses['bf16']))
  assert bf16_error > 1e-3  # bfloat16 did change the math (else the bound says nothing)
  assert fsdp_error < bf16_error / 10


@pytest.mark.parametrize('setup', ['data=4', 'data=2 x model=4, Megatron'])
def test_bfloat16_fsdp_gives_the_gradients_of_the_run_without_it(setup, request):
  """In bfloat16 a layer's matrices move by all-to-all, one copy per replica
  (`fsdp.per_replica`): each device sums its slice of every replica's
  gradient in float32 and rounds it as DTensor's all-reduce does. The first
  step's gradients equal those of the run without FSDP, bit for bit."""
  mesh, rules, _, _ = SETUPS[setup]
  mesh = request.getfixturevalue(mesh)
  runs = [trainer(mesh, rules=rules, compute_dtype='bfloat16', fsdp=on) for on in (False, True)]
  batch = {'tokens': runs[0].task.batch(step=0, batch_size=BATCH)}
  grads = [t.engine.loss_and_gradients(t.engine.pack(batch))[2] for t in runs]
  assert len(split_records(runs[1])) > len(runs[1].engine.layout_records) // 2
  for path, whole, split in zip(runs[0].engine.optimizer.paths, *grads):
    np.testing.assert_array_equal(to_numpy(split), to_numpy(whole), err_msg=path)


def test_each_device_holds_a_slice_of_every_split_parameter_its_slots_and_gradient(
    mesh_2x4):
  """From the variables' own layouts and local shards: 1/N of each split
  parameter and of its Adam slots on every device, and the gradients
  function returns every gradient in its parameter's split layout, so no
  device ever holds a whole-model gradient."""
  t = trainer(mesh_2x4, rules=MEGATRON, fsdp=True)
  engine = t.engine
  split = {r.path: r for r in split_records(t)}
  assert 'lm/stack/block_000/ffn/w_in' in split and 'lm/softmax/w' in split
  for path, record in split.items():
    variable = engine.variables[path]
    assert tuple(variable.layout.sharding_specs) == record.spec
    assert 'data' in record.spec and 'data' not in record.use_spec
    for slot in engine.optimizer.slots_for(path):
      assert slot.layout.sharding_specs == variable.layout.sharding_specs, path
  assert_stored_split(t)
  unsplit = {r.path for r in engine.layout_records} - set(split)
  # Nothing left to split: the table's vocab dim is unshardable, its features
  # on 'model'; the vectors' one dim is on 'model' already.
  assert unsplit == {'lm/emb/table', 'lm/softmax/b', 'lm/stack/block_000/ffn/b_in',
                     'lm/stack/block_001/ffn/b_in'}
  packed = engine.pack({'tokens': t.task.batch(step=0, batch_size=BATCH)})
  _, _, grads = engine.loss_and_gradients(packed)
  for path, grad in zip(engine.optimizer.paths, grads):
    assert dtensor.fetch_layout(grad).sharding_specs == engine.variables[
        path].layout.sharding_specs, path


def test_the_run_record_says_where_each_slice_is_stored_and_the_layout_at_use(devices8,
                                                                             tmp_path):
  """The quickstart with `train.fsdp = True`, recorded as launch.train
  records it (`record_run`) and trained 2 steps: layouts.txt and mesh.json
  give each variable's stored layout, split over 'data', so each of the 8
  devices holds 1/8 of all 447,744 parameter bytes, in the slices its local
  shards (`dtensor.unpack`) hold value for value; and the layout the math
  gathers each one to (no rules: replicated). launch.inspect's table is
  layouts.txt's."""
  gin_setup.parse_gin(files=[os.path.join(REPO_ROOT, 'configs/experiments/quickstart.gin')],
                      bindings=['train.fsdp = True', 'train.num_steps = 2',
                                'train.eval_every = 0'])
  plan = plan_lib.make_plan()
  t = build_trainer(plan)
  record_run(t, plan, model_dir=str(tmp_path))
  for step in range(2):
    t.train_step(plan.task.features(split='train', step=step,
                                    batch_size=plan.train.batch_size))
  with open(tmp_path / 'mesh.json') as f:
    doc = json.load(f)
  rows = {row['path']: row for row in layouts_txt(str(tmp_path))}
  total = sum(v['bytes_total'] for v in doc['variables'])
  assert total == 447_744 and len(rows) == len(doc['variables']) == 30
  assert [d['bytes']['parameters'] for d in doc['devices']] == [total // 8] * 8
  assert [d['bytes']['optimizer'] for d in doc['devices']] == [2 * total // 8] * 8  # Adam
  for v in doc['variables']:
    variable, row = t.engine.variables[v['path']], rows[v['path']]
    stored = list(variable.layout.sharding_specs)
    assert 'data' in stored and v['spec'] == stored, v['path']
    assert v['use_spec'] == ['unsharded'] * len(stored), v['path']
    assert (v['bytes_per_device'], v['bytes_per_device_at_use']) == (
        v['bytes_total'] // 8, v['bytes_total']), v['path']
    assert (row['sharding'], row['sharding at use']) == (
        ', '.join(stored), ', '.join(v['use_spec'])), v['path']
    assert row['bytes/device'] == f"{v['bytes_total'] // 8:,}", v['path']
    whole = to_numpy(variable)
    where = {f'CPU:{i}': p['index'] for p in v['slices'] for i in p['devices']}
    shards = dtensor.unpack(variable.read_value())
    assert len(where) == len(shards) == 8, v['path']
    for device, shard in zip(variable.layout.mesh.local_devices(), shards):
      index = where[device.rsplit('/device:', 1)[-1]]
      np.testing.assert_array_equal(
          shard.numpy(), whole[tuple(slice(start, stop) for start, stop in index)],
          err_msg=f"{v['path']} on {device}")
  assert layout_scope.table_markdown(plan.records).rstrip() in describe_plan(plan)
  with open(tmp_path / 'layouts.txt') as f:
    assert f.read() == layout_scope.table_markdown(plan.records)


def test_a_checkpoint_moves_between_fsdp_and_whole_parameters(mesh_data8, mesh_2x4, tmp_path):
  """Same keys either way; values restore exactly into the other setting and
  another mesh shape."""
  def move(source, target, directory):
    saved, restored = move_checkpoint(source, target, directory, step=3)
    assert sorted(saved) == sorted(restored)

  sharded = trainer(mesh_data8, fsdp=True)
  for step in range(2):
    sharded.train_step({'tokens': sharded.task.batch(step=step, batch_size=BATCH)})
  whole = trainer(mesh_2x4, rules=MEGATRON)
  move(sharded, whole, tmp_path / 'to_whole')
  move(whole, trainer(mesh_2x4, rules=MEGATRON, fsdp=True), tmp_path / 'back')


def test_fsdp_names_the_axis_it_cannot_use():
  with pytest.raises(ConfigError, match="train.fsdp = 'nope' is not a mesh axis"):
    fsdp.fsdp_axis('nope', batch_axis='data', mesh_axes={'data': 8})
  with pytest.raises(ConfigError, match="the pipeline's stage axis"):
    fsdp.fsdp_axis('stage', batch_axis='data', mesh_axes={'stage': 2, 'data': 4},
                   stage_axis='stage')
  with pytest.raises(ConfigError, match="train.fsdp is ''"):
    TrainConfig(fsdp='')
  assert fsdp.fsdp_axis(True, batch_axis='unsharded', mesh_axes={'model': 8}) is None
  assert fsdp.fsdp_axis('model', batch_axis='data', mesh_axes={'data': 2, 'model': 4}) == 'model'


def test_a_keras_model_with_fsdp_is_refused_before_anything_is_built(mesh_2x4):
  """Keras layers read their weights themselves, so nothing gathers a split
  one where it is used: a ConfigError (exit 2 from launch.train) that says
  what works instead, from the factory as from the plan."""
  with pytest.raises(ConfigError, match='train.fsdp does not cover Keras models') as error:
    make_trainer(model=keras_models.KerasModel(build_fn=models.token_classifier),
                 mesh=mesh_2x4, rules=LayoutRules([]), task=tasks.FirstTokenTask(),
                 optimizer=OptimizerConfig(), config=TrainConfig(fsdp=True))
  assert 'optimizer.shard_state' in str(error.value)


def test_a_block_gathers_its_weights_at_use_and_again_when_recomputed(mesh_data4,
                                                                    monkeypatch):
  """Traced gathers (counted while the gradients function is first traced):
  each block's split vectors in one `fsdp.gather_all` call, each of its
  matrices in bfloat16 once per replica (`fsdp.per_replica`, an all-to-all), once a step
  without remat; with remat 'block' once more in each block's
  recomputation, so the gathered copies are not what the backward pass keeps."""
  buckets, replicas = [], []
  gather_all, per_replica = fsdp.gather_all, fsdp.per_replica
  monkeypatch.setattr(fsdp, 'gather_all', lambda values, **where: buckets.append(
      len(values)) or gather_all(values, **where))
  monkeypatch.setattr(fsdp, 'per_replica', lambda variable, dtype=None, **where: replicas.append(
      variable) or per_replica(variable, dtype, **where))
  counts = {}
  for remat in ('none', 'block'):
    t = trainer(mesh_data4, fsdp=True, remat=remat, compute_dtype='bfloat16')
    in_block = [r for r in split_records(t) if r.path.startswith('lm/stack/block_000/')]
    vectors = sum(len(r.shape) == 1 for r in in_block)
    buckets.clear()
    replicas.clear()
    t.engine.loss_and_gradients(t.engine.pack({'tokens': t.task.batch(step=0,
                                                                      batch_size=BATCH)}))
    block_000 = [r.path for v in replicas for r in in_block if v is t.engine.variables[r.path]]
    counts[remat] = (buckets.count(vectors), len(block_000), len(set(block_000)))
  assert vectors == 6  # 2 layer norms' scale and bias, the feed-forward's biases
  # 2 blocks; block_000's 6 matrices (q, k, v, o, in, out), each once or twice
  assert counts == {'none': (2, 6, 6), 'block': (4, 12, 6)}
