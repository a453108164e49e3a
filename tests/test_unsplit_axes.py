"""A mesh axis that splits nothing is reported: logged by launch.train, printed by
launch.inspect.

An axis of size > 1 that is not the batch axis (nor a pipeline's stage axis,
nor the axis optimizer state is split over) and that no variable's layout
names splits nothing: the devices along it hold the same values and do the
same work. The quickstart on a {'data': 2, 'model': 4} mesh without layout
rules is one. lm_2d.gin, whose Megatron
rules name 'model', is the control that gives no warning.
"""

import gin
import pytest

from layout_core.layout.scope import unsplit_axes, unsplit_axis_warning
from plugins import gin_setup, plan as plan_lib
from tests.conftest import run_module

UNRULED_2X4 = "mesh.shape = {'data': 2, 'model': 4}"
WARNING = "mesh axis 'model' (size 4) splits nothing"


def test_unsplit_axes_are_the_big_axes_nothing_names():
  axes = {'stage': 2, 'data': 2, 'model': 4, 'one': 1}
  replicated = [('unsharded', 'unsharded'), ('unsharded',)]
  assert unsplit_axes(axes, specs=replicated, used=['data']) == ['stage', 'model']
  assert unsplit_axes(axes, specs=replicated, used=['data', 'stage', None]) == ['model']
  # one variable split over 'model' is enough; a size-1 axis never counts
  assert unsplit_axes(axes, specs=replicated + [('model', 'unsharded')],
                      used=['data', 'stage']) == []
  # the batch axis counts only as used: an axis the batch is not split over does not
  assert unsplit_axes({'data': 8}, specs=replicated, used=['unsharded']) == ['data']
  assert unsplit_axes({'data': 8}, specs=[('data', 'unsharded')], used=[]) == []


def test_the_warning_names_the_axis_and_what_would_use_it():
  text = unsplit_axis_warning('model', 4)
  assert text.startswith(WARNING)
  assert 'the 4 devices along it hold the same values and do the same work' in text
  assert 'configs/layouts/megatron.gin' in text and '\n' not in text


def plan_of(*files, bindings=()):
  try:
    with gin_setup.parsed_config(files=files, bindings=bindings, search_paths=()):
      return plan_lib.make_plan()
  finally:
    gin.clear_config()


@pytest.mark.parametrize('files, bindings, expected', [
    (['configs/experiments/quickstart.gin'], [UNRULED_2X4], ['model']),
    # the Megatron rules name 'model' (the control)
    (['configs/experiments/lm_2d.gin'], [], []),
    (['configs/experiments/quickstart.gin', 'configs/layouts/megatron.gin'], [UNRULED_2X4], []),
    (['configs/experiments/quickstart.gin'], [], []),
    # a rule that names 'model' but matches no variable splits nothing
    (['configs/experiments/quickstart.gin'],
     [UNRULED_2X4, "layout_rules.rules = [(r'.*/nothing', ('model',))]"], ['model']),
    # FSDP over 'model' stores every parameter split over it
    (['configs/experiments/quickstart.gin'], [UNRULED_2X4, "train.fsdp = 'model'"], []),
    # optimizer state split over 'model'
    (['configs/experiments/quickstart.gin'], [UNRULED_2X4, "optimizer.shard_state = 'model'"],
     []),
    # a pipeline's stage axis holds its stages; not pipelined, it holds copies
    (['configs/experiments/lm_pipeline.gin'], [], []),
    (['configs/experiments/lm_pipeline_spmd.gin'], [], []),
    (['configs/experiments/lm_2d.gin'],
     ["mesh.shape = {'stage': 2, 'data': 2, 'model': 2}"], ['stage']),
    # no batch axis on the mesh: the batch is not split over 'x' either
    (['configs/experiments/quickstart.gin'], ["mesh.shape = {'x': 8}"], ['x']),
], ids=['quickstart 2x4', 'lm_2d', 'quickstart + megatron 2x4', 'quickstart data=8',
        'a rule that matches nothing', 'fsdp over model', 'optimizer state over model',
        'submesh pipeline', 'spmd pipeline', 'stage axis, no pipeline', 'no batch axis'])
def test_the_plan_warns_of_each_axis_that_splits_nothing(files, bindings, expected):
  plan = plan_of(*files, bindings=bindings)
  axes = plan.mesh_spec.shape
  assert plan.unsplit_axis_warnings() == [unsplit_axis_warning(a, axes[a]) for a in expected]


def test_inspect_prints_the_warning_and_not_for_lm_2d():
  unruled, ruled = (
      run_module('launch.inspect', '--gin_file=configs/experiments/quickstart.gin',
                 f'--gin_bindings={UNRULED_2X4}', '--max_rows=1'),
      run_module('launch.inspect', '--gin_file=configs/experiments/lm_2d.gin', '--max_rows=1'))
  assert unruled.returncode == 0, unruled.stderr[-2000:]
  assert ruled.returncode == 0, ruled.stderr[-2000:]
  lines = unruled.stdout.splitlines()
  assert lines[0] == 'Mesh: CPU mesh 2x4=8 (data=2, model=4)', lines[:3]
  assert lines[1] == f'Warning: {unsplit_axis_warning("model", 4)}', lines[:3]
  assert 'splits nothing' not in ruled.stdout + ruled.stderr
  assert ruled.stdout.splitlines()[1] == ''


def test_train_logs_the_warning_before_it_builds_anything(tmp_path):
  """launch.train's real console. A TPU mesh on this CPU machine stops the run
  at the device check, right after the warning: nothing trains."""
  tpu = "--gin_bindings=mesh.device_type = 'TPU'"
  unruled = run_module('launch.train', '--gin_file=configs/experiments/quickstart.gin',
                       f'--gin_bindings={UNRULED_2X4}', tpu, f'--model_dir={tmp_path / "a"}')
  ruled = run_module('launch.train', '--gin_file=configs/experiments/lm_2d.gin', tpu,
                     f'--model_dir={tmp_path / "b"}')
  for result in (unruled, ruled):  # both reached the device check
    assert result.returncode == 2 and 'this machine has no TPU devices' in result.stderr, \
        result.stderr[-2000:]
  warned = [line for line in unruled.stderr.splitlines() if 'splits nothing' in line]
  assert len(warned) == 1, unruled.stderr[-3000:]
  assert warned[0].startswith('W') and warned[0].endswith(unsplit_axis_warning('model', 4))
  assert 'splits nothing' not in ruled.stderr
