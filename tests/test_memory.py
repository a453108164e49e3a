"""The memory estimator against independent references, and inspect's verdict."""

import dataclasses

import numpy as np
import pytest

from layout_core.layout.rules import LayoutRules
from layout_core.layout.scope import plan_layouts
from layout_core.model.lm import moe_feed_forward_params, transformer_lm_params
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig
from layout_core.optim import (AUTO_MIN_PARAMETERS, OptimizerConfig, count_parameters,
                               make_optimizer, state_axis)
from layout_core.train.memory import estimate_memory, model_flops_per_step
from tests.conftest import run_module

MEGATRON = LayoutRules([(r'.*/attn/w[qkv]', ('unsharded', 'model', 'unsharded')),
                        (r'.*/attn/wo', ('model', 'unsharded', 'unsharded')),
                        (r'.*/ffn/w_in', ('unsharded', 'model')),
                        (r'.*/ffn/b_in', ('model',)),
                        (r'.*/ffn/w_out', ('model', 'unsharded')),
                        (r'.*/emb/table', ('unsharded', 'model'))])
AXES = {'data': 2, 'model': 4}
LM = transformer_lm_params(vocab_size=64, model_dim=32, num_heads=4, ffn_dim=64,
                           num_layers=2, max_len=16)


def estimate(params=LM, *, optimizer=None, axes=AXES, rules=MEGATRON, **train):
  records = plan_layouts(params.cls.variable_specs(params), rules, axes)
  return estimate_from(records, params=params, optimizer=optimizer, axes=axes, **train)


def estimate_from(records, *, params=LM, optimizer=None, axes=AXES, **train):
  config = TrainConfig(batch_size=8, **train)
  return estimate_memory(records=records, params=params, input_shapes=[(8, 16)],
                         config=config, optimizer=optimizer or OptimizerConfig(),
                         mesh_axes=axes)


def shard_bytes(variable) -> tuple[int, int]:
  """(bytes on the fullest device, bytes over all devices) of a real DVariable."""
  from tensorflow.experimental import dtensor
  sizes = [int(np.prod(c.shape)) * c.dtype.size for c in dtensor.unpack(variable.read_value())]
  return max(sizes), sum(sizes)


def test_parameter_and_adam_bytes_equal_the_built_variables_shards(mesh_2x4):
  from layout_core.run import make_trainer
  task = MarkovTask(vocab_size=64, seq_len=16)
  trainer = make_trainer(model=LM, mesh=mesh_2x4, rules=MEGATRON, task=task,
                         optimizer=OptimizerConfig(), config=TrainConfig(batch_size=8))
  engine = trainer.engine
  params = [shard_bytes(v) for v in engine.variables.values()]
  slots = [shard_bytes(s) for p in engine.optimizer.paths for s in engine.optimizer.slots_for(p)]
  got = estimate()
  assert got.per_device['parameters'] == sum(p for p, _ in params)
  assert got.total['parameters'] == sum(t for _, t in params)
  assert got.per_device['optimizer'] == sum(p for p, _ in slots)
  assert got.total['optimizer'] == sum(t for _, t in slots)
  assert got.per_device['gradients'] == got.per_device['parameters']


def test_bf16_halves_activations_and_remat_lowers_them():
  no_logits = LM.Copy().Set(sub=LM.sub[:3])  # the logits stay float32 under bf16
  f32, bf16 = estimate(no_logits), estimate(no_logits, compute_dtype='bfloat16')
  assert bf16.per_device['activations'] * 2 == f32.per_device['activations'] > 0
  assert bf16.per_device['weight copies'] == f32.per_device['parameters'] // 2
  assert estimate(compute_dtype='bfloat16').per_device['activations'] > (
      estimate().per_device['activations'] // 2)
  deep = LM.Copy().Set(**{'sub[1].repeat': 8})
  none, block, full = (estimate(deep, remat=r).per_device['activations']
                       for r in ('none', 'block', 'full'))
  assert full <= block < none / 2


def test_sharded_state_divides_splittable_slots_by_the_data_axis():
  axes = {'data': 8}
  plain = estimate(axes=axes, rules=LayoutRules([]),
                   optimizer=OptimizerConfig(shard_state=False))
  sharded = estimate(axes=axes, rules=LayoutRules([]),
                     optimizer=OptimizerConfig(shard_state=True))
  # The default, 'auto', leaves this small model's state whole.
  assert estimate(axes=axes, rules=LayoutRules([])).per_device == plain.per_device
  records = plan_layouts(LM.cls.variable_specs(LM), LayoutRules([]), axes)
  splittable = sum(r.bytes_total for r in records if any(n % 8 == 0 for n in r.shape))
  rest = sum(r.bytes_total for r in records) - splittable
  assert sharded.per_device['optimizer'] == 2 * (splittable // 8 + rest)
  assert plain.per_device['optimizer'] == 2 * (splittable + rest)


WIDE = transformer_lm_params(vocab_size=256, model_dim=128, num_heads=4, ffn_dim=256,
                             num_layers=1, max_len=16)


def real_variables(records, mesh) -> dict:
  """A real DVariable (zeros) per layout record, in the record's layout."""
  from layout_core.lazy import dtensor, tf
  variables = {}
  for r in records:
    init = tf.function(lambda shape=r.shape: tf.zeros(shape), autograph=False)
    layout = dtensor.Layout(list(r.spec), mesh)
    variables[r.path] = dtensor.DVariable(dtensor.call_with_layout(init, layout))
  return variables


@pytest.mark.parametrize('fields', [
    dict(name='adam', shard_state=False),
    dict(name='adam', shard_state=True),
    dict(name='adafactor', shard_state=False),                   # 128 x 128 and up factored
    dict(name='adafactor', shard_state=False, adafactor_min_dim_to_factor=4),  # [d, h, 32] too
    dict(name='adafactor', shard_state=False, adafactor_beta1=0.9),            # + m
    dict(name='adafactor', shard_state=True, adafactor_beta1=0.9, adafactor_min_dim_to_factor=4),
], ids=lambda fields: ','.join(f'{k}={v}' for k, v in fields.items()))
def test_optimizer_bytes_equal_the_slots_a_real_optimizer_creates(mesh_2x4, fields):
  """The estimate against the slot variables a built optimizer really makes
  (their shards on the devices), not against a formula: a re-derivation of
  Adafactor's slots with a fixed 128 or no first moment fails here."""
  config = OptimizerConfig(**fields)
  records = plan_layouts(WIDE.cls.variable_specs(WIDE), MEGATRON, AXES)
  variables = real_variables(records, mesh_2x4)
  optimizer = make_optimizer(config, variables=list(variables.values()), paths=list(variables),
                             total_steps=1, mesh_axes=AXES)
  slots = [shard_bytes(s) for p in optimizer.paths for s in optimizer.slots_for(p)]
  if fields.get('adafactor_beta1'):
    assert len(optimizer.m) == len(records)  # the positive control: the moment exists
  if fields['shard_state']:
    assert any('data' in s.layout.sharding_specs
               for p in optimizer.paths for s in optimizer.slots_for(p))
  got = estimate_from(records, params=WIDE, optimizer=config)
  assert got.state_axis == optimizer.shard_axis
  assert got.per_device['optimizer'] == sum(device for device, _ in slots)
  assert got.total['optimizer'] == sum(total for _, total in slots)


@pytest.mark.parametrize('remat', ['none', 'block'])
def test_fsdp_state_bytes_equal_a_built_run_and_gathered_copies_follow_remat(mesh_2x4, remat):
  """With train.fsdp the estimate's parameters, gradients and Adam slots are
  the shards a real FSDP run's variables hold (against the built engine, not
  a formula: 1/2 of what they are without FSDP where 'data' finds a dim);
  the gathered copies are every split weight at its rule's layout without
  remat, and one block's with it."""
  from layout_core.run import make_trainer
  config = dict(fsdp=True, compute_dtype='bfloat16', remat=remat)
  engine = make_trainer(model=LM, mesh=mesh_2x4, rules=MEGATRON,
                        task=MarkovTask(vocab_size=64, seq_len=16),
                        optimizer=OptimizerConfig(shard_state=True),  # moot: FSDP splits it
                        config=TrainConfig(batch_size=8, **config)).engine
  params = [shard_bytes(v) for v in engine.variables.values()]
  slots = [shard_bytes(s) for p in engine.optimizer.paths for s in engine.optimizer.slots_for(p)]
  records = plan_layouts(LM.cls.variable_specs(LM), MEGATRON, AXES, fsdp_axis='data')
  assert [(r.path, r.spec) for r in records] == [
      (r.path, r.spec) for r in engine.layout_records]
  got = estimate_from(records, optimizer=OptimizerConfig(shard_state=True), **config)
  assert got.fsdp_axis == 'data' and got.state_axis is None is engine.optimizer.shard_axis
  assert got.per_device['parameters'] == sum(p for p, _ in params)
  assert got.per_device['gradients'] == got.per_device['parameters']
  assert got.per_device['optimizer'] == sum(p for p, _ in slots)
  whole = estimate(compute_dtype='bfloat16')
  assert got.per_device['parameters'] < 0.6 * whole.per_device['parameters']
  # Gathered bf16 copies at the rule's layout: all kept, or one block's at a time.
  split = [r for r in records if r.use_spec is not None]
  at_use = {r.path: r.bytes_total // 2 // int(np.prod([AXES[a] for a in r.use_spec
                                                        if a != 'unsharded'])) for r in split}
  unsplit_copies = sum(r.bytes_per_device // 2 for r in records if r.use_spec is None)
  if remat == 'none':
    assert got.per_device['weight copies'] == sum(at_use.values()) + unsplit_copies
  else:
    blocks = {f'lm/stack/block_00{i}': sum(n for p, n in at_use.items()
                                           if p.startswith(f'lm/stack/block_00{i}/'))
              for i in range(2)}
    rest = sum(n for p, n in at_use.items() if not p.startswith('lm/stack/'))
    assert got.per_device['weight copies'] == rest + max(blocks.values()) + unsplit_copies


def test_keras_models_report_state_but_not_activations():
  records = plan_layouts(LM.cls.variable_specs(LM), MEGATRON, AXES)
  got = estimate_memory(records=records, params=object(), input_shapes=[(8, 16)],
                        config=TrainConfig(batch_size=8), optimizer=OptimizerConfig(),
                        mesh_axes=AXES)
  assert got.per_device['parameters'] > 0 and got.per_device['optimizer'] > 0
  assert got.per_device['activations'] == 0 and not got.activations_known
  assert 'not known for a Keras model' in got.notes[0]
  assert model_flops_per_step(meta=None, num_parameters=10, tokens_per_step=4) == 240


def test_inspect_says_whether_the_model_fits():
  base = ['--gin_file=configs/experiments/lm_2d.gin', '--max_rows=1']
  small = run_module('launch.inspect', *base, '--gin_bindings=mesh.device_memory_gb = 0.001')
  assert small.returncode == 0, small.stderr[-2000:]
  assert 'DOES NOT FIT: peak' in small.stdout and 'over mesh.device_memory_gb = 0.001' in small.stdout
  for row in ('parameters', 'optimizer (adam)', 'gradients', 'activations', 'peak'):
    assert f'\n  {row} ' in small.stdout, row
  big = run_module('launch.inspect', *base, '--gin_bindings=mesh.device_memory_gb = 80')
  assert 'Fits: peak' in big.stdout and 'to spare' in big.stdout


def test_auto_state_sharding_picks_one_axis_meshes_and_large_models():
  auto = OptimizerConfig()
  assert auto.shard_state == 'auto'
  large = [(AUTO_MIN_PARAMETERS // 100, 100)]
  small = [(AUTO_MIN_PARAMETERS // 100 - 1, 100)]
  assert count_parameters(large) == AUTO_MIN_PARAMETERS
  assert state_axis(auto, batch_axis='data', mesh_axes={'data': 8}, parameter_shapes=large) == 'data'
  assert state_axis(auto, batch_axis='data', mesh_axes={'data': 8}, parameter_shapes=small) is None
  assert state_axis(auto, batch_axis='data', mesh_axes={'data': 2, 'model': 4},
                    parameter_shapes=large * 10) is None
  assert state_axis(auto, batch_axis='data', mesh_axes={'data': 1}, parameter_shapes=large) is None
  forced = OptimizerConfig(shard_state=True)
  assert state_axis(forced, batch_axis='data', mesh_axes={'data': 2, 'model': 4},
                    parameter_shapes=[(1,)]) == 'data'


def test_the_estimate_and_the_optimizer_count_the_same_parameters_for_auto(mesh_data8):
  """'auto' decided from the layout records (the estimate, inspect) and from
  the built variables (the optimizer) agrees on each side of the threshold."""
  from layout_core.layout.scope import LayoutRecord
  axes = {'data': 8}
  for rows, expected in ((AUTO_MIN_PARAMETERS // 100, 'data'),
                         (AUTO_MIN_PARAMETERS // 100 - 1, None)):
    records = [LayoutRecord(path='w', shape=(rows, 100), dtype='float32',
                            spec=('unsharded', 'unsharded'), source='default: replicated',
                            bytes_total=4 * rows * 100, bytes_per_device=4 * rows * 100),
               LayoutRecord(path='b', shape=(), dtype='float32', spec=(),
                            source='default: replicated', bytes_total=4, bytes_per_device=4)]
    variables = real_variables(records, mesh_data8)
    optimizer = make_optimizer(OptimizerConfig(), variables=list(variables.values()),
                               paths=list(variables), total_steps=1, mesh_axes=axes)
    got = estimate_from(records, params=object(), axes=axes)
    assert optimizer.shard_axis == got.state_axis == expected


def test_a_routed_block_keeps_its_buffers_split_with_the_rows_and_the_experts():
  """A routed block keeps, per device, its [G, E, C, *] buffers (input,
  hidden, output: 2 D + H a slot for an MLP expert) split with the rows and
  with the experts where an axis other than the batch's splits them, and
  its two [G, S, E, C] masks with the rows: the estimate moves by exactly
  that between the experts on 'expert', on the batch's own axis and whole."""
  experts, width, hidden, rows, length = 4, 32, 48, 8, 16
  params = transformer_lm_params(
      vocab_size=64, model_dim=width, num_heads=4, ffn_dim=64, num_layers=1, max_len=length,
      moe=moe_feed_forward_params(num_experts=experts, expert_dim=hidden, kind='mlp'))
  axes = {'expert': 4, 'data': 2}

  def activations(axis):
    rules = LayoutRules([(r'.*/moe/w_.*', (axis, 'unsharded', 'unsharded'))])
    return estimate(params, axes=axes, rules=rules).per_device['activations']

  slots = rows * experts * length  # capacity_factor 0: C = S, per row
  buffers = slots * (2 * width + hidden) * 4 // 2  # float32, rows split over data=2
  # twice at the peak: kept for the backward, and as its working set (the
  # block is the largest layer: module docstring of layout_core.train.memory)
  assert activations('unsharded') - activations('expert') == 2 * (buffers - buffers // 4)
  assert activations('unsharded') == activations('data')  # 'data' is the batch's: no more
