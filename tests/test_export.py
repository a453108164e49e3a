"""launch.export end to end: real trainings, real exports, and a fresh interpreter
that imports only TensorFlow to load them, compared with meshgin's own outputs
of the same checkpoint restored on the 8-device mesh in this process.

The LM was trained on a data=2 x model=4 mesh with Megatron rules: its export
(one device, plain variables read from the checkpoint) is compared with the
same checkpoint restored on data=8 and run with DTensor."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, SPMD_ON_FOUR, run_module
from tests.numerics import assert_close

TRAIN = ['--gin_bindings=train.log_every = 1', '--gin_bindings=train.eval_every = 0',
         '--gin_bindings=checkpoint.every_steps = 2']
LM = ['--gin_file=configs/experiments/lm_2d.gin', '--gin_bindings=train.num_steps = 3']
# The SPMD pipeline holds its blocks stacked [stage, repeat, ...] on a stage x data x model
# mesh and saves them under the unpipelined model's per-block keys (cut to 2 blocks, on 4
# devices: 'model' splits the stack, as 'data' would).
PIPELINED = ['--gin_file=configs/experiments/lm_pipeline_spmd.gin',
             SPMD_ON_FOUR,
             '--gin_bindings=train.num_steps = 2', '--gin_bindings=transformer_lm.num_layers = 2',
             '--gin_bindings=pipeline.circular_repeats = 1',
             '--gin_bindings=pipeline.num_micro_batches = 2']
KERAS = ['--gin_search_paths=tests/fixtures', '--gin_file=my_project/keras.gin',
         '--gin_bindings=train.num_steps = 2']

# Run with `python -I` from a scratch directory: TensorFlow and numpy only. One
# process for the module (`TensorFlowAlone`): each stdin line asks it to load an
# export and run its calls; it answers a RESULT (or FAILED) line.
LOAD_WITH_TENSORFLOW_ALONE = r"""
import json, os, sys, traceback, warnings
import numpy as np
import tensorflow as tf

def load(export_dir, calls_path, out_path):
  loaded = tf.saved_model.load(export_dir)
  outputs, ops, lite = {}, {}, None
  for call, (signature, inputs) in json.load(open(calls_path)).items():
    arrays = {name: np.load(path) for name, path in inputs.items()}
    if call.startswith('tflite'):  # the same signature in model.tflite, TFLite's interpreter
      if lite is None:
        with warnings.catch_warnings():
          warnings.simplefilter('ignore')  # tf.lite.Interpreter is deprecated for LiteRT's
          lite = tf.lite.Interpreter(model_path=os.path.join(export_dir, 'model.tflite'))
      result = lite.get_signature_runner(signature)(**arrays)
      outputs.update({f'{call}/{key}': value for key, value in result.items()})
      continue
    function = loaded.signatures[signature]
    result = function(**{name: tf.constant(array) for name, array in arrays.items()})
    outputs.update({f'{call}/{key}': value.numpy() for key, value in result.items()})
    graph = function.graph.as_graph_def()
    ops[signature] = sorted({n.op for n in graph.node} |
                            {n.op for f in graph.library.function for n in f.node_def})
  np.savez(out_path, **outputs)
  meshgin = sorted(m for m in sys.modules
                   if m.split('.')[0] in ('layout_core', 'plugins', 'launch'))
  return {'meshgin_modules': meshgin, 'ops': ops, 'signatures': sorted(loaded.signatures)}

for request in sys.stdin:
  try:
    print('RESULT ' + json.dumps(load(*json.loads(request))), flush=True)
  except Exception:
    print('FAILED ' + json.dumps(traceback.format_exc()), flush=True)
"""


class TensorFlowAlone:
  """A fresh `python -I` that imports TensorFlow (no meshgin module) and loads
  the exports the module's tests ask for, one after another."""

  def __init__(self, scratch):
    self.stderr = open(os.path.join(scratch, 'stderr.txt'), 'w+')
    self.process = subprocess.Popen(
        [sys.executable, '-I', '-c', LOAD_WITH_TENSORFLOW_ALONE], cwd=scratch,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
        env={k: v for k, v in os.environ.items() if k != 'PYTHONPATH'})

  def load(self, export_dir: str, calls: dict, scratch) -> tuple[dict, dict]:
    """({call/output: array}, {'meshgin_modules', 'ops', 'signatures'}); `calls`
    is {call name: (signature, {input name: array})}, a name starting
    'tflite' running the signature of `model.tflite` in TFLite's interpreter."""
    os.makedirs(scratch, exist_ok=True)
    files = {}
    for call, (signature, inputs) in calls.items():
      paths = {}
      for name, array in inputs.items():
        paths[name] = os.path.join(scratch, f'{call}-{name}.npy')
        np.save(paths[name], array)
      files[call] = (signature, paths)
    calls_path, out = os.path.join(scratch, 'calls.json'), os.path.join(scratch, 'out.npz')
    with open(calls_path, 'w') as f:
      json.dump(files, f)
    self.process.stdin.write(json.dumps([export_dir, calls_path, out]) + '\n')
    self.process.stdin.flush()
    line = ''
    while not line.startswith(('RESULT ', 'FAILED ')):
      line = self.process.stdout.readline()
      if not line:
        self.stderr.seek(0)
        raise AssertionError(f'the TensorFlow-alone loader exited {self.process.wait()}:\n'
                             f'{self.stderr.read()[-3000:]}')
    word, _, body = line.partition(' ')
    assert word == 'RESULT', json.loads(body)
    return dict(np.load(out)), json.loads(body)

  def close(self) -> None:
    self.process.stdin.close()
    self.process.wait(60)
    self.stderr.close()


@pytest.fixture(scope='module')
def tensorflow_alone(tmp_path_factory):
  loader = TensorFlowAlone(tmp_path_factory.mktemp('tensorflow_alone'))
  yield loader
  loader.close()


def restored_on_mesh(prefix: str, mesh, search_paths=()):
  """(plan, BuiltModel): the model of the checkpoint at `prefix` (from its
  config.gin) built on `mesh`, unpipelined, its variables read by meshgin's
  own sliced reader."""
  from layout_core.checkpoint.shard_io import checkpoint_entries, read_entries
  from layout_core.model.base import compute_params
  from layout_core.model.built import build_params_model
  from layout_core.params import Params
  from plugins import gin_setup, plan
  config = os.path.join(os.path.dirname(prefix), 'config.gin')
  with gin_setup.parsed_config(files=[config], bindings=[], search_paths=search_paths):
    run_plan = plan.make_plan()
  if isinstance(run_plan.params, Params):
    built = build_params_model(compute_params(run_plan.params), mesh=mesh, rules=None, seed=0)
  else:
    from layout_core.model import keras  # pylint: disable=g-import-not-at-top
    built = keras.build(run_plan.params, mesh=mesh, rules=None, seed=0,
                        input_specs=run_plan.task.input_specs(8))
  read_entries(prefix, checkpoint_entries({'model': built.checkpoint_root}))
  return run_plan, built


def meshgin_outputs(prefix: str, inputs: tuple, mesh, search_paths=()) -> np.ndarray:
  """The restored model (`restored_on_mesh`) run with DTensor on `inputs`
  split over 'data'."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.experimental import dtensor  # pylint: disable=g-import-not-at-top
  from layout_core.layout.mesh import pack_global_array
  from layout_core.layout.variables import to_numpy
  _, built = restored_on_mesh(prefix, mesh, search_paths)
  packed = [pack_global_array(x, dtensor.Layout(['data'] + ['unsharded'] * (x.ndim - 1), mesh))
            for x in inputs]
  return to_numpy(tf.function(lambda *xs: built.call(xs, False))(*packed))


def export(model_dir: str, export_dir: str, *args: str):
  return run_module('launch.export', f'--model_dir={model_dir}', f'--export_dir={export_dir}',
                    *args)


@pytest.fixture(scope='module')
def lm(tmp_path_factory):
  """(model_dir, export_dir, prefix of its newest checkpoint): a 3-step LM run
  on data=2 x model=4, exported with --tflite."""
  root = tmp_path_factory.mktemp('export')
  model_dir, export_dir = str(root / 'run'), str(root / 'exports' / 'lm' / '1')
  trained = run_module('launch.train', *LM, *TRAIN, f'--model_dir={model_dir}')
  assert trained.returncode == 0, trained.stderr[-3000:]
  exported = export(model_dir, export_dir, '--tflite')  # creates exports/lm/ too
  assert exported.returncode == 0, exported.stderr[-3000:]
  assert 'Exported step 3 ' in exported.stdout, exported.stdout
  return model_dir, export_dir, os.path.join(model_dir, 'checkpoints', 'ckpt-3', 'ckpt')


def test_the_export_loads_with_tensorflow_alone_and_gives_meshgin_logits(tensorflow_alone, lm,
                                                                           mesh_data8,
                                                                           tmp_path):
  _, export_dir, prefix = lm
  tokens = np.random.default_rng(0).integers(0, 64, (8, 64)).astype(np.int32)
  changed = tokens.copy()
  changed[:, 40] = (changed[:, 40] + 1) % 64
  outputs, report = tensorflow_alone.load(
      export_dir, {'a': ('serving_default', {'tokens': tokens}),
                   'b': ('serving_default', {'tokens': changed[:3]}),
                   'tflite': ('serving_default', {'tokens': tokens})}, tmp_path / 'fresh')
  assert report['meshgin_modules'] == []
  for signature, ops in report['ops'].items():
    assert not [op for op in ops if 'DTensor' in op or 'Relayout' in op or 'Mesh' in op], ops
    assert 'MatMul' in ops or 'Einsum' in ops or 'BatchMatMulV2' in ops, ops  # a real graph
  exported = outputs['a/logits']
  assert exported.shape == (8, 64, 64) and exported.dtype == np.float32
  reference = meshgin_outputs(prefix, (tokens,), mesh_data8)
  difference = float(np.max(np.abs(exported - reference)))
  print(f'max |export - meshgin on data=8| = {difference:.3g}')
  # measured: 5e-07 / 5e-07 (default / no oneDNN)
  assert_close(exported, reference, rel=5e-6, what='logits')
  lite = float(np.max(np.abs(outputs['tflite/logits'] - exported)))
  print(f'max |TFLite - SavedModel| = {lite:.3g}')
  # measured: 5e-07 / 5e-07 (default / no oneDNN)
  assert_close(outputs['tflite/logits'], exported, rel=5e-6, what='tflite logits')
  # Causal, as the docs promise: a token changes its own and later positions' logits only.
  other = outputs['b/logits']
  assert np.array_equal(other[:, :40], exported[:3, :40])
  assert np.max(np.abs(other[:, 40:] - exported[:3, 40:])) > 1e-3


PROMPTS = np.random.default_rng(2).integers(0, 64, (8, 32)).astype(np.int32)
LENGTHS = np.array([1, 5, 32, 17, 9, 32, 2, 26], np.int32)


def launch_decode(model_dir: str, scratch, *flags: str) -> np.ndarray:
  """launch.decode's continuations [8, 32] of PROMPTS (LENGTHS), decoded on the
  run's own data=2 x model=4 mesh in its own process."""
  os.makedirs(scratch, exist_ok=True)
  prompts_file, decoded_file = os.path.join(scratch, 'prompts.jsonl'), os.path.join(
      scratch, 'decoded.jsonl')
  with open(prompts_file, 'w') as f:
    for row, length in zip(PROMPTS, LENGTHS):
      f.write(json.dumps({'ids': row[:length].tolist()}) + '\n')
  decoding = run_module('launch.decode', f'--model_dir={model_dir}', '--max_new_tokens=32',
                        f'--prompts_file={prompts_file}', f'--output={decoded_file}', *flags)
  assert decoding.returncode == 0, decoding.stderr[-3000:]
  with open(decoded_file) as f:
    return np.array([json.loads(line)['continuation'] for line in f], np.int32)


def test_generate_equals_launch_decode_on_the_runs_mesh(tensorflow_alone, lm, tmp_path):
  """The export's greedy `generate`, with TensorFlow alone and with TFLite."""
  model_dir, export_dir, _ = lm
  inputs = {'prompts': PROMPTS, 'lengths': LENGTHS}
  outputs, report = tensorflow_alone.load(
      export_dir, {'g': ('generate', inputs), 'tflite': ('generate', inputs)},
      tmp_path / 'fresh')
  assert report['signatures'] == ['generate', 'serving_default']
  assert report['meshgin_modules'] == []
  assert {'While', 'StatelessWhile'} & set(report['ops']['generate'])  # the loop is in the graph
  decoded = launch_decode(model_dir, tmp_path / 'decode')
  exported = outputs['g/tokens']
  assert exported.shape == (8, 32) and exported.dtype == np.int32
  print(f'generate: {np.mean(exported == decoded):.4f} of the tokens agree with launch.decode')
  assert np.array_equal(exported, decoded)
  assert np.array_equal(outputs['tflite/tokens'], decoded)
  assert len({tuple(row) for row in decoded}) > 1  # the rows decode differently


def test_a_sampling_export_draws_what_launch_decode_draws_with_the_seed(tensorflow_alone, lm,
                                                                       tmp_path):
  model_dir, _, _ = lm
  export_dir = str(tmp_path / 'sampled' / '1')
  os.makedirs(os.path.dirname(export_dir))
  exported = export(model_dir, export_dir, '--temperature=0.8', '--top_k=10')
  assert exported.returncode == 0, exported.stderr[-3000:]
  assert 'seed int64 []' in exported.stdout
  calls = {name: ('generate', {'prompts': PROMPTS, 'lengths': LENGTHS,
                               'seed': np.array(seed, np.int64)})
           for name, seed in (('a', 7), ('again', 7), ('other', 8))}
  outputs, _ = tensorflow_alone.load(export_dir, calls, tmp_path / 'fresh')
  assert np.array_equal(outputs['a/tokens'], outputs['again/tokens'])
  assert np.mean(outputs['a/tokens'] == outputs['other/tokens']) < 0.5  # the seed matters
  decoded = launch_decode(model_dir, tmp_path / 'decode', '--temperature=0.8', '--top_k=10',
                          '--seed=7')
  assert np.array_equal(outputs['a/tokens'], decoded)


def test_generate_refuses_lengths_outside_1_to_prompt_len(lm):
  """The graph checks its inputs: a length of 0 would decode from an empty
  state, one past the prompts' 32 positions gather out of range."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  _, export_dir, _ = lm
  generate = tf.saved_model.load(export_dir).signatures['generate']
  prompts = tf.constant(PROMPTS[:2])
  assert generate(prompts=prompts, lengths=tf.constant([1, 32]))['tokens'].shape == (2, 32)
  for lengths, says in (([5, 0], 'every length must be at least 1'),
                        ([33, 5], 'no length may exceed prompt_len'),
                        ([5], 'lengths needs one entry per prompt row')):
    with pytest.raises(tf.errors.InvalidArgumentError, match=says):
      generate(prompts=prompts, lengths=tf.constant(lengths, tf.int32))


def test_a_default_prompt_len_below_1_names_the_flags(lm, tmp_path):
  model_dir, _, _ = lm
  refused = export(model_dir, str(tmp_path / 'short' / '1'), '--seq_len=16',
                   '--max_new_tokens=20')
  assert refused.returncode == 2, refused.stderr[-3000:]
  assert 'seq_len - max_new_tokens = 16 - 20 = -4 positions' in refused.stderr
  assert '--prompt_len' in refused.stderr and 'Traceback' not in refused.stderr
  assert not os.path.exists(tmp_path / 'short')


def test_the_export_is_complete_and_leaves_nothing_beside_it(lm):
  _, export_dir, _ = lm
  assert os.listdir(os.path.dirname(export_dir)) == ['1']
  assert {'saved_model.pb', 'variables', 'assets.extra', 'model.tflite'} <= set(
      os.listdir(export_dir))
  with open(os.path.join(export_dir, 'assets.extra', 'meshgin_export.json')) as f:
    record = json.load(f)
  assert record['step'] == 3 and record['checkpoint'].endswith('ckpt-3/ckpt')
  assert record['tflite'] == 'model.tflite'
  assert record['signatures']['serving_default']['inputs'] == {'tokens': [[None, 64], 'int32']}
  assert record['signatures']['serving_default']['outputs'] == {
      'logits': [[None, 64, 64], 'float32']}
  assert record['signatures']['generate']['inputs'] == {
      'prompts': [[None, 32], 'int32'], 'lengths': [[None], 'int32']}
  assert record['signatures']['generate']['outputs'] == {'tokens': [[None, 32], 'int32']}


def saved_model_cli(*args: str) -> subprocess.CompletedProcess:
  """TensorFlow's `saved_model_cli ARGS` (its console script calls this
  module's main), forked from the session's zygote: each of the three
  commands below would otherwise pay TensorFlow's import again."""
  return run_module('tensorflow.python.tools.saved_model_cli', *args)


def test_saved_model_cli_shows_and_runs_serving_default(lm, mesh_data8, tmp_path):
  _, export_dir, prefix = lm
  shown = saved_model_cli('show', '--dir', export_dir, '--all')
  assert shown.returncode == 0, shown.stderr[-3000:]
  serving = shown.stdout.split("signature_def['serving_default']", 1)[1]
  assert "inputs['tokens'] tensor_info:" in serving and 'dtype: DT_INT32' in serving
  assert 'shape: (-1, 64)' in serving and "outputs['logits'] tensor_info:" in serving
  generate = shown.stdout.split("signature_def['generate']", 1)[1].split('signature_def[')[0]
  assert "inputs['prompts'] tensor_info:" in generate and 'shape: (-1, 32)' in generate
  tokens = np.arange(128, dtype=np.int32).reshape(2, 64) % 64
  np.save(tmp_path / 'tokens.npy', tokens)
  reference = meshgin_outputs(prefix, (tokens.repeat(4, axis=0),), mesh_data8)[::4]  # 8 rows
  # --input_exprs takes Python literals only (TF 2.21's safe mode): the ids written out.
  for name, given in (('exprs', ['--input_exprs', f'tokens={tokens.tolist()}'.replace(' ', '')]),
                      ('npy', ['--inputs', f'tokens={tmp_path / "tokens.npy"}'])):
    ran = saved_model_cli('run', '--dir', export_dir, '--tag_set', 'serve',
                          '--signature_def', 'serving_default', *given,
                          '--outdir', str(tmp_path / name))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert 'Output logits is saved to' in ran.stdout + ran.stderr
    logits = np.load(tmp_path / name / 'logits.npy')
    assert logits.shape == (2, 64, 64)
    # measured: 2.3e-07 / 2.3e-07 (default / no oneDNN)
    assert_close(logits, reference, rel=3e-6, what=f'logits: {name}')


def test_an_existing_export_exits_2_untouched_and_overwrite_replaces_it(lm, tmp_path):
  model_dir, export_dir, _ = lm
  before = {name: os.path.getmtime(os.path.join(export_dir, name))
            for name in os.listdir(export_dir)}
  again = export(model_dir, export_dir)
  assert again.returncode == 2, again.stderr[-3000:]
  assert f'{export_dir} already exists; it was left untouched' in again.stderr
  assert '--overwrite' in again.stderr and 'Traceback' not in again.stderr
  assert {name: os.path.getmtime(os.path.join(export_dir, name))
          for name in os.listdir(export_dir)} == before
  copy = str(tmp_path / 'exports' / '1')
  shutil.copytree(export_dir, copy)
  replaced = run_module('launch.export', f'--export_dir={copy}', '--overwrite',
                        f'--checkpoint={model_dir}/checkpoints/ckpt-2')
  assert replaced.returncode == 0, replaced.stderr[-3000:]
  with open(os.path.join(copy, 'assets.extra', 'meshgin_export.json')) as f:
    assert json.load(f)['step'] == 2
  assert os.listdir(os.path.dirname(copy)) == ['1']  # the old one and the temporary gone


def test_no_checkpoint_or_another_models_config_exits_2_leaving_nothing(lm, tmp_path):
  model_dir, _, _ = lm
  target = str(tmp_path / 'out' / '1')
  empty = str(tmp_path / 'empty')
  os.makedirs(empty)
  none = export(empty, target)
  assert none.returncode == 2, none.stderr[-3000:]
  assert 'holds no checkpoint' in none.stderr and 'Traceback' not in none.stderr
  other = export(model_dir, target, '--gin_bindings=transformer_lm.ffn_dim = 128')
  assert other.returncode == 2, other.stderr[-3000:]
  assert 'does not match this model: 6 variable(s) with other shapes [' in other.stderr
  assert ('model/stack/block_000/ffn/w_in/.ATTRIBUTES/VARIABLE_VALUE: checkpoint shape '
          '[64, 256], model shape [64, 128]') in other.stderr
  assert 'Traceback' not in other.stderr
  assert os.listdir(tmp_path) == ['empty']  # no export, no temporary directory, no parent


def test_a_keras_models_export_gives_meshgin_predictions(tensorflow_alone, tmp_path,
                                                        mesh_data8):
  model_dir, export_dir = str(tmp_path / 'run'), str(tmp_path / 'exports' / '1')
  trained = run_module('launch.train', *KERAS, *TRAIN, f'--model_dir={model_dir}')
  assert trained.returncode == 0, trained.stderr[-3000:]
  os.makedirs(os.path.dirname(export_dir))
  exported = export(model_dir, export_dir, '--gin_search_paths=tests/fixtures')
  assert exported.returncode == 0, exported.stderr[-3000:]
  points = np.random.default_rng(1).normal(size=(8, 8)).astype(np.float32)
  outputs, report = tensorflow_alone.load(
      export_dir, {'a': ('serving_default', {'inputs': points})}, tmp_path / 'fresh')
  assert report['meshgin_modules'] == [] and report['signatures'] == ['serving_default']
  prefix = os.path.join(model_dir, 'checkpoints', 'ckpt-2', 'ckpt')
  reference = meshgin_outputs(prefix, (points,), mesh_data8,
                              search_paths=[os.path.join(REPO_ROOT, 'tests', 'fixtures')])
  assert outputs['a/predictions'].shape == (8, 4)
  # measured: 1.7e-07 / 1.7e-07 (default / no oneDNN)
  assert_close(outputs['a/predictions'], reference, rel=2e-6, what='predictions')


def test_a_pipelined_runs_export_gives_the_unpipelined_models_logits(tensorflow_alone, tmp_path,
                                                                    mesh_data8):
  model_dir, export_dir = str(tmp_path / 'run'), str(tmp_path / 'exports' / '1')
  trained = run_module('launch.train', *PIPELINED, *TRAIN, f'--model_dir={model_dir}')
  assert trained.returncode == 0, trained.stderr[-3000:]
  os.makedirs(os.path.dirname(export_dir))
  exported = export(model_dir, export_dir)
  assert exported.returncode == 0, exported.stderr[-3000:]
  tokens = np.random.default_rng(3).integers(0, 64, (8, 64)).astype(np.int32)
  outputs, report = tensorflow_alone.load(
      export_dir, {'a': ('serving_default', {'tokens': tokens})}, tmp_path / 'fresh')
  assert report['meshgin_modules'] == []
  prefix = os.path.join(model_dir, 'checkpoints', 'ckpt-2', 'ckpt')
  reference = meshgin_outputs(prefix, (tokens,), mesh_data8)  # the blocks, no pipeline
  difference = float(np.max(np.abs(outputs['a/logits'] - reference)))
  print(f'max |export of the pipelined run - meshgin unpipelined on data=8| = {difference:.3g}')
  # measured on 4 devices: 4.0e-07 / 4.0e-07 / 4.0e-07 (default / no oneDNN / 1 thread)
  assert_close(outputs['a/logits'], reference, rel=5e-6, what='logits')
