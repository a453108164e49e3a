"""launch.train end to end in real subprocesses, read back from real event files."""

import concurrent.futures
import os
import re
import subprocess
import time

import pytest

from plugins.run_status import COMPLETED, read_run_status
from tests.conftest import TWO_DEVICES, launcher_environment, read_events, run_module

def short_run(gin_file: str, *, num_steps: int, eval_every: int) -> list[str]:
  """launch flags for a few steps of `gin_file`, logging every 2 steps."""
  return [f'--gin_file={gin_file}', f'--gin_bindings=train.num_steps = {num_steps}',
          '--gin_bindings=train.log_every = 2',
          f'--gin_bindings=train.eval_every = {eval_every}',
          '--gin_bindings=train.eval_batches = 1']


QUICK = [*short_run('configs/experiments/quickstart.gin', num_steps=6, eval_every=3),
         TWO_DEVICES]
# lm_pipeline.gin cut to a cell of each width in 2 micro-batches: a third of its compile.
PIPELINE = [*short_run('configs/experiments/lm_pipeline.gin', num_steps=4, eval_every=0),
            '--gin_bindings=transformer_lm.num_layers = 2',
            '--gin_bindings=transformer_lm.cells = '
            '[@narrow/transformer_block(), @wide/transformer_block()]',
            '--gin_bindings=pipeline.num_micro_batches = 2']


# The quick run's limit, and how soon after its final run_status.json it must
# have exited (about 1 s when nothing hangs, several on a loaded machine).
QUICK_TIMEOUT, EXIT_SECONDS = 240, 20


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """{'quick': (result, model_dir, when it exited), 'pipeline': (result,
  model_dir)}: the two real trainings this module checks, started together.
  The quick run is the suite's one `launch.train` that must be a fresh
  interpreter (`fresh`): a run forked from the test zygote ends with
  os._exit, past the interpreter's shutdown, where a hang at exit would
  hide. Its result is the TimeoutExpired if it did not end in time."""
  root = tmp_path_factory.mktemp('launch')
  model_dirs = {'quick': str(root / 'run'), 'pipeline': str(root / 'pipe')}

  def quick():
    try:
      result = run_module('launch.train', *QUICK, f'--model_dir={model_dirs["quick"]}',
                          timeout=QUICK_TIMEOUT, fresh=True,
                          # As a user runs it (no TF_CPP_MIN_LOG_LEVEL): the launcher
                          # quiets its own console.
                          env={'TF_CPP_MIN_LOG_LEVEL': None})
    except subprocess.TimeoutExpired as e:
      result = e
    return result, time.time()

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    quick_run = pool.submit(quick)
    pipeline = run_module('launch.train', *PIPELINE, f'--model_dir={model_dirs["pipeline"]}',
                          '--gin_bindings=mesh.peak_flops_per_device = 1e9')
    result, exited_at = quick_run.result()
  return {'quick': (result, model_dirs['quick'], exited_at),
          'pipeline': (pipeline, model_dirs['pipeline'])}


def test_train_writes_run_record_and_tensorboard_events_and_exits_promptly(runs):
  result, model_dir, exited_at = runs['quick']
  record = read_run_status(model_dir)
  if isinstance(result, subprocess.TimeoutExpired):  # its output so far comes as bytes
    pytest.fail(f'no exit in {QUICK_TIMEOUT} s; its run_status.json: {record}\n'
                + (result.stderr or b'').decode(errors='replace')[-3000:])
  assert result.returncode == 0, result.stderr[-3000:]
  # The final record is the run's last act: the interpreter's shutdown after it
  # (threads joined, TensorFlow's runtime torn down) takes about a second.
  assert record is not None and record.status == COMPLETED and record.step == 6, record
  assert exited_at - record.updated_at < EXIT_SECONDS, (exited_at - record.updated_at, record)
  # TensorFlow's C++ info lines (shown with --verbose: see test_sweep's verbose
  # trials) stay off the console; the run's own log lines do not.
  tensorflow_info = re.search(r'^I\d{4} [^\]]*\.cc:\d+\] .*', result.stderr, re.M)
  assert not tensorflow_info, tensorflow_info.group(0)
  assert 'Done at step 6' in result.stderr, result.stderr[-3000:]
  for name in ('config.gin', 'params.txt', 'layouts.txt'):
    assert os.path.getsize(os.path.join(model_dir, name)) > 0, name
  assert 'train.num_steps = 6' in open(os.path.join(model_dir, 'config.gin')).read()
  assert 'sub[1].repeat : 2' in open(os.path.join(model_dir, 'params.txt')).read()

  events = read_events(model_dir)
  scalars, texts = events['scalars'], events['text']
  assert [s for s, _ in scalars['train/loss']] == [2, 4, 6]
  assert [s for s, _ in scalars['eval/loss']] == [0, 3, 6]
  for tag in ('train/learning_rate', 'train/steps_per_sec', 'train/tokens_per_sec',
              'usage/params_total', 'usage/param_bytes_per_device_max',
              'train/model_flops_per_sec'):
    assert tag in scalars, tag
  assert [s for s, _ in scalars['usage/host_peak_bytes']] == [2, 4, 6]
  assert all(10e6 < peak < 64e9 for _, peak in scalars['usage/host_peak_bytes'])
  assert 'usage/device_peak_bytes' not in scalars  # a CPU mesh: the host figure covers it
  assert 'train/mfu' not in scalars                 # no mesh.peak_flops_per_device
  assert 'train.num_steps = 6' in texts['config/gin'][0]
  assert 'repeat : 2' in texts['config/params'][0]
  assert 'lm/stack/block_001/ffn/w_in' in texts['layouts/variables'][0]


def test_bad_binding_exits_2_naming_the_key(tmp_path):
  result = run_module('launch.train', *QUICK, '--gin_bindings=train.stepz = 3',
                      f'--model_dir={tmp_path}')
  assert result.returncode == 2
  assert "'stepz'" in result.stderr and 'train' in result.stderr
  assert 'Traceback' not in result.stderr


def test_unknown_configurable_missing_file_and_required_value_exit_2(tmp_path):
  unknown = run_module('launch.train', *QUICK, '--gin_bindings=trainn.num_steps = 3',
                       f'--model_dir={tmp_path}')
  assert unknown.returncode == 2 and "Did you mean 'train'" in unknown.stderr
  missing = run_module('launch.train', '--gin_file=configs/nope.gin',
                       f'--model_dir={tmp_path}')
  assert missing.returncode == 2 and "'configs/nope.gin' not found" in missing.stderr
  required = run_module('launch.train', '--gin_file=configs/runs/train.gin',
                        f'--model_dir={tmp_path}')
  assert required.returncode == 2 and 'model' in required.stderr
  for result in (unknown, missing, required):
    assert 'Traceback' not in result.stderr
  verbose = run_module('launch.train', '--gin_file=configs/nope.gin', '--verbose',
                       f'--model_dir={tmp_path}')
  assert verbose.returncode == 2 and 'Traceback' in verbose.stderr


def test_help_explains_the_flags():
  result = run_module('launch.train', '--help')
  assert 'Train a model from gin config files' in result.stdout
  for flag in ('--gin_file', '--gin_bindings', '--gin_search_paths', '--model_dir'):
    assert flag in result.stdout


def test_pipelined_run_records_stages_bubble_fraction_and_checkpoints(runs):
  result, model_dir = runs['pipeline']
  assert result.returncode == 0, result.stderr[-3000:]
  events = read_events(model_dir)
  scalars, texts = events['scalars'], events['text']
  stages = texts['pipeline/stages'][0]
  for expected in ('| 0 |', '| 1 |', 'emb', 'block_000', 'softmax', 'data=2 x model=2', '%'):
    assert expected in stages, expected
  num_stages, num_micro = 2, 2  # lm_pipeline.gin's stages, PIPELINE's micro-batches
  [(_, bubble)] = scalars['pipeline/bubble_fraction']
  assert bubble == pytest.approx((num_stages - 1) / (num_micro + num_stages - 1))
  assert [s for s, _ in scalars['train/loss']] == [2, 4]
  for (_, rate), (_, mfu) in zip(scalars['train/model_flops_per_sec'], scalars['train/mfu']):
    assert rate > 0 and mfu == pytest.approx(rate / (8 * 1e9))  # declared peak x 8 devices
  assert '| stage1 |' in texts['layouts/variables'][0]
  assert os.path.isdir(os.path.join(model_dir, 'checkpoints', 'ckpt-4'))


def test_pipeline_errors_exit_2_with_the_knob(tmp_path):
  cases = {
      'pipeline.num_micro_batches = 3': 'num_micro_batches=3 does not divide the batch of 32',
      'pipeline.num_stages = 4': "mesh axis 'stage' has size 2",
  }
  for binding, message in cases.items():
    result = run_module('launch.train', *PIPELINE, f'--gin_bindings={binding}',
                        f'--model_dir={tmp_path}')
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert 'Traceback' not in result.stderr
  too_many = run_module('launch.inspect', *PIPELINE, "--gin_bindings=mesh.shape = {'stage': 8}",
                        '--gin_bindings=pipeline.num_stages = 8',
                        '--gin_bindings=layout_rules.rules = []')
  assert too_many.returncode == 2
  assert 'num_stages=8 is more than the 5 layers' in too_many.stderr  # emb, 2 blocks, ln, softmax


@pytest.mark.parametrize('devices, env, expected', [
    (8, {}, 'share'), (1, {}, 'default'),
    (8, {'TF_NUM_INTRAOP_THREADS': '3'}, 'default')])  # the user's setting is left to TF
def test_several_cpu_devices_share_the_cores_between_them(devices, env, expected):
  """One intra-op pool serves every logical CPU device: N devices get
  cores // N threads each (bench/step_breakdown.py measures why)."""
  import subprocess, sys  # pylint: disable=import-outside-toplevel,multiple-imports
  from tests.conftest import REPO_ROOT  # pylint: disable=import-outside-toplevel
  code = ('import os, tensorflow as tf\n'
          'from layout_core.layout.mesh import configure_virtual_cpus\n'
          f'configure_virtual_cpus({devices}); tf.constant(1)\n'
          'print("THREADS", tf.config.threading.get_intra_op_parallelism_threads(),'
          ' len(os.sched_getaffinity(0)))')
  done = subprocess.run([sys.executable, '-c', code], cwd=REPO_ROOT, capture_output=True,
                        text=True, check=True,  # the case's own thread setting only
                        env=launcher_environment({'TF_NUM_INTRAOP_THREADS': None, **env}))
  threads, cores = map(int, done.stdout.split('THREADS')[1].split())
  want = {'share': max(1, cores // devices), 'default': 0}[expected]  # 0: TF's own choice
  assert threads == want, done.stdout
