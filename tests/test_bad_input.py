"""Everyday mistakes through the real CLI: exit 2, one clear paragraph, nothing lost.

Each case runs `launch.train` in a subprocess against the model_dir of a real,
finished run and checks: exit code 2, no traceback, the message names what
is wrong (parameter, file and line, variable, rule, mesh axis), and every
file in that model_dir is byte-identical afterwards (sha256). Then the same
config goes through `launch.inspect`, which must reject it too (it shares the
typed plan), except for what only the machine can tell (devices, an existing
checkpoint, the model_dir), marked `train_only`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil

import numpy as np
import pytest

from tests.conftest import run_module, run_modules

QUICK = ['--gin_file=configs/experiments/quickstart.gin', '--gin_bindings=train.num_steps = 2',
         '--gin_bindings=train.eval_batches = 1', '--gin_bindings=train.log_every = 1']
MEGATRON = ['--gin_file=configs/experiments/lm_2d.gin']


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  args: tuple[str, ...]
  expected: tuple[str, ...]        # each must appear in the message
  base: tuple[str, ...] = tuple(QUICK)
  train_only: bool = False         # needs the machine: inspect accepts it


def binding(text: str) -> str:
  return f'--gin_bindings={text}'


CASES = [
    # gin-level mistakes
    Case('unknown parameter', (binding('train.stepz = 3'),),
         ("'stepz'", "Did you mean 'num_steps'")),
    Case('unknown configurable', (binding('trainn.num_steps = 3'),),
         ("Did you mean 'train'",)),
    Case('unknown reference', (binding('model.params = @transformer_lmm()'),),
         ("Did you mean 'transformer_lm'",)),
    Case('missing gin file', ('--gin_file=configs/nope.gin',), ("'configs/nope.gin' not found",)),
    Case('required value unset', ('--gin_file=configs/runs/train.gin',), ('model.params',),
         base=()),
    Case('unclosed bracket in a binding', (binding("mesh.shape = {'data': 8"),),
         ('unclosed bracket', "mesh.shape = {'data': 8")),
    Case('undefined macro', (binding('train.num_steps = %STEPS'),),
         ('macro %STEPS', 'never defined')),
    Case('include cycle', ('--gin_file={tmp}/cycle_a.gin',),
         ('include cycle', 'cycle_a.gin (line 1)', 'cycle_b.gin (line 2)'), base=()),
    Case('include of a missing file', ('--gin_file={tmp}/includes_missing.gin',),
         ("includes_missing.gin, line 2 includes 'configs/models/lm_tinyy.gin'",), base=()),
    Case('syntax error in a file', ('--gin_file={tmp}/syntax.gin',),
         ('syntax.gin, line 3', "expected ':' or '='"), base=()),
    # types and ranges, named by their gin parameter
    Case('string for a number', (binding("train.num_steps = 'ten'"),),
         ("train.num_steps = 'ten' is a str", 'must be an int')),
    Case('float step count', (binding('train.num_steps = 10.5'),),
         ('train.num_steps = 10.5 is a float', "set in --gin_bindings")),
    Case('string for a dict', (binding("mesh.shape = 'data'"),),
         ("mesh.shape = 'data' is a str", 'a dict')),
    Case('rule spec not a tuple', (binding("layout_rules.rules = [('.*/w_in', 3)]"),),
         ('has spec 3, not a tuple of mesh axis names',)),
    Case('size below 1', (binding('transformer_lm.model_dim = 0'),),
         ('transformer_lm.model_dim is 0', 'at least 1')),
    Case('negative batch', (binding('train.batch_size = -4'),),
         ('train.batch_size is -4',)),
    Case('seq_len above max_len', (binding('data.seq_len = 128'),),
         ('data.seq_len=128', 'transformer_lm.max_len=64')),
    Case('heads do not divide the width', (binding('transformer_lm.num_heads = 5'),),
         ('transformer_lm.num_heads=5 does not divide transformer_lm.model_dim=64',)),
    Case('unknown activation', (binding("transformer_lm.activation = 'tanh'"),),
         ("transformer_lm.activation is 'tanh'", "'relu', 'gelu'")),
    Case('override key that does not exist', (binding("model.overrides = {'sub[1].repet': 3}"),),
         ("model.overrides key 'sub[1].repet'", "did you mean 'repeat'")),
    Case('override index that does not exist', (binding("model.overrides = {'sub[7].repeat': 3}"),),
         ("'sub' has 4 entries, so [7] does not exist",)),
    Case('unknown decay', (binding("optimizer.decay = 'cosin'"),),
         ("optimizer.decay is 'cosin'",)),
    Case('negative learning rate', (binding('optimizer.learning_rate = -0.1'),),
         ('optimizer.learning_rate is -0.1',)),
    Case('device memory that is not positive', (binding('mesh.device_memory_gb = -16'),),
         ('mesh.device_memory_gb is -16, but it must be positive',)),
    Case('peak FLOPs that are a string', (binding("mesh.peak_flops_per_device = '1e12'"),),
         ("mesh.peak_flops_per_device = '1e12' is a str",)),
    Case('unknown optimizer', (binding("optimizer.name = 'adamw'"),),
         ("optimizer.name is 'adamw'", "'adafactor'")),
    Case('sharded state over a missing axis', (binding("optimizer.shard_state = 'model'"),),
         ("optimizer.shard_state = 'model' is not a mesh axis", "'data'")),
    Case('Adafactor decay rate out of range', (binding('optimizer.adafactor_decay_rate = 1.5'),),
         ('optimizer.adafactor_decay_rate',)),
    Case('unknown compute dtype', (binding("train.compute_dtype = 'float16'"),),
         ("train.compute_dtype is 'float16'", "'bfloat16'")),
    Case('unknown remat policy', (binding("train.remat = 'all'"),),
         ("train.remat is 'all'", "'block'")),
    Case('accumulation that does not divide the batch', (binding('train.grad_accum_steps = 5'),),
         ('train.grad_accum_steps=5 does not divide train.batch_size=32',)),
    Case('keep no checkpoints', (binding('checkpoint.keep = 0'),),
         ('checkpoint.keep is 0',)),
    Case('branching above vocabulary', (binding('data.branching = 100'),),
         ('data.branching=100',)),
    Case('missing text file', (binding("data.text_file = '/nonexistent/corpus.txt'"),),
         ("data.text_file '/nonexistent/corpus.txt' does not exist",)),
    # layout rules
    Case('invalid regex', (binding("layout_rules.rules = [('(', ('model',))]"),),
         ('is not a valid regex',)),
    Case('rule names an unknown axis', (binding(
        "layout_rules.rules = [(r'.*/ffn/w_in', ('unsharded', 'modle'))]"),),
         ("names mesh axis 'modle'", "['data', 'model']"), base=tuple(MEGATRON)),
    Case('rule of the wrong rank', (binding(
        "layout_rules.rules = [(r'.*/ffn/w_in', ('model',))]"),),
         ("'lm/stack/block_000/ffn/w_in' has rank 2",), base=tuple(MEGATRON)),
    Case('dimension not divisible by its axis', (binding('transformer_lm.ffn_dim = 250'),),
         ("dim 1 has size 250, not divisible by mesh axis 'model' of size 4",),
         base=tuple(MEGATRON)),
    Case('one axis twice in a spec', (binding(
        "layout_rules.rules = [(r'.*/ffn/w_in', ('model', 'model'))]"),),
         ("shards over axis 'model' twice",), base=tuple(MEGATRON)),
    Case('strict rules that match nothing', (
        binding("layout_rules.rules = [(r'.*/nothing', ('model',))]"),
        binding('layout_rules.strict = True')),
         ("matched no variable: rule 0 ('.*/nothing'",), base=tuple(MEGATRON)),
    Case('embedding sharded along the vocabulary', (binding(
        "layout_rules.rules = [(r'.*/emb/table', ('model', 'unsharded'))]"),),
         ("'lm/emb/table'", 'DTensor cannot run', "('unsharded', 'model')"),
         base=tuple(MEGATRON)),
    Case('batch that does not split over data', (binding('train.batch_size = 30'),),
         ("train.batch_size=30 does not split over mesh axis 'data' of size 8",)),
    Case('micro-batches that do not divide the batch',
         (binding('pipeline.num_micro_batches = 3'),),
         ('num_micro_batches=3 does not divide the batch of 32',),
         base=('--gin_file=configs/experiments/lm_pipeline.gin',)),
    # what only the machine or the model_dir can tell
    Case('GPU mesh without GPUs', (binding("mesh.device_type = 'GPU'"),),
         ("mesh.device_type = 'CPU'",), train_only=True),
    Case('checkpoint of another model', (binding('transformer_lm.num_layers = 3'),),
         ('does not match this model', 'block_002'), train_only=True),
    Case('no model_dir', ('--model_dir=',),  # the flag has no default to fall back on
         ('--model_dir is not given', 'add --model_dir=runs/<name>'), train_only=True),
    Case('model_dir that is a file', ('--model_dir={tmp}/a_file',),
         ('is a file, not a directory',), train_only=True),
    Case('model_dir that cannot be written', ('--model_dir=/proc/meshgin-run',),
         ('is not writable',), train_only=True),
]


def tree_digest(root: str) -> dict[str, str]:
  digest = {}
  for folder, _, names in os.walk(root):
    for name in names:
      path = os.path.join(folder, name)
      with open(path, 'rb') as f:
        digest[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
  return digest


@pytest.fixture(scope='module')
def existing_run(tmp_path_factory):
  """A finished real run (2 steps, checkpointed) and the helper files cases need."""
  tmp = tmp_path_factory.mktemp('bad_input')
  (tmp / 'cycle_a.gin').write_text(f"include '{tmp}/cycle_b.gin'\n")
  (tmp / 'cycle_b.gin').write_text(f"train.num_steps = 3\ninclude '{tmp}/cycle_a.gin'\n")
  (tmp / 'includes_missing.gin').write_text(
      "include 'configs/runs/train.gin'\ninclude 'configs/models/lm_tinyy.gin'\n")
  (tmp / 'syntax.gin').write_text(
      "include 'configs/runs/train.gin'\ninclude 'configs/models/lm_tiny.gin'\n"
      'train.num_steps == 3\n')
  (tmp / 'a_file').write_text('not a directory\n')
  model_dir = str(tmp / 'run')
  result = run_module('launch.train', *QUICK, binding('train.eval_every = 0'),
                      f'--model_dir={model_dir}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert os.path.isdir(os.path.join(model_dir, 'checkpoints', 'ckpt-2'))
  return str(tmp), model_dir, tree_digest(model_dir)


def test_the_catalogue_is_large_and_distinct():
  assert len(CASES) >= 30
  assert len({c.name for c in CASES}) == len({c.args for c in CASES}) == len(CASES)


def case_args(case: Case, tmp: str, model_dir: str) -> list[str]:
  args = [a.replace('{tmp}', tmp) for a in case.base + case.args]
  if not any(a.startswith('--model_dir') for a in args):
    args.append(f'--model_dir={model_dir}')
  return args


@pytest.fixture(scope='module')
def outcomes(existing_run):
  """{case name: (train's result, inspect's result, the run it was pointed at)}.

  Every case's two runs are started two at a time (independent processes);
  each case gets its own copy of the finished run, so no two trainers ever
  meet at one model_dir's lock."""
  tmp, model_dir, _ = existing_run
  calls, runs = [], []
  for i, case in enumerate(CASES):
    run = os.path.join(tmp, 'runs', str(i))
    shutil.copytree(model_dir, run)
    runs.append(run)
    args = case_args(case, tmp, run)
    calls.append(('launch.train', *args))
    calls.append(('launch.inspect', *[a for a in args if not a.startswith('--model_dir')]))
  results = run_modules(calls)
  return {case.name: (results[2 * i], results[2 * i + 1], runs[i])
          for i, case in enumerate(CASES)}


@pytest.mark.parametrize('case', CASES, ids=[c.name for c in CASES])
def test_bad_input_exits_2_clearly_and_changes_nothing(case, existing_run, outcomes):
  _, _, before = existing_run
  result, inspected, model_dir = outcomes[case.name]
  assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
  assert 'Traceback' not in result.stderr
  assert 'In call to configurable' not in result.stderr  # gin's noise is dropped
  message = result.stderr[result.stderr.index('Configuration error:'):]
  for expected in case.expected:
    assert expected in ' '.join(message.split()), (expected, message)
  assert tree_digest(model_dir) == before, 'the existing run was changed'

  if case.train_only:
    assert inspected.returncode == 0, inspected.stderr[-2000:]
  else:
    assert inspected.returncode == 2, inspected.stderr[-2000:]
    assert ' '.join(message.split()) in ' '.join(inspected.stderr.split())


def test_errors_that_need_no_tensorflow_come_before_it_is_imported(existing_run):
  """A typo is reported without importing TensorFlow (seconds, not tens)."""
  _, model_dir, _ = existing_run
  result = run_module('launch.train', *QUICK, binding('train.stepz = 3'),
                      '--model_dir=' + model_dir, env={'PYTHONPROFILEIMPORTTIME': '1'})
  assert result.returncode == 2
  imported = [line.split('|')[-1].strip() for line in result.stderr.splitlines()
              if line.startswith('import time:')]
  assert 'gin' in imported and not any(m.startswith('tensorflow') for m in imported)


def test_a_layout_dtensor_cannot_run_fails_before_training_and_updates_nothing(mesh_2x4):
  """The dry step catches what no static check knows: an embedding layer that
  does not declare its table unshardable along the vocabulary."""
  from layout_core.tasks.lm import MarkovTask  # pylint: disable=import-outside-toplevel
  from layout_core.errors import ConfigError
  from layout_core.model.base import Declared
  from layout_core.model.layers import Embedding
  from layout_core.model.lm import transformer_lm_params
  from layout_core.optim import OptimizerConfig
  from layout_core.layout.rules import LayoutRules
  from layout_core.train.config import TrainConfig
  from layout_core.train.engine import check_step_compiles
  from layout_core.run import make_trainer
  from layout_core.layout.variables import Normal, to_numpy

  class UndeclaredEmbedding(Embedding):
    @classmethod
    def declare_variables(cls, p):
      return [Declared('table', (p.vocab_size, p.dim), Normal(p.init_stddev))]

  lm = transformer_lm_params(vocab_size=32, model_dim=16, num_heads=2, ffn_dim=32,
                             num_layers=1, max_len=0)
  lm.Set(**{'sub[0].cls': UndeclaredEmbedding})
  trainer = make_trainer(model=lm, mesh=mesh_2x4,
                    rules=LayoutRules([(r'.*/emb/table', ('model', 'unsharded'))]),
                    task=MarkovTask(vocab_size=32, seq_len=8), optimizer=OptimizerConfig(),
                    config=TrainConfig(batch_size=8, num_steps=2))
  before = {p: to_numpy(v) for p, v in trainer.engine.variables.items()}
  with pytest.raises(ConfigError) as raised:
    check_step_compiles(trainer.engine, trainer.task, trainer.config)
  message = str(raised.value)
  assert 'DTensor cannot run this model with these layouts' in message
  assert 'ResourceGather' in message or 'sharded 0th dimension' in message, message
  assert "'lm/emb/table' ('model', 'unsharded') by rule 0: .*/emb/table" in message
  for path, value in before.items():
    np.testing.assert_array_equal(to_numpy(trainer.engine.variables[path]), value, err_msg=path)
  assert trainer.current_step == 0
