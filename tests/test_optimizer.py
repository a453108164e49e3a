"""Adam against its defining property on the first step; the optimizer
package's TensorFlow-free half."""

import subprocess
import sys

import numpy as np
import pytest

from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from tests.test_layout_scope import MEGATRON, lm_trainer


def test_first_adam_step_moves_each_parameter_by_the_learning_rate(mesh_2x4):
  """Step 1 of Adam: m = (1-b1) g, v = (1-b2) g^2, bias-corrected m/sqrt(v) =
  g / (|g| + eps / sqrt(1 - b2)), so every weight moves by at most lr and by
  ~lr where |g| >> 1e-7 (the small attention-logit weights reach 0.999 lr).
  A version that re-read the slots after assigning them moved nothing."""
  trainer = lm_trainer(mesh_2x4, LayoutRules(MEGATRON), steps=1)
  lr = trainer.engine.optimizer.config.learning_rate
  before = {p: to_numpy(v).copy() for p, v in trainer.engine.variables.items()}
  trainer.train_step({'tokens': trainer.task.batch(step=0, batch_size=8)})
  for path, variable in trainer.engine.variables.items():
    moved = np.abs(to_numpy(variable) - before[path])
    assert moved.max() == pytest.approx(lr, rel=1e-2), path
    assert np.all(moved <= lr * (1 + 1e-3)), path


def test_the_config_and_the_memory_estimate_import_no_tensorflow():
  """`launch.inspect` and the plan read the optimizer config, its sharding
  policy and its slot descriptions before (or without) TensorFlow."""
  code = ('import sys, layout_core.optim.config, layout_core.optim, layout_core.train.memory; '
          "from layout_core.optim import OptimizerConfig, optimizer_class; "
          "optimizer_class('adafactor').slot_specs((256, 128), OptimizerConfig()); "
          "assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
