"""launch.inspect: a dry run that never allocates the model."""

import re

from tests.conftest import run_module


def test_inspect_100b_model_without_allocating():
  result = run_module('launch.inspect', '--gin_file=configs/experiments/lm_100b_inspect.gin',
                      '--max_rows=5')
  assert result.returncode == 0, result.stderr[-2000:]
  out = result.stdout
  params = int(re.search(r'Parameters: ([\d,]+)', out).group(1).replace(',', ''))
  assert params >= 100e9
  assert '| lm/emb/table | 51200x12288 | float32 | unsharded, model |' in out
  assert re.search(r"56  rule 0: \.\*/attn/wq", out) and re.search(r"112  rule 1: \.\*/attn/w\[kv\]", out)
  per_device = float(re.search(r'parameters\s+([\d.,]+) GiB', out).group(1).replace(',', ''))
  total = float(re.search(r'\(([\d.,]+) GiB total\)', out).group(1).replace(',', ''))
  assert per_device < total / 20  # mostly sharded 32 ways


def test_inspect_reports_a_bad_rule_with_exit_2():
  result = run_module('launch.inspect', '--gin_file=configs/experiments/lm_2d.gin',
                      "--gin_bindings=layout_rules.rules = [(r'.*/ffn/w_in', ('model',))]")
  assert result.returncode == 2
  assert "'lm/stack/block_000/ffn/w_in' has rank 2" in result.stderr
  assert 'Traceback' not in result.stderr


def test_train_rejects_unknown_mesh_axis_and_oversized_mesh(tmp_path):
  axis = run_module('launch.train', '--gin_file=configs/experiments/lm_2d.gin',
                    "--gin_bindings=layout_rules.rules = [(r'.*/ffn/w_in', ('unsharded', 'tensor'))]",
                    f'--model_dir={tmp_path}')
  assert axis.returncode == 2 and "'tensor'" in axis.stderr and "['data', 'model']" in axis.stderr
  big = run_module('launch.train', '--gin_file=configs/experiments/quickstart.gin',
                   "--gin_bindings=mesh.shape = {'data': 4, 'model': 4}",
                   "--gin_bindings=mesh.device_type = 'TPU'", f'--model_dir={tmp_path}')
  assert big.returncode == 2 and 'this machine has no TPU devices' in big.stderr
  assert "mesh.device_type = 'CPU'" in big.stderr
