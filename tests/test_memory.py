"""The memory estimator against independent references, and inspect's verdict."""

import dataclasses
import math

import numpy as np

from layout_core.layout.rules import LayoutRules
from layout_core.layout.scope import plan_layouts
from layout_core.model.lm import transformer_lm_params
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig
from layout_core.train.memory import estimate_memory, model_flops_per_step
from layout_core.train.optimizer import OptimizerConfig
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
  from layout_core.train.factory import make_trainer
  task = MarkovTask(vocab_size=64, seq_len=16)
  trainer = make_trainer(model=LM, mesh=mesh_2x4, rules=MEGATRON, task=task,
                         optimizer=OptimizerConfig(), config=TrainConfig(batch_size=8))
  engine = trainer.engine
  params = [shard_bytes(v) for v in engine.variables.values()]
  slots = [shard_bytes(s) for slot in (engine.optimizer.m, engine.optimizer.v)
           for s in slot.values()]
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
                   optimizer=_with(OptimizerConfig(), shard_state=False))
  sharded = estimate(axes=axes, rules=LayoutRules([]),
                     optimizer=_with(OptimizerConfig(), shard_state=True))
  # The default, 'auto', leaves this small model's state whole.
  assert estimate(axes=axes, rules=LayoutRules([])).per_device == plain.per_device
  records = plan_layouts(LM.cls.variable_specs(LM), LayoutRules([]), axes)
  splittable = sum(r.bytes_total for r in records if any(n % 8 == 0 for n in r.shape))
  rest = sum(r.bytes_total for r in records) - splittable
  assert sharded.per_device['optimizer'] == 2 * (splittable // 8 + rest)
  assert plain.per_device['optimizer'] == 2 * (splittable + rest)


def test_adafactor_keeps_factored_second_moments():
  wide = transformer_lm_params(vocab_size=256, model_dim=128, num_heads=4, ffn_dim=256,
                               num_layers=1, max_len=16)
  got = estimate(wide, axes={'data': 8}, rules=LayoutRules([]),
                 optimizer=_with(OptimizerConfig(), name='adafactor', shard_state=False))
  expected = 0
  for spec in wide.cls.variable_specs(wide):
    shape = spec.shape
    factored = len(shape) >= 2 and min(shape[-2:]) >= 128
    expected += 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:])
                     if factored else math.prod(shape))
  assert got.per_device['optimizer'] == expected


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


def _with(config, **fields):
  """The optimizer config with fields it may not have yet (merged by another branch)."""
  try:
    return dataclasses.replace(config, **fields)
  except TypeError:
    class Extended:
      def __getattr__(self, name):
        return fields[name] if name in fields else getattr(config, name)
    return Extended()


def test_auto_state_sharding_picks_one_axis_meshes_and_large_models():
  from layout_core.train.optimizer import AUTO_MIN_PARAMETERS, state_axis
  auto, large = OptimizerConfig(), AUTO_MIN_PARAMETERS
  assert auto.shard_state == 'auto'
  assert state_axis(auto, batch_axis='data', mesh_axes={'data': 8}, num_parameters=large) == 'data'
  assert state_axis(auto, batch_axis='data', mesh_axes={'data': 8}, num_parameters=large - 1) is None
  assert state_axis(auto, batch_axis='data', mesh_axes={'data': 2, 'model': 4},
                    num_parameters=10 * large) is None
  assert state_axis(auto, batch_axis='data', mesh_axes={'data': 1}, num_parameters=large) is None
  forced = _with(auto, shard_state=True)
  assert state_axis(forced, batch_axis='data', mesh_axes={'data': 2, 'model': 4},
                    num_parameters=1) == 'data'
