"""The SPMD pipeline's per-clock moves, each way DTensor offers, side by side.

Every clock the SPMD engine (`layout_core.pipeline.spmd.SpmdPipeline`) moves
its stage-sharded buffer `[S, mb, seq, d]` one slot along the stage axis
(slot s -> s + 1), and takes the last slot out for the loss. Candidates for
each, forward and backward (training runs both), on `stage=2 x data=2 x
model=2` (8 CPU devices), an lm_small micro-batch (mb=4 of 32/8, seq 64, d
256), buffer sharded [stage, data, -, -] as the engine keeps it:

shift
* `einsum`: a [S, S] shift matrix contracted with the buffer, then a relayout
  back to stage-sharded: an all-reduce of the whole buffer (the engine's way);
* `gather`: `tf.gather` of the slots in shifted order on the sharded dim,
  then a relayout back to stage-sharded;
* `replicate_gather`: relayout to replicated over stage (an all-gather), the
  same `tf.gather` on the now-local dim 0, relayout back (a local slice);
* `all_to_all_gather`: move the stage sharding from dim 0 to dim 2 (an
  all-to-all), `tf.gather` on dim 0, move it back (another all-to-all);
* `roll`: `tf.roll` on dim 0; `collective_permute`:
  `tf.raw_ops.CollectivePermute` (XLA's point-to-point move).

take the last slot (to [mb, seq, d], batch-sharded)
* `einsum`: a one-hot [S] vector contracted with the buffer (all-reduce);
* `gather`, `replicate_gather`, `all_to_all_gather`: `tf.gather` of slot S-1
  as above; `replicate_index`: `x[S-1]` after replicating over stage.

Each candidate's result is checked against NumPy; one that fails to compile
or gives wrong values is recorded as such. Timed in turns (median of
`--repeats` rounds, 7 moves per call, each followed by an elementwise op so
the moves cannot be fused away).

Measured (TF 2.21, bench/results/shift.json): `tf.roll` and
`CollectivePermute` have no DTensor layout propagation, and `tf.gather`
chains fail to compile (a relayout whose propagated layout does not match);
the all-to-all route is the one that beats the einsum, at 0.85x of its
3.2 ms. The nine shifts of an lm_small step (M=8, S=2) are 29 ms of its
593 ms (`bench/step.py`, bench/results/step.json); the all-to-all would save 4 ms of them: the shift
is not what keeps the SPMD engine below the unpipelined rate, and the engine
keeps the einsum. Taking the last slot costs the same
every way (within 0.9-1.2x).

    python bench/shift.py [--repeats 30] [--out bench/results/shift.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, timed_alternately, write_json  # noqa: E402
from layout_core.layout.mesh import MeshSpec, build_mesh, pack_global_array  # noqa: E402
from layout_core.layout.variables import to_numpy  # noqa: E402
from layout_core.lazy import dtensor, tf  # noqa: E402
import numpy as np  # noqa: E402

U = 'unsharded'
DEPTH = 7  # odd: on 2 stages an even number of shifts would be the identity


def candidates(mesh, stages: int):
  """{name: move} for the shift and for taking the last slot out."""
  buffer_layout = dtensor.Layout(['stage', 'data', U, U], mesh)
  gathered = dtensor.Layout([U, 'data', U, U], mesh)   # replicated over stage
  moved = dtensor.Layout([U, 'data', 'stage', U], mesh)  # stage sharding on dim 2
  # Cyclic here, so that every candidate computes the same roll; the engine's
  # matrix leaves slot 0 empty (it is refilled), at the same cost.
  shift = pack_global_array(np.roll(np.eye(stages), 1, axis=0).astype(np.float32),
                            dtensor.Layout.replicated(mesh, 2))
  one_hot = pack_global_array(np.eye(stages)[-1].astype(np.float32),
                              dtensor.Layout.replicated(mesh, 1))
  order = [(u - 1) % stages for u in range(stages)]  # out[u] = x[u - 1]
  last = dtensor.Layout(['data', U, U], mesh)
  shifts = {
      'einsum': lambda x: dtensor.relayout(tf.einsum('us,sbcd->ubcd', shift, x), buffer_layout),
      'gather': lambda x: dtensor.relayout(tf.gather(x, order, axis=0), buffer_layout),
      'replicate_gather': lambda x: dtensor.relayout(
          tf.gather(dtensor.relayout(x, gathered), order, axis=0), buffer_layout),
      'all_to_all_gather': lambda x: dtensor.relayout(
          tf.gather(dtensor.relayout(x, moved), order, axis=0), buffer_layout),
      'roll': lambda x: tf.roll(x, 1, axis=0),
      'collective_permute': lambda x: tf.raw_ops.CollectivePermute(
          input=x, source_target_pairs=[[s, (s + 1) % stages] for s in range(stages)]),
  }
  takes = {
      'einsum': lambda x: tf.einsum('s,sbcd->bcd', one_hot, x),
      'gather': lambda x: dtensor.relayout(tf.gather(x, stages - 1, axis=0), last),
      'replicate_gather': lambda x: dtensor.relayout(
          tf.gather(dtensor.relayout(x, gathered), stages - 1, axis=0), last),
      'all_to_all_gather': lambda x: dtensor.relayout(
          tf.gather(dtensor.relayout(x, moved), stages - 1, axis=0), last),
      'replicate_index': lambda x: dtensor.relayout(x, gathered)[stages - 1],
  }
  return shifts, takes


def compiled(body):
  """Forward and backward of `body` in one tf.function: (output, input gradient)."""
  @tf.function(autograph=False)
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = body(x)
      loss = tf.reduce_sum(y * y)
    return y, tape.gradient(loss, x)
  return step


def checked(step, value, expected) -> dict:
  """{'ok': True, 'call': timed call} if `step` compiles and gives `expected`."""
  try:
    got = to_numpy(step(value)[0])
  except Exception as e:  # pylint: disable=broad-except
    return {'ok': False, 'error': f'{type(e).__name__}: {str(e).splitlines()[0][:200]}'}
  if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-4, atol=1e-4):
    return {'ok': False, 'error': 'wrong values'}
  return {'ok': True, 'call': lambda: [to_numpy(t) for t in step(value)]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--repeats', type=int, default=30)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'shift.json'))
  args = parser.parse_args()
  stages = 2
  mesh = build_mesh(MeshSpec(shape={'stage': stages, 'data': 2, 'model': 2}))
  host = np.random.default_rng(0).normal(size=[stages, 4, 64, 256]).astype(np.float32)
  value = pack_global_array(host, dtensor.Layout(['stage', 'data', U, U], mesh))
  shifts, takes = candidates(mesh, stages)

  def chain(move):
    def body(x):
      for _ in range(DEPTH):
        x = move(x) * 1.0001
      return x
    return body
  results = {
      'shift': {name: checked(compiled(chain(move)), value,
                              np.roll(host, DEPTH % stages, axis=0) * 1.0001 ** DEPTH)
                for name, move in shifts.items()},
      'take_last': {name: checked(compiled(take), value, host[-1])
                    for name, take in takes.items()}}
  timed = {}
  for group, entries in results.items():
    for name, result in entries.items():
      if result['ok']:
        timed[(group, name)] = result.pop('call')
  times = timed_alternately(timed, args.repeats)
  for (group, name), seconds in times.items():
    per = seconds / (DEPTH if group == 'shift' else 1)
    results[group][name]['ms'] = round(per * 1000, 3)
  for group, entries in results.items():
    base = entries['einsum'].get('ms')
    print(f'{group}:')
    for name, result in entries.items():
      if result['ok']:
        result['vs_einsum'] = round(result['ms'] / base, 2) if base else None
        print(f"  {name:20s} {result['ms']:8.3f} ms  ({result['vs_einsum']:.2f}x einsum)")
      else:
        print(f"  {name:20s} fails: {result['error']}")
  write_json(results, args.out)


if __name__ == '__main__':
  main()
