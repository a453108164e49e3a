"""launch.sweep: the trial list, and real sweeps read back through TensorBoard itself.

The end-to-end tests share one real 4-trial sweep (zip mode, two trials at a
time, the last trial deliberately invalid) and check it through a real
`tensorboard` server's hparams plugin, TensorBoard's event readers, and the
trials' own records. Trials run on 2 virtual devices to keep them quick.
"""

import io
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
import urllib.request

import pytest

from layout_core.errors import ConfigError
from plugins import run_status, sweep as sweep_lib
from plugins.sweep.spec import expand, parse_axis, read_sweep_file
from plugins.sweep.trial_process import STOPPED_AT_START_UP
from tests.conftest import REPO_ROOT, Launched, read_events, run_module

TINY = ['--gin_file=configs/experiments/quickstart.gin',
        '--gin_bindings=train.num_steps = 4', '--gin_bindings=train.log_every = 2',
        '--gin_bindings=train.eval_every = 0', '--gin_bindings=train.eval_batches = 1',
        '--gin_bindings=checkpoint.every_steps = 0',
        "--gin_bindings=mesh.shape = {'data': 2}"]
# zip: four trials; the last asks for a data vocabulary the model is too small for.
ZIP_AXES = ['--sweep_mode=zip', '--sweep=optimizer.learning_rate=[3e-3, 1e-3, 3e-4, 1e-2]',
            '--sweep=data.vocab_size=[64, 48, 64, 128]']
INVALID = 'learning_rate=0.01,vocab_size=128'


# -- the trial list ----------------------------------------------------------------
def test_axes_keep_gin_values_as_written_and_reject_bad_specs():
  axis = parse_axis("mesh.shape=[{'data': 8}, {'data': 2, 'model': 4}]")
  assert axis.values == ("{'data': 8}", "{'data': 2, 'model': 4}")
  assert parse_axis("transformer_block.activation = ['relu', 'gelu,x']").values == (
      "'relu'", "'gelu,x'")
  ranged = parse_axis('optimizer.learning_rate=log_uniform(1e-4, 1e-1)')
  assert (ranged.kind, ranged.low, ranged.high) == ('log_uniform', 1e-4, 1e-1)
  for bad in ('learning_rate', 'optimizer.learning_rate=[]', 'x.y=3',
              'x.y=log_uniform(0, 1)', 'x.y=int_range(1.5, 3)', 'x.y=uniform(2, 1)'):
    with pytest.raises(ConfigError):
      parse_axis(bad)


def test_product_zip_and_ranges_outside_random_search():
  a = parse_axis('optimizer.learning_rate=[1e-3, 3e-4, 1e-4]')
  b = parse_axis('pipeline.num_micro_batches=[1, 2]')
  product = expand([a, b])
  expected = {(x, y) for x in a.values for y in b.values}  # nested-loop reference
  assert len(product) == 6 and {tuple(t.values.values()) for t in product} == expected
  zipped = expand([a, parse_axis('train.seed=[0, 1, 2]')], mode='zip')
  assert [t.bindings for t in zipped][1] == ['optimizer.learning_rate = 3e-4',
                                             'train.seed = 1']
  with pytest.raises(ConfigError, match='one length'):
    expand([a, b], mode='zip')
  with pytest.raises(ConfigError, match='only random search'):
    expand([parse_axis('x.y=uniform(0, 1)')])
  with pytest.raises(ConfigError, match='more than once'):
    expand([a, a])


def test_random_search_is_seeded_and_draws_from_the_declared_ranges():
  axes = [parse_axis('optimizer.learning_rate=log_uniform(1e-4, 1e-0)'),
          parse_axis('train.seed=int_range(0, 3)'),
          parse_axis('optimizer.decay=["cosine", "linear"]')]
  trials = expand(axes, mode='random', num_trials=400, seed=7)
  assert [t.values for t in trials] == [
      t.values for t in expand(axes, mode='random', num_trials=400, seed=7)]
  assert [t.values for t in trials] != [
      t.values for t in expand(axes, mode='random', num_trials=400, seed=8)]
  rates = [float(t.values['optimizer.learning_rate']) for t in trials]
  assert all(1e-4 <= r <= 1 for r in rates)
  # log-uniform: each decade holds about a quarter (uniform would put ~90% in the top one)
  below = sum(r < 1e-2 for r in rates) / len(rates)
  assert 0.4 < below < 0.6
  assert {t.values['train.seed'] for t in trials} == {'0', '1', '2', '3'}
  assert {t.values['optimizer.decay'] for t in trials} == {'"cosine"', '"linear"'}
  assert len({t.name for t in trials}) == len(trials)  # repeated draws get ~2, ~3


def test_trial_names_are_readable_unique_and_file_system_safe():
  axes = [parse_axis("mesh.shape=[{'data': 8}, {'data': 2, 'model': 4}]"),
          parse_axis("data.text_file=['/data/a b.txt', '../x', @ref()]"),
          parse_axis('train.seed=[1, 2]'), parse_axis('data.seed=[1]')]
  names = [t.name for t in expand(axes)]
  assert len(set(names)) == len(names) == 12
  for name in names:
    assert re.fullmatch(r'[\w.=+,~-]+', name) and name not in ('.', '..'), name
  assert names[0].startswith('shape=data8,text_file=')
  assert 'train.seed=1,data.seed=1' in names[0]  # two 'seed' axes keep their configurable


def test_sweep_file_holds_the_flags(tmp_path):
  path = tmp_path / 'lr.sweep'
  path.write_text('# a comment\ngin_file = configs/experiments/quickstart.gin\n'
                  'gin_bindings = train.num_steps = 10\n'
                  'sweep = optimizer.learning_rate = [1e-3, 3e-4]\n'
                  'sweep_mode = zip\nnum_trials = 2\n')
  spec = read_sweep_file(str(path))
  assert spec.gin_file == ['configs/experiments/quickstart.gin']
  assert spec.gin_bindings == ['train.num_steps = 10']
  assert parse_axis(spec.sweep[0]).values == ('1e-3', '3e-4')
  assert spec.settings == {'sweep_mode': 'zip', 'num_trials': '2'}
  path.write_text('sweeep = x.y=[1]\n')
  with pytest.raises(ConfigError, match='line 1'):
    read_sweep_file(str(path))


def test_first_error_line_names_the_cause():
  traceback_text = ('Traceback (most recent call last):\n  File "x.py", line 1\n'
                    'tensorflow.python.framework.errors_impl.InvalidArgumentError: bad shape\n')
  assert sweep_lib.first_error_line(traceback_text, 1).startswith(
      'tensorflow.python.framework.errors_impl.InvalidArgumentError: bad shape')
  assert sweep_lib.first_error_line('noise\nConfiguration error: x. Fix: y.\n', 2) == (
      'Configuration error: x. Fix: y.')
  assert sweep_lib.first_error_line('', -9) == 'killed by SIGKILL'


def test_a_run_status_is_believed_only_from_the_attempt_the_sweep_started():
  def status(attempt):
    return run_status.RunStatus(status='completed', step=4, exit_code=0, metrics={},
                                wall_seconds=1.0, started_at=0.0, updated_at=0.0, pid=1,
                                attempt=attempt)
  assert sweep_lib.trial_outcome(status('t/2/ab'), 0, attempt='t/2/ab') == 'completed'
  # another attempt's file: as if the run wrote nothing
  assert sweep_lib.trial_outcome(status('t/1/cd'), 0, attempt='t/2/ab') == (
      STOPPED_AT_START_UP)
  assert sweep_lib.trial_outcome(status('t/1/cd'), 1, attempt='t/2/ab') == 'crashed'
  assert sweep_lib.trial_outcome(status(None), 1, attempt='t/2/ab') == 'crashed'
  # a trial recorded before attempts were named (an older sweep's directory)
  assert sweep_lib.trial_outcome(status(None), 0, attempt=None) == 'completed'


# -- a real sweep ----------------------------------------------------------------------
def sweep_command(root, *extra):
  return [*TINY, *ZIP_AXES, f'--model_dir={root}', *extra]


# The environment a user has: no TF_CPP_MIN_LOG_LEVEL (run_module sets one,
# which would decide the trials' consoles instead of their flags).
AS_USER = {'TF_CPP_MIN_LOG_LEVEL': None}


@pytest.fixture(scope='module')
def zip_sweep(tmp_path_factory):
  """The shared real sweep; --verbose, which its trials must get too."""
  root = str(tmp_path_factory.mktemp('sweep') / 'root')
  start = time.monotonic()
  result = run_module('launch.sweep', *sweep_command(root, '--parallel=2', '--verbose'),
                      timeout=600, env=AS_USER)
  return root, result, time.monotonic() - start


def attempt_header(log, attempt):
  """The driver's '===== sweep attempt N, ...: command' line in a trial log."""
  return re.search(rf'^===== sweep attempt {attempt}, .*$', log, re.M).group(0)


class TensorBoard:
  """A real `tensorboard --logdir root` on a free localhost port, forked from
  the session's zygote (`python -m tensorboard.main`, without paying
  TensorFlow's import again: about 12 CPU-s a server here)."""

  def __init__(self, root):
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      self.port = s.getsockname()[1]
    self.server = Launched('tensorboard.main', '--logdir', root, '--host', '127.0.0.1',
                           '--port', str(self.port), label='tensorboard')
    self.process = self.server.process

  def post(self, route, body):
    request = urllib.request.Request(
        f'http://127.0.0.1:{self.port}/data/plugin/hparams/{route}',
        data=json.dumps(body).encode(), headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=20) as response:
      return json.loads(response.read())

  def hparams(self, num_sessions, deadline=120):
    """The experiment and its session groups, once TensorBoard has loaded them all."""
    give_up = time.monotonic() + deadline
    while True:
      try:
        experiment = self.post('experiment', {'experimentName': ''})
        columns = ([{'hparam': h['name'], 'includeInResult': True}
                    for h in experiment['hparamInfos']]
                   + [{'metric': m['name'], 'includeInResult': True}
                      for m in experiment['metricInfos']])
        groups = self.post('session_groups', {
            'experimentName': '', 'colParams': columns, 'startIndex': 0, 'sliceSize': 100,
            'allowedStatuses': ['STATUS_UNKNOWN', 'STATUS_SUCCESS', 'STATUS_FAILURE',
                                'STATUS_RUNNING']})['sessionGroups']
        ended = [g for g in groups if g['sessions'][0].get('endTimeSecs')]
        if len(ended) >= num_sessions:  # keyed by the session's run: the trial's name
          return experiment, {g['sessions'][0]['name']: g for g in groups}
      except (OSError, KeyError, ValueError):
        pass  # not serving yet, or still loading
      assert time.monotonic() < give_up, 'TensorBoard did not show the sessions in time'
      time.sleep(1)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.process.terminate()
    self.process.wait(timeout=30)


def read_tsv(root):
  with open(os.path.join(root, 'sweep.tsv')) as f:
    header, *rows = [line.rstrip('\n').split('\t') for line in f]
  return [dict(zip(header, row)) for row in rows]


def test_sweep_isolates_the_invalid_trial_and_fills_the_hparams_dashboard(zip_sweep):
  root, result, _ = zip_sweep
  assert result.returncode == 1, result.stderr[-3000:]  # one trial failed
  with TensorBoard(root) as board:
    experiment, groups = board.hparams(num_sessions=4)

  hparams = {h['name']: h for h in experiment['hparamInfos']}
  assert sorted(hparams['optimizer.learning_rate']['domainDiscrete']) == [3e-4, 1e-3, 3e-3, 1e-2]
  assert sorted(hparams['data.vocab_size']['domainDiscrete']) == [48, 64, 128]
  metric_names = {m['name']['tag']: m['displayName'] for m in experiment['metricInfos']}
  assert set(metric_names) == {'eval/loss', 'train/tokens_per_sec',
                               'usage/param_bytes_per_device_max', 'usage/sweep_wall_seconds'}
  assert all(metric_names.values())

  with open(os.path.join(root, 'sweep.json')) as f:
    planned = json.load(f)['trials']
  assert set(groups) == {t['name'] for t in planned} and len(groups) == 4
  rows = {row['trial']: row for row in read_tsv(root)}
  for number, trial in enumerate(planned, 1):
    group, name = groups[trial['name']], trial['name']
    # The Trial ID column (about 16 characters) shows the number and the values.
    assert group['name'] == f"{number}: {' '.join(trial['values'].values())}"
    assert group['hparams'] == {key: float(text) for key, text in trial['values'].items()}
    status = group['sessions'][0]['status']
    shown = {m['name']['tag']: m['value'] for m in group['metricValues']}
    outcome = run_status.read_run_status(os.path.join(root, name))  # launch.train's own
    # It names the attempt the sweep started (MESHGIN_ATTEMPT reached the trial).
    assert outcome.attempt == sweep_lib.read_status(os.path.join(root, name))['attempt_id']
    assert outcome.attempt.startswith(f'{name}/1/')
    if name == INVALID:
      assert status == 'STATUS_FAILURE' and rows[name]['status'] == 'FAILURE'
      assert rows[name]['exit'] == '2'
      assert (outcome.status, outcome.exit_code, outcome.step) == ('config_error', 2, None)
      assert outcome.error.startswith('model vocabulary 64 is smaller')
      assert rows[name]['error'].startswith(
          'Configuration error: model vocabulary 64 is smaller than the data vocabulary 128')
      assert 'eval/loss' not in shown
      continue
    assert status == 'STATUS_SUCCESS' and rows[name]['status'] == 'SUCCESS'
    # The dashboard's numbers are the trial's own final scalars, read independently.
    scalars = read_events(os.path.join(root, name))['scalars']
    assert (outcome.status, outcome.exit_code, outcome.step) == ('completed', 0, 4)
    assert outcome.metrics['eval_loss'] == pytest.approx(scalars['eval/loss'][-1][1], rel=1e-6)
    assert outcome.metrics['eval_accuracy'] == pytest.approx(
        scalars['eval/accuracy'][-1][1], rel=1e-6)
    for tag in ('eval/loss', 'train/tokens_per_sec', 'usage/param_bytes_per_device_max'):
      assert shown[tag] == pytest.approx(scalars[tag][-1][1], rel=1e-6), tag
    assert float(rows[name]['eval_loss']) == pytest.approx(scalars['eval/loss'][-1][1],
                                                           abs=1e-4)
    assert shown['usage/sweep_wall_seconds'] == pytest.approx(
        float(rows[name]['wall_seconds']), abs=0.1)
    assert 0 < shown['usage/sweep_wall_seconds'] < 600
  losses = [float(r['eval_loss']) for r in read_tsv(root) if r['status'] == 'SUCCESS']
  assert losses == sorted(losses) and read_tsv(root)[-1]['trial'] == INVALID
  assert 'FAILURE' in result.stdout and INVALID in result.stdout  # the printed table


def test_parallel_trials_complete_in_their_own_directories(zip_sweep):
  root, _, _ = zip_sweep
  with open(os.path.join(root, 'sweep.json')) as f:
    recorded = json.load(f)
  assert recorded['parallel'] == 2
  trials = recorded['trials']
  for trial in trials:
    directory = os.path.join(root, trial['name'])
    log = open(os.path.join(directory, sweep_lib.LOG_FILE)).read()
    assert log.count('===== sweep attempt') == 1  # one process wrote this log
    threads = max(1, os.cpu_count() // 2)  # the machine's threads, shared by two trials
    assert f'TF_NUM_INTRAOP_THREADS={threads} TF_NUM_INTEROP_THREADS={threads}' in log
    assert set(re.findall(r'--model_dir=(\S+)', log)) == {directory}
    # The sweep's --verbose is the trial's; no log level is set for it.
    header = attempt_header(log, 1)
    assert ' --verbose ' in header and 'TF_CPP_MIN_LOG_LEVEL' not in header, header
    if trial['name'] == INVALID:
      continue
    # So TensorFlow's own info lines (DTensor's compile-cache notes) are in its log.
    assert re.search(r'^I\d{4} .*dtensor_device\.cc:\d+\] ', log, re.M), log[-3000:]
    operative = open(os.path.join(directory, 'config.gin')).read()
    for key, text in trial['values'].items():  # it trained with its own values
      assert f'{key} = {literal_value(text)}\n' in operative, (key, trial['name'])
    scalars = read_events(directory)['scalars']
    assert [s for s, _ in scalars['train/loss']] == [2, 4]  # one run, no steps mixed in
    assert os.path.isdir(os.path.join(directory, 'checkpoints', 'ckpt-4'))
  # Two at a time: the first two trials ran side by side.
  first, second = (sweep_lib.read_status(os.path.join(root, t['name'])) for t in trials[:2])
  assert first['started_at'] < second['ended_at'] and second['started_at'] < first['ended_at']


def literal_value(text):
  """How gin's operative config prints a swept value (3e-3 -> 0.003)."""
  value = float(text)
  return repr(int(value)) if value.is_integer() and 'e' not in text else repr(value)


def test_rerun_skips_finished_trials_and_retries_the_failed_one(zip_sweep, tmp_path):
  original, _, _ = zip_sweep
  root = str(tmp_path / 'copy')
  shutil.copytree(original, root)
  finished = {name: os.path.getmtime(os.path.join(root, name, 'config.gin'))
              for name in os.listdir(root) if name != INVALID
              and os.path.isdir(os.path.join(root, name))}
  # The failed trial needed a bigger model vocabulary: fix it in the base bindings.
  result = run_module('launch.sweep', *sweep_command(
      root, '--gin_bindings=transformer_lm.vocab_size = 128'), timeout=600, env=AS_USER)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  assert '3 already done (skipped), 1 to run' in result.stdout
  assert 'note: 3 finished trials ran with another base config' in result.stdout
  for name, mtime in finished.items():
    assert os.path.getmtime(os.path.join(root, name, 'config.gin')) == mtime, name
  retried = os.path.join(root, INVALID)
  log = open(os.path.join(retried, sweep_lib.LOG_FILE)).read()
  assert log.count('sweep attempt') == 2
  # Not verbose this time: the trial quiets its own console, with no level set by the sweep.
  header, second_attempt = attempt_header(log, 2), log.split('sweep attempt 2')[1]
  assert '--verbose' not in header and 'TF_CPP_MIN_LOG_LEVEL' not in header, header
  tensorflow_info = re.search(r'^I\d{4} [^\]]*\.cc:\d+\] .*', second_attempt, re.M)
  assert not tensorflow_info, tensorflow_info.group(0)
  status = sweep_lib.read_status(retried)
  assert (status['status'], status['attempts'], status['exit_code']) == ('SUCCESS', 2, 0)
  assert 'transformer_lm.vocab_size = 128' in status['base']['gin_bindings']
  with TensorBoard(root) as board:
    _, groups = board.hparams(num_sessions=4)
  assert groups[INVALID]['sessions'][0]['status'] == 'STATUS_SUCCESS'
  shown = {m['name']['tag']: m['value'] for m in groups[INVALID]['metricValues']}
  assert shown['eval/loss'] == pytest.approx(
      read_events(retried)['scalars']['eval/loss'][-1][1], rel=1e-6)
  assert all(r['status'] == 'SUCCESS' for r in read_tsv(root))


def test_sigterm_stops_the_trial_cleanly_and_a_rerun_continues_it(tmp_path):
  root = str(tmp_path / 'root')

  def command(num_steps):
    return [*TINY, f'--gin_bindings=train.num_steps = {num_steps}',
            '--sweep=optimizer.learning_rate=[1e-3]', f'--model_dir={root}']

  sweep = Launched('launch.sweep', *command(400), label='launch.sweep')
  trial_dir = os.path.join(root, 'learning_rate=0.001')
  log = os.path.join(trial_dir, sweep_lib.LOG_FILE)
  give_up = time.monotonic() + 300
  while not (os.path.exists(log) and re.search(r'step \d+/400', open(log).read())):
    assert sweep.process.poll() is None and time.monotonic() < give_up, sweep.output[-3000:]
    time.sleep(0.5)
  sweep.process.send_signal(signal.SIGTERM)
  output = sweep.finish(timeout=300)
  assert sweep.process.returncode == 4, output[-3000:]
  assert sweep_lib.read_status(trial_dir)['status'] == 'INTERRUPTED'
  saved = re.search(r'Preempted by SIGTERM at step (\d+)', open(log).read())
  assert saved, open(log).read()[-3000:]
  step = int(saved.group(1))
  outcome = run_status.read_run_status(trial_dir)
  assert (outcome.status, outcome.exit_code, outcome.step) == ('preempted', 0, step)
  assert sweep_lib.read_status(trial_dir)['outcome'] == 'preempted'
  assert 0 < step < 400 and os.path.isdir(os.path.join(trial_dir, 'checkpoints',
                                                       f'ckpt-{step}'))

  # The re-run (two more steps, so the test stays short) continues from that checkpoint.
  rerun = run_module('launch.sweep', *command(step + 2), timeout=300)
  assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
  assert f'Resumed from' in open(log).read().split('sweep attempt 2')[1]
  assert max(s for s, _ in read_events(trial_dir)['scalars']['train/loss']) == step + 2
  status = sweep_lib.read_status(trial_dir)
  assert (status['status'], status['attempts']) == ('SUCCESS', 2)


def wait_until_training(trial_dir, sweep, timeout=300):
  """The trial's run_status.json once it says 'running' (every check passed)."""
  give_up = time.monotonic() + timeout
  while True:
    status = run_status.read_run_status(trial_dir)
    if status is not None and status.status == 'running':
      return status
    assert sweep.process.poll() is None, sweep.output[-3000:]
    assert time.monotonic() < give_up, f'{trial_dir} never started:\n{sweep.output[-3000:]}'
    time.sleep(0.2)


def test_diverged_preempted_and_killed_trials_are_told_apart_by_run_status(tmp_path):
  """Three real trials, two at a time: one diverges (exit 3), one is sent
  SIGTERM (saves, exit 0, yet not a success) and one SIGKILL (its status still
  says running: crashed). The sweep's verdicts come from run_status.json."""
  root = str(tmp_path / 'outcomes')
  axes = ['optimizer.learning_rate=[1e30, 1e-3, 1e-3]',
          'train.num_steps=[4, 100000, 100000]', 'train.seed=[0, 1, 2]']
  diverges, preempted, killed = (t.name for t in expand([parse_axis(a) for a in axes],
                                                        mode='zip'))
  sweep = Launched('launch.sweep', *TINY, '--gin_bindings=train.log_every = 1',
                   '--gin_bindings=optimizer.clip_norm = 0', '--sweep_mode=zip',
                   *[f'--sweep={a}' for a in axes], '--parallel=2', f'--model_dir={root}',
                   label='sweep')
  try:
    stopped = wait_until_training(os.path.join(root, preempted), sweep)
    os.kill(stopped.pid, signal.SIGTERM)
    victim = wait_until_training(os.path.join(root, killed), sweep)
    os.kill(victim.pid, signal.SIGKILL)
    output = sweep.finish(timeout=300)
  finally:
    if sweep.process.poll() is None:
      sweep.process.kill()
  assert sweep.process.returncode == 1, output[-3000:]  # failures, not an interrupted sweep
  rows = {row['trial']: row for row in read_tsv(root)}
  recorded = {name: sweep_lib.read_status(os.path.join(root, name)) for name in rows}
  status = {name: run_status.read_run_status(os.path.join(root, name)) for name in rows}

  assert (rows[diverges]['status'], rows[diverges]['exit']) == ('FAILURE', '3')
  assert re.fullmatch(r'Training diverged: train loss is (nan|inf) at step \d+; .*',
                      rows[diverges]['error']), rows[diverges]['error']
  assert (status[diverges].status, status[diverges].exit_code) == ('diverged', 3)
  assert status[diverges].error.startswith('train loss is ')
  assert 'Traceback' not in open(os.path.join(root, diverges, sweep_lib.LOG_FILE)).read()

  # Exit 0 like a success, but its status says it stopped early, after saving.
  assert (rows[preempted]['status'], rows[preempted]['exit']) == ('INTERRUPTED', '0')
  saved = re.search(r'Preempted by SIGTERM at step (\d+)',
                    open(os.path.join(root, preempted, sweep_lib.LOG_FILE)).read())
  assert saved and status[preempted].step == int(saved.group(1))
  assert (status[preempted].status, status[preempted].pid) == ('preempted', stopped.pid)
  train_losses = read_events(os.path.join(root, preempted))['scalars']['train/loss']
  assert train_losses[-1][0] == status[preempted].step  # logged every step
  assert status[preempted].metrics['train_loss'] == pytest.approx(train_losses[-1][1],
                                                                  rel=1e-6)
  assert 'eval_loss' not in status[preempted].metrics  # its last eval was at step 0
  assert os.path.isdir(os.path.join(root, preempted, 'checkpoints', f'ckpt-{saved.group(1)}'))

  # Killed: its last word is still 'running', from the process that was killed.
  assert (rows[killed]['status'], rows[killed]['exit'], rows[killed]['error']) == (
      'FAILURE', '-9', 'crashed: killed by SIGKILL')
  assert status[killed] == victim and victim.exit_code is None
  assert {name: r['outcome'] for name, r in recorded.items()} == {
      diverges: 'diverged', preempted: 'preempted', killed: 'crashed'}


def test_a_timed_out_trial_is_a_recorded_failure(tmp_path):
  root = str(tmp_path / 'slow')
  slow = run_module('launch.sweep', *TINY, '--sweep=train.seed=[0]', '--trial_timeout=1',
                    f'--model_dir={root}', timeout=300)
  assert slow.returncode == 1, slow.stdout[-2000:] + slow.stderr[-3000:]
  [row] = read_tsv(root)
  assert row['status'] == 'FAILURE' and row['error'].startswith('timed out after 1 s')
  assert float(row['wall_seconds']) < 60  # stopped, not left to finish


FAKE_TRIAL = """#!{python}
# Stands in for `python -m launch.train`: acts out the ending its train.seed names.
import os, signal, sys
from plugins import run_status
model_dir = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--model_dir=')][0]
seed = [a.split('=')[-1].strip() for a in sys.argv if a.startswith('--gin_bindings=train.seed')][0]
if seed == '1':
  run_status.RunStatusFile(
      model_dir, attempt=os.environ[run_status.ATTEMPT_VARIABLE]).write(run_status.RUNNING)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_an_earlier_attempts_status_is_never_read_as_this_ones(tmp_path):
  """A trial killed before it wrote a word, over the status of an earlier
  attempt that completed, crashed (the status is removed before each attempt)."""
  fake = tmp_path / 'fake_python'
  fake.write_text(FAKE_TRIAL.format(python=sys.executable))
  fake.chmod(0o755)
  sweep = sweep_lib.Sweep(root=str(tmp_path / 'root'),
                          gin_files=['configs/experiments/quickstart.gin'], gin_bindings=[],
                          axes=[parse_axis('train.seed=[0, 1]')])
  silent, running = sweep.trials()
  earlier = os.path.join(sweep.root, silent.name)
  os.makedirs(earlier)
  run_status.RunStatusFile(earlier).write(run_status.COMPLETED, step=4, exit_code=0)
  records = sweep_lib.SweepRunner(sweep, python=str(fake), out=io.StringIO()).run()
  by_name = {r['name']: r for r in records}
  for trial in (silent, running):
    record = by_name[trial.name]
    assert (record['status'], record['exit_code'], record['outcome'], record['error']) == (
        'FAILURE', -9, 'crashed', 'crashed: killed by SIGKILL'), record
  assert run_status.read_run_status(earlier) is None
  assert run_status.read_run_status(os.path.join(sweep.root, running.name)).status == 'running'


RECORDING_TRIAL = """#!{python}
# Stands in for `python -m launch.train`: records the flags and environment it got.
import json, os, sys
model_dir = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--model_dir=')][0]
with open(os.path.join(model_dir, 'seen.json'), 'w') as f:
  json.dump({{'flags': sys.argv[1:], 'environment': dict(os.environ)}}, f)
"""


def test_a_trial_gets_the_log_level_its_own_flags_ask_for(tmp_path, monkeypatch):
  """No log level is added to a trial's environment (each launch.train
  quiets itself unless --verbose); one the user set is passed on."""
  fake = tmp_path / 'fake_python'
  fake.write_text(RECORDING_TRIAL.format(python=sys.executable))
  fake.chmod(0o755)
  monkeypatch.delenv('TF_CPP_MIN_LOG_LEVEL', raising=False)

  def trial_saw(name, **runner_arguments):
    sweep = sweep_lib.Sweep(root=str(tmp_path / name),
                            gin_files=['configs/experiments/quickstart.gin'],
                            axes=[parse_axis('train.seed=[0]')],
                            train_flags=['--verbose'] if name == 'verbose' else [])
    sweep_lib.SweepRunner(sweep, python=str(fake), out=io.StringIO(), parallel=1,
                          **runner_arguments).run()
    with open(os.path.join(sweep.root, 'seed=0', 'seen.json')) as f:
      return json.load(f)

  quiet = trial_saw('quiet')
  assert 'TF_CPP_MIN_LOG_LEVEL' not in quiet['environment']
  assert '--verbose' not in quiet['flags']
  verbose = trial_saw('verbose')
  assert 'TF_CPP_MIN_LOG_LEVEL' not in verbose['environment']
  assert '--verbose' in verbose['flags']
  # launch.sweep passes its environment without what quieting its console set.
  users = trial_saw('users', environment=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='1'))
  assert users['environment']['TF_CPP_MIN_LOG_LEVEL'] == '1'


def test_a_misconfigured_sweep_exits_2_before_any_trial_runs(tmp_path):
  root = tmp_path / 'root'
  typo = run_module('launch.sweep', *TINY, '--sweep=train.num_stepz=[1, 2]',
                    f'--model_dir={root}')
  assert typo.returncode == 2, typo.stderr[-3000:]
  assert "every trial fails to parse" in typo.stderr and "'num_steps'" in typo.stderr
  # Settings come from the sweep file (zip), lists from the file and the command line.
  sweep_file = tmp_path / 'bad.sweep'
  sweep_file.write_text('sweep_mode = zip\nsweep = optimizer.learning_rate = [1e-3, 3e-4]\n')
  mismatched = run_module('launch.sweep', *TINY, f'--sweep_file={sweep_file}',
                          '--sweep=train.seed=[0, 1, 2]', f'--model_dir={root}')
  assert mismatched.returncode == 2, mismatched.stderr[-3000:]
  assert ('zip needs lists of one length, got optimizer.learning_rate: 2, train.seed: 3'
          in mismatched.stderr)
  for result in (typo, mismatched):
    assert 'Traceback' not in result.stderr
  assert not any(p.is_dir() for p in root.glob('*'))  # no trial started
