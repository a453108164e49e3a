"""launch.eval with real processes: a checkpoint evaluated on other meshes gives
the loss its training run logged, and the run's directory is left as it was.

One short quickstart training (data=2) is shared by the module; its final
evaluation (run_status.json, TensorBoard eval/* at the final step) is the
independent reference: another process, mesh and layout reading the
checkpoint must reproduce it within float rounding. The step-0 evaluation is
the positive control: the checkpoint's values really were read (a model left
at its initial values would give the step-0 loss).
"""

import hashlib
import json
import math
import os

import pytest

from tests.conftest import TWO_DEVICES, read_events, run_module, run_modules
from tests.numerics import assert_close

STEPS = 6
TRAIN = ['--gin_file=configs/experiments/quickstart.gin', TWO_DEVICES,
         f'--gin_bindings=train.num_steps = {STEPS}', '--gin_bindings=train.eval_batches = 2',
         '--gin_bindings=train.eval_every = 0', '--gin_bindings=train.log_every = 3',
         '--gin_bindings=checkpoint.every_steps = 3']
MEGATRON_2X4 = ['--gin_file=configs/layouts/megatron.gin',
                "--gin_bindings=mesh.shape = {'data': 2, 'model': 4}"]
PIPELINED = ["--gin_bindings=mesh.shape = {'stage': 2, 'data': 4}",
             '--gin_bindings=pipeline.num_stages = 2',
             '--gin_bindings=pipeline.num_micro_batches = 2']


def digest(directory, *, skip=()):
  """sha256 over every file's relative path and bytes under `directory`
  (top-level entries in `skip` left out)."""
  total = hashlib.sha256()
  for root, dirs, files in os.walk(directory):
    if root == directory:
      dirs[:] = [d for d in dirs if d not in skip]
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(root, name)
      total.update(os.path.relpath(path, directory).encode() + b'\0')
      with open(path, 'rb') as f:
        total.update(f.read())
  return total.hexdigest()


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """(model_dir, its run_status.json metrics, its TensorBoard eval/loss points)."""
  model_dir = str(tmp_path_factory.mktemp('eval') / 'run')
  result = run_module('launch.train', *TRAIN, f'--model_dir={model_dir}')
  assert result.returncode == 0, result.stderr[-3000:]
  with open(os.path.join(model_dir, 'run_status.json')) as f:
    metrics = json.load(f)['metrics']
  return model_dir, metrics, read_events(model_dir)['scalars']


def evaluated(model_dir, name):
  with open(os.path.join(model_dir, f'eval_{name}', 'metrics.json')) as f:
    return json.load(f)


def test_another_mesh_gives_the_logged_eval_loss_and_changes_nothing(trained):
  model_dir, logged, scalars = trained
  final_loss = logged['eval_loss']
  assert dict(scalars['eval/loss'])[STEPS] == pytest.approx(final_loss, abs=1e-6)
  before = digest(model_dir)
  names_before = set(os.listdir(model_dir))
  runs = run_modules([
      ('launch.eval', f'--model_dir={model_dir}', '--name=2x4', *MEGATRON_2X4),
      ('launch.eval', f'--model_dir={model_dir}', '--name=one',
       "--gin_bindings=mesh.shape = {'data': 1}")])
  for run in runs:
    assert run.returncode == 0, run.stderr[-3000:]
  # Nothing of the run changed: only the two eval directories are new.
  assert digest(model_dir, skip=('eval_2x4', 'eval_one')) == before
  assert set(os.listdir(model_dir)) == names_before | {'eval_2x4', 'eval_one'}

  step_0_loss = dict(scalars['eval/loss'])[0]
  assert abs(step_0_loss - final_loss) > 0.01  # the control: training moved the loss
  for name, shape in (('2x4', {'data': 2, 'model': 4}), ('one', {'data': 1})):
    record = evaluated(model_dir, name)
    # measured (trained on data=2): 3.1e-08 / 3.1e-08 / 3.1e-08 (default / no oneDNN / 1 thread)
    assert_close(record['loss'], final_loss, rel=1e-6, what=f'loss: {name}')
    # measured: 0 / 0 (default / no oneDNN)
    assert_close(record['metrics']['accuracy'], logged['eval_accuracy'], rel=1e-5,
                 what=f'accuracy: {name}')
    assert record['perplexity'] == pytest.approx(math.exp(record['loss']), rel=1e-12)
    assert record['mesh']['shape'] == shape and record['step'] == STEPS
    assert record['checkpoint'] == os.path.join(model_dir, 'checkpoints', f'ckpt-{STEPS}',
                                                'ckpt')
    assert (record['eval_batches'], record['batch_size']) == (2, 32)
    assert (record['examples'], record['tokens']) == (64, 64 * 64)
    # The TensorBoard run: the loop's tags, at the checkpoint's step, in a real event file.
    events = read_events(os.path.join(model_dir, f'eval_{name}'))['scalars']
    assert events['eval/loss'] == [(STEPS, pytest.approx(record['loss'], abs=1e-6))]
    assert events['eval/accuracy'] == [
        (STEPS, pytest.approx(record['metrics']['accuracy'], abs=1e-6))]
  assert 'loss' in runs[0].stdout and 'eval_2x4/metrics.json' in runs[0].stdout


def test_an_earlier_checkpoint_and_a_pipelined_model(trained, tmp_path):
  """--checkpoint picks ckpt-3 (its own config.gin); the same checkpoint read
  into the model built with a pipeline (GPipe, SPMD) gives the same loss; the same
  --name again replaces the record and says so."""
  model_dir, logged, _ = trained
  checkpoint = os.path.join(model_dir, 'checkpoints', 'ckpt-3')
  out = str(tmp_path / 'out')
  runs = run_modules([
      ('launch.eval', f'--checkpoint={checkpoint}', f'--output_dir={out}', '--name=plain'),
      ('launch.eval', f'--checkpoint={checkpoint}', f'--output_dir={out}', '--name=gpipe',
       *PIPELINED),
      ('launch.eval', f'--checkpoint={checkpoint}', f'--output_dir={out}', '--name=spmd',
       *PIPELINED, "--gin_bindings=pipeline.engine = 'spmd'")])
  for run in runs:
    assert run.returncode == 0, run.stderr[-3000:]
  first = evaluated(out, 'plain')
  assert first['step'] == 3 and first['engine'] == 'SingleProgramEngine'
  # The SPMD engine stacks the blocks into one variable read from their own keys.
  for name in ('gpipe', 'spmd'):
    second = evaluated(out, name)
    assert second['step'] == 3 and second['mesh']['shape'] == {'stage': 2, 'data': 4}
    # measured: 0 / 0 (default / no oneDNN)
    assert_close(second['loss'], first['loss'], rel=1e-5, what=f'pipelined loss: {name}')
  assert evaluated(out, 'gpipe')['engine'] == 'GPipeEngine'
  # The checkpoint named was the one read: step 3's loss is not step 6's.
  assert abs(first['loss'] - logged['eval_loss']) > 1e-4
  # The same name again, for the newest checkpoint: replaced, and said.
  again = run_module('launch.eval', f'--model_dir={model_dir}', f'--output_dir={out}',
                     '--name=plain')
  assert again.returncode == 0, again.stderr[-3000:]
  assert f'held the evaluation of {checkpoint}/ckpt (step 3)' in again.stderr
  replaced = evaluated(out, 'plain')
  assert replaced['step'] == STEPS
  # measured: 0 / 0 (default / no oneDNN)
  assert_close(replaced['loss'], logged['eval_loss'], rel=1e-5, what='newest loss')


def test_bad_inputs_exit_2_and_write_nothing(trained, tmp_path):
  model_dir, _, _ = trained
  empty = tmp_path / 'empty'
  empty.mkdir()
  before = digest(model_dir)
  names_before = set(os.listdir(model_dir))
  no_checkpoint, missing, other_model, among_checkpoints = run_modules([
      ('launch.eval', f'--model_dir={empty}'),
      ('launch.eval', f'--model_dir={model_dir}', '--name=missing',
       f'--checkpoint={model_dir}/checkpoints/ckpt-999'),
      ('launch.eval', f'--model_dir={model_dir}', '--name=other',
       '--gin_bindings=transformer_lm.num_layers = 3'),
      ('launch.eval', f'--model_dir={model_dir}',
       f'--output_dir={model_dir}/checkpoints')])
  for run in (no_checkpoint, missing, other_model, among_checkpoints):
    assert run.returncode == 2, run.stderr[-3000:]
    assert 'Configuration error' in run.stderr and 'Traceback' not in run.stderr
  assert 'holds no checkpoint' in no_checkpoint.stderr
  assert 'ckpt-999' in missing.stderr and 'does not exist' in missing.stderr
  assert 'does not match this model' in other_model.stderr
  assert 'block_002' in other_model.stderr
  assert 'inside the checkpoint directory' in among_checkpoints.stderr
  assert os.listdir(empty) == []
  assert digest(model_dir) == before and set(os.listdir(model_dir)) == names_before
