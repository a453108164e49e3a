"""A user's own package (tests/fixtures/my_project, outside layout_core) brings a
layer, a task and a Keras model; launch.train and launch.inspect use them from
.gin files that import them."""

import os

from tests.conftest import read_events, run_module

USER = ['--gin_search_paths=tests/fixtures', '--gin_bindings=train.log_every = 5',
        '--gin_bindings=train.eval_batches = 2']


def test_user_layer_and_task_train_from_gin_with_rules(tmp_path):
  model_dir = str(tmp_path / 'gated')
  result = run_module('launch.train', *USER, '--gin_file=my_project/gated.gin',
                      '--gin_bindings=train.num_steps = 30',
                      '--gin_bindings=train.eval_every = 15', f'--model_dir={model_dir}')
  assert result.returncode == 0, result.stderr[-3000:]
  events = read_events(model_dir)
  losses = [v for _, v in events['scalars']['eval/loss']]
  assert len(losses) == 3 and losses[-1] < 0.5 * losses[0]
  assert 'eval/accuracy' in events['scalars'] and 'train/accuracy' in events['scalars']
  table = events['text']['layouts/variables'][0]
  assert '| clf/gated/w_gate | 8x32 | float32 | unsharded, model | 0: .*/gated/w.* |' in table
  assert 'gated_dense.output_dim = 32' in open(os.path.join(model_dir, 'config.gin')).read()
  assert 'GatedDense' in open(os.path.join(model_dir, 'params.txt')).read()


def test_inspect_plans_the_user_layer_without_training():
  result = run_module('launch.inspect', *USER, '--gin_file=my_project/gated.gin')
  assert result.returncode == 0, result.stderr[-3000:]
  assert '| clf/gated/b | 32 | float32 | model | 1: .*/gated/b | 32 |' in result.stdout
  assert 'FLOPs' in result.stdout


def test_keras_model_trains_from_gin_with_layout_table_and_checkpoint(tmp_path):
  model_dir = str(tmp_path / 'keras')
  result = run_module('launch.train', *USER, '--gin_file=my_project/keras.gin',
                      '--gin_bindings=train.num_steps = 20',
                      '--gin_bindings=train.eval_every = 0', f'--model_dir={model_dir}')
  assert result.returncode == 0, result.stderr[-3000:]
  events = read_events(model_dir)
  losses = [v for _, v in events['scalars']['eval/loss']]
  assert losses[-1] < 0.7 * losses[0]
  assert '| hidden/kernel | 8x32 | float32 | unsharded, model |' in (
      events['text']['layouts/variables'][0])
  assert os.path.isdir(os.path.join(model_dir, 'checkpoints', 'ckpt-20'))


def test_unimportable_user_package_exits_2(tmp_path):
  result = run_module('launch.inspect', '--gin_file=tests/fixtures/my_project/gated.gin')
  assert result.returncode == 2, result.stderr[-2000:]
  assert "import failed: No module named 'my_project'" in result.stderr and '--gin_search_paths' in result.stderr
  assert 'Traceback' not in result.stderr


def test_registered_layer_takes_exactly_its_params_keys():
  import pytest  # pylint: disable=g-import-not-at-top
  from layout_core.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from plugins import configurables, gin_setup  # pylint: disable=g-import-not-at-top
  from plugins.registry import snake_case  # pylint: disable=g-import-not-at-top
  from tests.conftest import REPO_ROOT  # pylint: disable=g-import-not-at-top
  fixtures = os.path.join(REPO_ROOT, 'tests', 'fixtures')
  gin_setup.parse_gin(files=['my_project/gated.gin'], search_paths=[fixtures],
                      bindings=['gated_dense.output_dim = 24', 'softmax.input_dim = 24'])
  tree = configurables.model()
  assert [p.cls.__name__ for p in tree.sub] == ['GatedDense', 'Softmax']
  assert tree.sub[0].output_dim == 24 and tree.sub[0].input_dim == 8  # bound / default
  with pytest.raises(ConfigError, match="Did you mean 'output_dim'.*takes: name, dtype, "
                                        'fprop_dtype, remat, input_dim, output_dim, '
                                        'init_stddev'):
    gin_setup.parse_gin(files=['my_project/gated.gin'], search_paths=[fixtures],
                        bindings=['gated_dense.output_dimm = 3'])
  assert snake_case('GatedDense') == 'gated_dense' and snake_case('MLPBlock') == 'mlp_block'
