"""launch.train with the SPMD pipeline engine: what it refuses, in real subprocesses.
(Its runs against one process and across clients: tests/test_pipeline_clients.py.)"""

from tests.conftest import run_module
from tests.test_launch import short_run

SPMD = short_run('configs/experiments/lm_pipeline_spmd.gin', num_steps=3, eval_every=3)


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
