"""launch.train with the SPMD pipeline engine against the plain run, in real subprocesses."""

import glob
import os

import pytest

from tests.conftest import read_events, run_module, run_modules
from tests.test_launch import short_run

SPMD = short_run('configs/experiments/lm_pipeline_spmd.gin', num_steps=3, eval_every=3)
PLAIN = ["--gin_bindings=mesh.shape = {'data': 2, 'model': 2}",
         "--gin_bindings=pipeline.engine = 'submesh'", '--gin_bindings=pipeline.num_stages = 1',
         '--gin_bindings=pipeline.num_micro_batches = 1',
         '--gin_bindings=pipeline.circular_repeats = 1']


def test_spmd_run_on_two_clients_equals_the_plain_run_and_profiles_its_steps(tmp_path):
  """Same config, dropout on, {'stage': 2, 'data': 2, 'model': 2} with 2 circular
  repeats (in 2 micro-batches, not the config's 4: two thirds of the
  compile) on 2 clients of 4 devices ('stage' across them: each stage on its
  own client) vs no pipeline in one process: the same losses at every step
  and the same eval loss."""
  spmd_dir, plain_dir = str(tmp_path / 'spmd'), str(tmp_path / 'plain')
  spmd, plain = run_modules([  # independent: started together
      ('launch.local_cluster', '--num_clients=2', '--devices_per_client=4', '--',
       *SPMD, '--gin_bindings=train.log_every = 1',
       '--gin_bindings=pipeline.num_micro_batches = 2',
       '--gin_bindings=train.profile_steps = (1, 2)', f'--model_dir={spmd_dir}'),
      ('launch.train', *SPMD, *PLAIN, '--gin_bindings=train.log_every = 1',
       f'--model_dir={plain_dir}')])
  assert spmd.returncode == 0, spmd.stdout[-3000:]
  assert plain.returncode == 0, plain.stderr[-3000:]
  assert 'exit status per client: [0, 0]' in spmd.stdout
  assert '[client 1]' in spmd.stdout and 'Joined: client 1 of 2' in spmd.stdout
  a, b = read_events(spmd_dir)['scalars'], read_events(plain_dir)['scalars']
  assert [s for s, _ in a['train/loss']] == [1, 2, 3]
  for tag in ('train/loss', 'train/grad_norm', 'eval/loss'):
    for (step, x), (_, y) in zip(a[tag], b[tag], strict=True):
      assert x == pytest.approx(y, rel=1e-5), (tag, step)
  [(_, bubble)] = a['pipeline/bubble_fraction']
  assert bubble == pytest.approx(1 / 5)  # (S-1)/(R*M+S-1), S=2, R=2, M=2
  texts = read_events(spmd_dir)['text']
  assert 'stacked_cells/ffn/w_in' in texts['layouts/variables'][0]
  assert 'block_000, block_002' in texts['pipeline/stages'][0]
  traces = glob.glob(os.path.join(spmd_dir, 'plugins', 'profile', '*', '*.xplane.pb'))
  assert traces and os.path.getsize(traces[0]) > 0
  assert 'pipeline/bubble_fraction_measured' not in a


def test_spmd_errors_exit_2_with_the_knob(tmp_path):
  cases = {
      'pipeline.num_micro_batches = 1': 'needs at least as many micro-batches as stages',
      'transformer_lm.num_layers = 6': '6 cells do not split into 2 stages x 2',
      "pipeline.engine = 'ring'": "pipeline.engine is 'ring'",
  }
  for binding, message in cases.items():
    result = run_module('launch.train', *SPMD, f'--gin_bindings={binding}',
                        f'--model_dir={tmp_path}')
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert 'Traceback' not in result.stderr
