"""Where a training step's time goes, per mesh: one child process per mesh.

For lm_small (3.3M parameters, batch 32 x 64) on `data=1` (one device), `data=8`
and `data=2 x model=4` (Megatron rules), each with its default optimizer state
(`shard_state='auto'`: sharded on `data=8`, not on 2x4) and with the other,
each phase timed on its own with a sync after it (so phases do not overlap,
unlike the training loop): the host batch, packing it onto the mesh, the
gradients function, the update function. Then the whole step as the loop runs it (no syncs between phases),
and a TensorFlow profiler trace of two such steps: CPU time per op type on the
devices' compute threads (all devices together; 2 cores give at most 2 ms of
it per ms of wall time), the ops run per step, and the CPU time DTensor spends
packing gradients into its combined all-reduce.

    python bench/step_breakdown.py [--steps 20 --out bench/results/step_breakdown.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, run_child, write_json  # noqa: E402

CHILD = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
shape, steps, options = json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
from layout_core.layout.mesh import MeshSpec, build_mesh, configure_virtual_cpus
import math
configure_virtual_cpus(math.prod(shape.values()))  # a one-device mesh: one device (threads)
mesh = build_mesh(MeshSpec(shape=shape))
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model.lm import transformer_lm_params
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig
from layout_core.run import make_trainer
from layout_core.optim import OptimizerConfig
MEGATRON = [(r'.*/attn/w[qkv]', ('unsharded', 'model', 'unsharded')),
            (r'.*/attn/wo', ('model', 'unsharded', 'unsharded')),
            (r'.*/ffn/w_in', ('unsharded', 'model')), (r'.*/ffn/b_in', ('model',)),
            (r'.*/ffn/w_out', ('model', 'unsharded'))]
lm = transformer_lm_params(vocab_size=256, model_dim=256, num_heads=8, ffn_dim=1024,
                           num_layers=4, max_len=64)
task = MarkovTask(vocab_size=256, seq_len=64)
trainer = make_trainer(model=lm, mesh=mesh, rules=LayoutRules(MEGATRON if 'model' in shape else []),
                       task=task, optimizer=OptimizerConfig(**options.get('optimizer', {})),
                       config=TrainConfig(batch_size=32, num_steps=10**6))
engine = trainer.engine
phases = {'batch': 0.0, 'pack': 0.0, 'gradients': 0.0, 'update': 0.0}
def timed(name, fn):
  start = time.perf_counter(); value = fn(); phases[name] += time.perf_counter() - start
  return value
for step in range(3 + steps):
  if step == 3:
    phases = dict.fromkeys(phases, 0.0)
  batch = timed('batch', lambda: task.features(split='train', step=step, batch_size=32))
  packed = timed('pack', lambda: engine.pack(batch))
  def gradients():
    loss, _, grads = engine.loss_and_gradients(packed)
    to_numpy(loss), to_numpy(grads[0])  # the embedding's: the backward pass's last
    return grads
  grads = timed('gradients', gradients)
  timed('update', lambda: to_numpy(engine.apply_gradients(grads)[0]))
start = time.perf_counter()
for step in range(steps):
  loss = trainer.train_step(task.features(split='train', step=step, batch_size=32))[0]
to_numpy(loss)
whole = (time.perf_counter() - start) / steps
# The profiler over 2 loop steps: CPU time per op type on the devices' compute
# threads (all devices together), per step.
import collections, tempfile
import tensorflow as tf
from bench.common import read_trace
logdir = tempfile.mkdtemp()
tf.profiler.experimental.start(logdir)
for step in range(2):
  loss = trainer.train_step(task.features(split='train', step=step, batch_size=32))[0]
to_numpy(loss)
tf.profiler.experimental.stop()
space = read_trace(logdir)
cpu_ms, count = collections.Counter(), collections.Counter()
for plane in space.planes:
  names = {k: v.name for k, v in plane.event_metadata.items()}
  for line in plane.lines:
    if not line.name.startswith('tf_Compute'):
      continue
    for event in line.events:
      name = names.get(event.metadata_id, '?')
      if name.startswith('Executor'):
        continue
      kind = name.rsplit(':', 1)[-1]
      if 'DTensorAllReduceOp' in name:
        kind = 'all-reduce packing (' + kind + ')'
      cpu_ms[kind] += event.duration_ps / 1e9 / 2
      count[kind] += 1
print('RESULT ' + json.dumps({'ms': {k: 1e3 * v / steps for k, v in phases.items()},
                              'loop_step_ms': 1e3 * whole,
                              'op_cpu_ms': dict(cpu_ms.most_common(10)),
                              'op_cpu_ms_total': sum(cpu_ms.values()),
                              'ops_per_step': sum(count.values()) // 2}))
'''


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'step_breakdown.json'))
  args = parser.parse_args()
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  results = {}
  sharded = {'optimizer': {'shard_state': True}}
  for name, shape, options in (
      ('1 device', {'data': 1}, {}), ('data=8 (sharded state)', {'data': 8}, {}),
      ('data=8, unsharded state', {'data': 8}, {'optimizer': {'shard_state': False}}),
      ('data=2 x model=4', {'data': 2, 'model': 4}, {}),
      ('data=2 x model=4, sharded state', {'data': 2, 'model': 4}, sharded)):
    results[name] = run_child(CHILD, repo, json.dumps(shape), str(args.steps),
                              json.dumps(options))
    phases = results[name]['ms']
    print(f"{name:32s} loop step {results[name]['loop_step_ms']:6.1f} ms | "
          + '  '.join(f'{k} {v:6.1f}' for k, v in phases.items()))
    print(f"{'':32s} op CPU time {results[name]['op_cpu_ms_total']:6.1f} ms in "
          f"{results[name]['ops_per_step']} ops: " + ', '.join(
              f'{k} {v:.1f}' for k, v in results[name]['op_cpu_ms'].items()))
  write_json(results, args.out)


if __name__ == '__main__':
  main()
