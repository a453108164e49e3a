"""A frozen base stored in bfloat16 or int8 (`train.frozen_dtype`, layout_core.model.frozen).

In process: int8 quantization against a numpy reference of the same scheme;
a LoRA run on an int8 or bfloat16 base computes exactly what the float32
run computes on the dequantized weights (losses and gradient norms, so the
backward's recomputed weight is the forward's); FSDP gathers a narrow
weight as float32, to its values; the frozen weights' bytes
per device are half (bfloat16) and a quarter plus scales (int8) of
float32's on `data=8` with FSDP and on 2x4 Megatron, as inspect's layout
records count them; a float32 base read into a narrow one by
`checkpoint.init_from` is quantized on the mesh; the logits of every
imported family held in bfloat16 and int8 against float32's, within the
bounds docs/fine-tune.md states. Launched: a bfloat16 Hugging Face
checkpoint imported bit for bit, LoRA-tuned on it in bfloat16, preempted
and resumed exactly, its adapters exported and loaded on the original
checkpoint. (The engines, FSDP, remat, accumulation and two clients are
crossed with it in the composition matrix, tests/composition.py.)
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer
from layout_core.checkpoint.shard_io import assign_global
from layout_core.convert import hf_config
from layout_core.errors import ConfigError
from layout_core.layout.rules import LayoutRules
from layout_core.layout.scope import plan_layouts
from layout_core.layout.variables import to_numpy
from layout_core.lazy import dtensor, tf
from layout_core.model import frozen
from layout_core.model.lm import transformer_lm_params
from layout_core.model.lora import LoraConfig, is_adapter
from layout_core.model.tuning import tune
from layout_core.optim import OptimizerConfig
from layout_core.run import make_trainer
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig
from tests import hf_fixtures
from tests.conftest import (Launched, killed_if_left, read_events, run_module, run_modules,
                            train_trace)
from tests.numerics import assert_close
from tests.test_layout_scope import MEGATRON

MODEL = dict(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64, num_layers=2, max_len=16)
LORA = LoraConfig(rank=4, alpha=8.0, targets=(r'.*/attn/w[qv]', r'.*/ffn/w_.*'))
BATCH = 8
# Logits of a base held narrow against float32's, max |difference| / max |float32 logit|,
# over the tiny random models of every family (tests/hf_fixtures.py: weights of stddev 0.2,
# which amplify rounding more than trained ones). Measured 2026-12-07: bfloat16 7.3e-03 to
# 1.7e-02, int8 2.1e-02 to 3.6e-02; the bounds (docs/fine-tune.md) leave about 1.8x.
LOGIT_BOUNDS = {'bfloat16': 3e-2, 'int8': 6.5e-2}


def tuned(frozen_dtype: str):
  return tune(transformer_lm_params(**MODEL), lora=LORA, trainable=None,
              frozen_dtype=frozen_dtype)


def make(mesh, frozen_dtype: str, *, rules=MEGATRON, fsdp=False):
  return make_trainer(
      model=tuned(frozen_dtype), mesh=mesh, rules=LayoutRules(list(rules)),
      task=MarkovTask(vocab_size=32, seq_len=16, seed=3),
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
      config=TrainConfig(num_steps=3, batch_size=BATCH, log_every=1, eval_every=0,
                         eval_batches=1, fsdp=fsdp))


def trace(trainer, steps: int = 3) -> dict:
  return train_trace(trainer, steps=steps, batch_size=BATCH)


def base_values(trainer) -> dict[str, np.ndarray]:
  """path -> the frozen weight as the math reads it (int8 times its scale)."""
  variables = trainer.engine.variables
  values = {}
  for path, variable in variables.items():
    if variable.trainable or frozen.is_scale(path):
      continue
    value = to_numpy(variable).astype(np.float32)
    if path + frozen.SCALE_SUFFIX in variables:
      value = value * to_numpy(variables[path + frozen.SCALE_SUFFIX])
    values[path] = value
  return values


# -- the scheme ------------------------------------------------------------------------------
def numpy_quantized(w: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric absmax per channel, written here from the scheme's definition."""
  largest = np.max(np.abs(w), axis=axes, keepdims=True)
  scale = np.where(largest > 0, largest / np.float32(127), np.float32(1)).astype(np.float32)
  return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


@pytest.mark.parametrize('shape, inputs', [((48, 40), 1), ((4, 8, 32), 2), ((96, 16), 0)],
                         ids=['dense', 'attention-out', 'table'])
def test_int8_quantization_is_the_numpy_scheme_and_round_trips_within_half_a_step(shape,
                                                                                   inputs):
  w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
  w[..., 3] = 0.0  # a channel of zeros keeps scale 1 and stays zero
  axes = frozen.quantization_axes(shape, inputs)
  q, scale = frozen.quantize(tf.constant(w), axes)
  expected_q, expected_scale = numpy_quantized(w, axes)
  np.testing.assert_array_equal(scale.numpy(), expected_scale)
  np.testing.assert_array_equal(q.numpy(), expected_q)
  assert q.dtype == tf.int8 and scale.shape == frozen.scale_shape(shape, axes)
  back = frozen.dequantized_np(q.numpy(), scale.numpy())
  assert np.all(np.abs(back - w) <= expected_scale / 2 * (1 + 1e-6))
  assert np.abs(back - w).max() > 0  # control: int8 does round


# -- the math --------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def dequantized_runs(mesh_2x4):
  """For each narrow dtype: 3 steps of LoRA on that base, and 3 steps of the
  float32 LoRA run whose frozen weights are set to the narrow base's values."""
  runs = {}
  for dtype in ('bfloat16', 'int8'):
    narrow, reference = make(mesh_2x4, dtype), make(mesh_2x4, 'float32')
    values = base_values(narrow)
    for path, variable in reference.engine.variables.items():
      if path in values:
        assign_global(variable, values[path])
    runs[dtype] = trace(narrow), trace(reference)
  return runs


@pytest.mark.parametrize('dtype', ['bfloat16', 'int8'])
def test_a_narrow_base_trains_the_function_of_its_dequantized_weights(dtype, dequantized_runs):
  """Losses and gradient norms within 'exact' (1e-6 of their scale): the
  weight the backward recomputes from int8 and its scale is the forward's,
  and the adapters' gradients flow through it."""
  narrow, reference = dequantized_runs[dtype]
  for key in ('loss', 'grad_norm'):
    assert_close(narrow[key], reference[key], rel=1e-6, what=f'{dtype} {key}')
  assert narrow['loss'][2] < narrow['loss'][0]  # and it trains


@pytest.mark.parametrize('mesh_name, rules, fsdp', [('mesh_data8', (), True),
                                                    ('mesh_2x4', MEGATRON, False)],
                         ids=['data8-fsdp', 'megatron-2x4'])
def test_frozen_bytes_per_device_are_half_and_a_quarter_plus_scales(mesh_name, rules, fsdp,
                                                                     request):
  """Measured on each device's own components, and as the layout records
  (launch.inspect's table, the memory estimate) count them."""
  mesh = request.getfixturevalue(mesh_name)
  measured, counted = {}, {}
  for dtype in frozen.FROZEN_DTYPES:
    trainer = make(mesh, dtype, rules=rules, fsdp=fsdp)
    variables = trainer.engine.variables
    frozen_vars = {p: v for p, v in variables.items() if not v.trainable}
    per_device = [0] * mesh.num_local_devices()
    for variable in frozen_vars.values():
      for device, component in enumerate(dtensor.unpack(variable.read_value())):
        per_device[device] += component.numpy().nbytes
    assert len(set(per_device)) == 1  # every device holds as much
    measured[dtype] = per_device[0]
    p = tuned(dtype)
    specs = p.cls.variable_specs(p)
    records = plan_layouts([s for s in specs if not s.trainable], LayoutRules(list(rules)),
                           dict(zip(mesh.dim_names, mesh.shape())),
                           fsdp_axis='data' if fsdp else None)
    counted[dtype] = sum(r.bytes_per_device for r in records)
    scales = sum(dtensor.unpack(v.read_value())[0].numpy().nbytes for p, v in frozen_vars.items()
                 if frozen.is_scale(p))
    vectors = sum(dtensor.unpack(v.read_value())[0].numpy().nbytes for v in frozen_vars.values()
                  if v.shape.rank == 1)
    if dtype == 'int8':
      matrices32 = measured['float32'] - vectors
      assert measured['int8'] == matrices32 // 4 + vectors + scales
      assert scales < 0.1 * measured['float32']
  assert measured['bfloat16'] * 2 == measured['float32']
  assert counted == measured


@pytest.mark.parametrize('dtype', ['bfloat16', 'int8'])
def test_fsdp_gathers_a_narrow_weight_as_float32_to_the_same_values(dtype, mesh_data8):
  """A narrow weight is widened on its slice before FSDP's gather: TF lowers
  a bfloat16 or int8 gather to a zero-padded all-reduce that held 1.8x and
  3.6x a float32 gather's bytes (bench/limits/narrow_gather_limit.py). Every
  relayout in the traced gather moves float32; the values are the stored
  ones, in the dtype asked for (as stored when none is)."""
  from layout_core.layout import fsdp  # pylint: disable=import-outside-toplevel
  value = np.random.default_rng(0).normal(0, 40, (16, 24)).clip(-127, 127).round()
  use = dtensor.Layout.replicated(mesh_data8, 2)
  variable = dtensor.DVariable(dtensor.relayout(
      dtensor.copy_to_mesh(tf.constant(value, dtype), use),
      dtensor.Layout(['data', dtensor.UNSHARDED], mesh_data8)), trainable=False)
  fsdp.set_use_layout(variable, use)
  for asked, expected in ((tf.float32, tf.float32), (None, tf.as_dtype(dtype))):
    gather = tf.function(lambda asked=asked: fsdp.at_use(variable, asked))
    graph = gather.get_concrete_function().graph
    moved = {op.inputs[0].dtype for op in graph.get_operations() if op.type == 'Relayout'}
    assert moved == {tf.float32}
    gathered = gather()
    assert gathered.dtype == expected
    np.testing.assert_array_equal(to_numpy(tf.cast(gathered, tf.float32)),
                                  to_numpy(tf.cast(variable, tf.float32)))


def test_init_from_a_float32_base_quantizes_it_on_the_mesh_and_names_it(mesh_2x4, tmp_path):
  """The base's weights read into bfloat16 (nearest) and int8 (the numpy
  scheme, per output channel over the whole weight though the mesh splits
  it); the new run's checkpoints still name the base for them."""
  base = make(mesh_2x4, 'float32')
  trace(base, 1)
  saver = Checkpointer(directory=str(tmp_path / 'base'), state=base.state(),
                       config=CheckpointConfig())
  saver.prepare_directory()
  prefix = saver.save(1, reason='test')
  saver.wait()
  expected = base_values(base)
  for dtype in ('bfloat16', 'int8'):
    tuned = make(mesh_2x4, dtype)
    variables = tuned.engine.variables
    checkpointer = Checkpointer(directory=str(tmp_path / dtype), state=tuned.state(),
                                config=CheckpointConfig())
    checkpointer.init_from(prefix, variables,
                           new=[p for p in variables if is_adapter(p) or frozen.is_scale(p)],
                           frozen=[p for p, v in variables.items() if not v.trainable])
    assert checkpointer.base is not None and len(checkpointer.base.keys) == len(expected)
    for path, value in expected.items():
      got = to_numpy(variables[path])
      if dtype == 'bfloat16':
        np.testing.assert_array_equal(got, value.astype(got.dtype), err_msg=path)
      elif value.ndim < 2:
        np.testing.assert_array_equal(got, value, err_msg=path)  # vectors stay float32
      else:
        # The dims the layer contracts with its input; the last dim of the
        # matrices that take no adapters (the embedding table, softmax/w).
        inputs = 2 if path.endswith('/wo') else 0 if path.endswith(('table', 'softmax/w')) else 1
        q, scale = numpy_quantized(value, frozen.quantization_axes(value.shape, inputs))
        np.testing.assert_array_equal(got, q, err_msg=path)
        # The scale's division on the mesh may round its last bit otherwise.
        np.testing.assert_allclose(to_numpy(variables[path + frozen.SCALE_SUFFIX]), scale,
                                   rtol=2.5e-7, atol=0, err_msg=path)


@pytest.mark.parametrize('dtype', ['bfloat16', 'int8'])
def test_the_decoder_and_the_merged_saved_model_compute_the_trained_runs_logits(
    dtype, mesh_2x4, tmp_path):
  """After 2 steps on a narrow base: the cached decoder over the run's own
  variables (the int8 weights scaled, the adapters' path run) and the
  SavedModel exporter's one-device model (each adapted weight dequantized
  and merged in float32, scales read with their weights) agree."""
  from layout_core.infer import decode  # pylint: disable=g-import-not-at-top
  from layout_core.infer.export import load_plain_model  # pylint: disable=g-import-not-at-top
  trainer = make(mesh_2x4, dtype)
  trace(trainer, 2)
  saver = Checkpointer(directory=str(tmp_path), state=trainer.state(),
                       config=CheckpointConfig())
  saver.prepare_directory()
  prefix = saver.save(2, reason='test')
  saver.wait()
  tokens = np.random.default_rng(3).integers(0, 32, size=(8, 16)).astype(np.int32)
  ours = decode.CachedLM(tuned(dtype), trainer.engine.variables,
                         batch_axis='data').logits(tokens).numpy()
  plain = load_plain_model(tuned(dtype), task=trainer.task, prefix=prefix)
  exported = plain.call(tf.constant(tokens)).numpy()
  assert_close(exported, ours, rel=1e-5, what=f'{dtype}: merged export vs the decoder')
  assert all(v.dtype == tf.float32 for v in plain.variables.values())


def test_a_narrow_dtype_with_nothing_frozen_is_refused():
  with pytest.raises(ConfigError) as raised:
    tune(transformer_lm_params(**MODEL), lora=None, trainable=None, frozen_dtype='int8')
  assert 'train.frozen_dtype' in str(raised.value) and 'lora' in raised.value.fix
  with pytest.raises(ConfigError):
    TrainConfig(frozen_dtype='int4')


# -- imported models -------------------------------------------------------------------------
def narrow_logits(run: str, dtype: str, tokens: np.ndarray) -> np.ndarray:
  """The logits of the imported run held in `dtype` as a LoRA run's base
  (the adapters start at zero), read by `checkpoint.init_from`."""
  from layout_core.infer import decode  # pylint: disable=g-import-not-at-top
  from plugins import gin_setup, inference  # pylint: disable=g-import-not-at-top
  from plugins.plan import make_plan  # pylint: disable=g-import-not-at-top
  from plugins.training import build_trainer  # pylint: disable=g-import-not-at-top
  with gin_setup.parsed_config(files=[inference.run_config(model_dir=run)],
                               bindings=['lora.rank = 4', "lora.targets = [r'.*/attn/wq']",
                                         f"train.frozen_dtype = '{dtype}'"]):
    plan = make_plan(data_splits=())
  trainer = build_trainer(plan)
  variables = trainer.engine.variables
  Checkpointer(directory=os.path.join(run, 'unused'), state=trainer.state(),
               config=CheckpointConfig()).init_from(
      run, variables, new=[p for p in variables if is_adapter(p) or frozen.is_scale(p)])
  return decode.CachedLM(plan.params, variables, batch_axis='data').logits(tokens).numpy()


@pytest.mark.parametrize('family', [f for f in hf_fixtures.CONFIGS if f != 'qwen2_moe'])
def test_imported_families_held_narrow_stay_within_the_stated_logit_bounds(family, tmp_path):
  """(Of the mixtures of experts, Mixtral: Qwen2-MoE routes the same way.)"""
  from plugins import hf, inference  # pylint: disable=g-import-not-at-top
  from tests.test_hf_models import TOKENS, relative_error  # pylint: disable=g-import-not-at-top
  hf_dir, run = str(tmp_path / 'hf'), str(tmp_path / 'run')
  hf_fixtures.write_checkpoint(hf_dir, family, tokenizer=False)
  hf.import_run(hf_dir=hf_dir, model_dir=run)
  reference = inference.load_decoder(files=[inference.run_config(model_dir=run)],
                                     model_dir=run).lm.logits(TOKENS).numpy()
  narrow = {dtype: narrow_logits(run, dtype, TOKENS) for dtype in ('bfloat16', 'int8')}
  errors = {dtype: relative_error(logits, reference) for dtype, logits in narrow.items()}
  print(f'{family}: relative logit error {errors}')
  if family in hf_config.MOE_FAMILIES:
    # A mixture of experts routes each token to its top k: a narrow base can
    # flip a near-tie, and that position's logits then move far (the max
    # above). The bound holds at the median position; the flips are counted.
    scale = np.abs(reference).max()
    errors = {dtype: float(np.median(np.abs(logits - reference).max(-1))) / scale
              for dtype, logits in narrow.items()}
    print(f'{family}: median position relative logit error {errors}')
  for dtype, error in errors.items():
    assert 0 < error < LOGIT_BOUNDS[dtype], (family, dtype, error)


# -- launched --------------------------------------------------------------------------------
def test_a_bfloat16_import_is_bit_for_bit_tuned_resumed_and_its_adapters_load_on_it(tmp_path):
  """launch.import_hf keeps a BF16 checkpoint's weights bit for bit in
  bfloat16; LoRA on them with `train.frozen_dtype = 'bfloat16'` (the base
  named, not copied), preempted and resumed, equals the run straight
  through; its PEFT adapters imported onto the original checkpoint compute
  its logits; its merged Hugging Face export is bfloat16 (the base's dtype)."""
  from layout_core.checkpoint.frozen_base import CheckpointView  # pylint: disable=g-import-not-at-top
  from layout_core.checkpoint.matching import key_for_name, names_in  # pylint: disable=g-import-not-at-top
  from layout_core.convert import hf as hf_lib  # pylint: disable=g-import-not-at-top
  from plugins import hf, inference  # pylint: disable=g-import-not-at-top
  from tests.test_hf_models import TOKENS, TOLERANCE, relative_error  # pylint: disable=g-import-not-at-top
  hf_dir, base = str(tmp_path / 'hf'), str(tmp_path / 'base')
  hf_fixtures.write_checkpoint(hf_dir, 'llama', dtype='bfloat16')
  done = run_module('launch.import_hf', f'--hf_dir={hf_dir}', f'--model_dir={base}')
  assert done.returncode == 0, done.stderr[-3000:]
  prefix = f'{base}/checkpoints/ckpt-0/ckpt'
  reader = tf.train.load_checkpoint(prefix)
  by_name = names_in(prefix)
  for path, value in hf_lib.open_hf(hf_dir).values():
    key = key_for_name(path, by_name)
    assert reader.get_variable_to_dtype_map()[key] == tf.bfloat16, key
    np.testing.assert_array_equal(reader.get_tensor(key).astype(np.float32), value,
                                  err_msg=key)  # the file's bits (widened exactly by both)
  tune_from = [f'--gin_file={base}/config.gin', '--gin_bindings=lora.rank = 4',
               "--gin_bindings=lora.targets = [r'.*/attn/w[qv]', r'.*/ffn/w_(gate|up|down)']",
               "--gin_bindings=train.frozen_dtype = 'bfloat16'",
               f"--gin_bindings=checkpoint.init_from = '{base}'",
               '--gin_bindings=train.num_steps = 6', '--gin_bindings=train.batch_size = 4',
               '--gin_bindings=train.eval_every = 0', '--gin_bindings=train.log_every = 1',
               '--gin_bindings=checkpoint.every_steps = 0',
               '--gin_bindings=optimizer.warmup_steps = 0',
               '--gin_bindings=optimizer.learning_rate = 0.01']
  straight, cut = str(tmp_path / 'straight'), str(tmp_path / 'cut')
  preempted = Launched('launch.train', *tune_from, f'--model_dir={cut}', label='preempted')
  with killed_if_left(preempted):
    done = run_modules([('launch.train', *tune_from, f'--model_dir={straight}')])[0]
    output = preempted.stop_after(r'step 2/6')
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'Saved checkpoint' in output, output[-2000:]
  resumed = run_module('launch.train', *tune_from, f'--model_dir={cut}')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  losses = {run: dict(read_events(run)['scalars']['train/loss']) for run in (straight, cut)}
  assert sorted(losses[cut]) == list(range(1, 7)) and losses[cut] == losses[straight]
  assert losses[cut][6] < losses[cut][1]
  view = CheckpointView(inference.find_checkpoint(model_dir=cut)[1])
  assert view.base_prefix == prefix  # the bfloat16 base named, not copied
  assert not [k for k in view.own if k.startswith('model/') and '_lora_' not in k
              and k.endswith('VARIABLE_VALUE')]
  files = [inference.run_config(model_dir=cut)]
  hf.export_run(export_dir=str(tmp_path / 'peft'), model_dir=cut, files=files,
                adapters_only=True)
  merged = hf.export_run(export_dir=str(tmp_path / 'merged'), model_dir=cut, files=files)
  assert merged['config']['torch_dtype'] == 'bfloat16'
  with open(f'{tmp_path}/merged/model.safetensors', 'rb') as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), 'little')))
  assert {v['dtype'] for k, v in header.items() if k != '__metadata__'} == {'BF16'}
  again = str(tmp_path / 'again')
  done = run_module('launch.import_hf', f'--hf_dir={hf_dir}', f'--peft_dir={tmp_path}/peft',
                    f'--model_dir={again}')
  assert done.returncode == 0, done.stderr[-3000:]

  def logits(run):
    loaded = inference.load_decoder(files=[inference.run_config(model_dir=run)], model_dir=run)
    return loaded.lm.logits(TOKENS).numpy()
  ours = logits(cut)
  assert relative_error(logits(again), ours) < TOLERANCE
  assert relative_error(logits(base), ours) > 100 * TOLERANCE  # control: the adapters matter
