"""Limit check: the sub-mesh engine cannot pin its residual stream.

The one-program engine and the SPMD pipeline run transformer blocks inside
`layout_core.model.activations.residual_pin`, which relays the residual
stream to the batch split (12% faster on lm_small `data=2 x model=4`). The
sub-mesh engine's stages run without it. This builds the sub-mesh engine of
configs/experiments/lm_pipeline.gin (2 stages of `data=2 x model=2`, 4
micro-batches, no dropout) the way `launch.train` does and trains 3 steps,
each variation in a fresh process:

* `no pin`: the engine as it is (the reference losses);
* `pin everywhere`: every stage call in the context, on its own sub-mesh;
* `pin in the forward function only` / `pin in the backward function only`:
  the engine's two step functions (`GPipe._forward_fn`, `GPipe._backward_fn`,
  which recomputes each stage's forward under its tape).

Measured (TF 2.21, 2026-11-26): every variation that pins inside the
backward function fails to compile with "'tf.Identity' op CopyToMeshOp must
be used to send data across mesh"; pinning in the forward function alone
trains with the reference's losses but saves nothing, since the backward
recomputes every stage's forward unpinned.

    python bench/limits/submesh_residual_limit.py [--out bench/results/submesh_residual.json]
"""

from __future__ import annotations

import argparse
import os
import sys

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.common import RESULTS, run_child, write_json  # noqa: E402

CHILD = r'''
import contextlib, json, sys, time
sys.path.insert(0, sys.argv[2])
variation = sys.argv[1]
from layout_core.layout.variables import to_numpy
from layout_core.model.activations import residual_pin
from layout_core.step_context import StepContext, entered
from layout_core.pipeline import placement, submesh
from plugins import gin_setup, plan as plan_lib
from plugins.training import build_trainer

where = {'no pin': set(), 'pin everywhere': {'forward', 'backward'},
         'pin in the forward function only': {'forward'},
         'pin in the backward function only': {'backward'}}[variation]
current = []
run = placement.SubMeshPlacement.run

def pinned_run(self, k, fn, *args):
  pin = residual_pin(mesh=self.meshes[k], batch_axis=self.batch_axis)
  context = (entered(StepContext(residual=pin))
             if current and current[-1] in where else contextlib.nullcontext())
  with context:
    return run(self, k, fn, *args)
placement.SubMeshPlacement.run = pinned_run

def inside(name, method):
  def wrapped(self, *args, **kwargs):
    current.append(name)
    try:
      return method(self, *args, **kwargs)
    finally:
      current.pop()
  return wrapped
submesh.GPipe._forward_fn = inside('forward', submesh.GPipe._forward_fn)
submesh.GPipe._backward_fn = inside('backward', submesh.GPipe._backward_fn)

gin_setup.parse_gin(files=[sys.argv[3]], bindings=['transformer_lm.dropout_rate = 0.0'])
plan = plan_lib.make_plan()
trainer = build_trainer(plan)
losses, times = [], []
try:
  for step in range(3):
    start = time.perf_counter()
    batch = plan.task.features(split='train', step=step, batch_size=plan.train.batch_size)
    losses.append(float(to_numpy(trainer.train_step(batch)[0])))
    times.append(time.perf_counter() - start)
  result = {'ok': True, 'losses': losses, 'last_step_seconds': times[-1]}
except Exception as error:  # pylint: disable=broad-except
  message = ' '.join(str(error).split())
  found = message.find("'tf.")
  shown = message[found:message.find('.', message.find('across mesh')) + 1] if found >= 0 \
      else message[:160]
  result = {'ok': False, 'error': f'{type(error).__name__}: {shown}'}
print('RESULT ' + json.dumps(result))
'''

VARIATIONS = ('no pin', 'pin everywhere', 'pin in the forward function only',
              'pin in the backward function only')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'submesh_residual.json'))
  args = parser.parse_args()
  repo = REPO
  config = os.path.join(repo, 'configs', 'experiments', 'lm_pipeline.gin')
  rows = []
  for variation in VARIATIONS:
    result = run_child(CHILD, variation, repo, config)
    if result['ok'] and rows and rows[0]['ok']:
      result['same_losses_as_no_pin'] = all(
          abs(a - b) <= 1e-5 * abs(b) for a, b in zip(result['losses'], rows[0]['losses']))
    rows.append({'variation': variation, **result})
    outcome = (f"trains, losses {', '.join(f'{l:.5f}' for l in result['losses'])}"
               if result['ok'] else result['error'])
    print(f'{variation:36s} {outcome}', flush=True)
  write_json(rows, args.out)


if __name__ == '__main__':
  main()
