"""What Grappler's passes cost a DTensor run's compile on CPU, and what they buy.

A DTensor step function compiles one copy per device, and Grappler
optimizes each copy on its own: on the 8 virtual CPU devices of the
quickstart it runs 8 times per step function. `build_mesh` keeps only the
passes that rewrite something in meshgin's step functions, run once
(`layout_core.tf_internals.trim_graph_passes`). The contenders:

* `TensorFlow default`: every pass, two rounds (the memory optimizer off,
  as `build_mesh` always has it: `keep_sums_whole`);
* `trimmed` (meshgin): no layout optimizer, implementation selector or TFG
  pass, one round;
* `trimmed, no constant folding`: also without the costliest pass left,
  to see what it buys.

The work: the quickstart's model (a 2-layer LM, 111,936 parameters) trained
on the Markov task, on `data=8`, and on `data=2 x model=4` with Megatron
rules; each contender in a fresh process, in turns round after round; each
figure is the best round's. Per run: the CPU seconds of the first training
step (the gradients and the update functions: trace, compile, run), of
the first evaluation, the milliseconds of a later step (median of 10), and
the losses of 8 steps, which must be equal bit for bit.

    python bench/grappler_passes.py [--rounds 3]

Results go to bench/results/grappler_passes.json.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, run_child, write_json  # noqa: E402

CONTENDERS = ('TensorFlow default', 'trimmed', 'trimmed, no constant folding')
MESHES = {'data=8': {'data': 8}, 'data=2 x model=4': {'data': 2, 'model': 4}}

CHILD = r'''
import json, statistics, sys, time
contender, shape = sys.argv[1], json.loads(sys.argv[2])
from layout_core import tf_internals
from layout_core.layout.mesh import MeshSpec, build_mesh, configure_virtual_cpus
configure_virtual_cpus(8)
if contender == 'TensorFlow default':
  tf_internals.trim_graph_passes = lambda device_type: None
elif contender == 'trimmed, no constant folding':
  trim = tf_internals.trim_graph_passes
  def trim_more(device_type):
    trim(device_type)
    tf_internals._rewrite(lambda r: setattr(r, 'constant_folding', r.OFF))
  tf_internals.trim_graph_passes = trim_more
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model.lm import transformer_lm_params
from layout_core.optim import OptimizerConfig
from layout_core.run import make_trainer
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig

MEGATRON = [(r'.*/attn/w[qkv]', ('unsharded', 'model', 'unsharded')),
            (r'.*/attn/wo', ('model', 'unsharded', 'unsharded')),
            (r'.*/ffn/w_in', ('unsharded', 'model')), (r'.*/ffn/b_in', ('model',)),
            (r'.*/ffn/w_out', ('model', 'unsharded')),
            (r'.*/emb/table', ('unsharded', 'model')), (r'.*/softmax/w', ('unsharded', 'model'))]
mesh = build_mesh(MeshSpec(shape=shape))
trainer = make_trainer(
    model=transformer_lm_params(vocab_size=64, model_dim=64, num_heads=4, ffn_dim=256,
                                num_layers=2, max_len=64),
    mesh=mesh, rules=LayoutRules(MEGATRON if 'model' in shape else []),
    task=MarkovTask(vocab_size=64, seq_len=64, seed=1234),
    optimizer=OptimizerConfig(name='adam', learning_rate=1e-3),
    config=TrainConfig(num_steps=20, batch_size=32, log_every=1, eval_every=0, eval_batches=1))
reader = trainer.task.reader(split='train', batch_size=32)

def step():
  loss = trainer.train_step(next(reader))[0]
  return float(to_numpy(loss))

start = time.process_time()
losses = [step()]
first_step = time.process_time() - start
start = time.process_time()
trainer.evaluate()
first_eval = time.process_time() - start
later = []
for _ in range(10):
  start = time.perf_counter()
  losses.append(step())
  later.append(time.perf_counter() - start)
print('RESULT ' + json.dumps({'first_step_cpu': first_step, 'first_eval_cpu': first_eval,
                              'later_step_ms': 1000 * statistics.median(later),
                              'losses': [repr(l) for l in losses[:8]]}))
'''
KEYS = ('first_step_cpu', 'first_eval_cpu', 'later_step_ms')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  import json  # pylint: disable=g-import-not-at-top
  rounds = {mesh: {name: [] for name in CONTENDERS} for mesh in MESHES}
  for number in range(args.rounds):
    for mesh, shape in MESHES.items():
      for name in CONTENDERS:
        result = run_child(CHILD, name, json.dumps(shape))
        rounds[mesh][name].append(result)
        print(f'round {number + 1} {mesh:16s} {name:28s} first step {result["first_step_cpu"]:5.2f}'
              f' CPU-s, first eval {result["first_eval_cpu"]:5.2f} CPU-s, later step '
              f'{result["later_step_ms"]:6.1f} ms', flush=True)
  best = {mesh: {name: {key: min(r[key] for r in runs) for key in KEYS}
                 for name, runs in by_name.items()} for mesh, by_name in rounds.items()}
  same_losses = {mesh: len({tuple(r['losses']) for runs in by_name.values() for r in runs}) == 1
                 for mesh, by_name in rounds.items()}
  ratios = {}
  for mesh, by_name in best.items():
    default, trimmed = by_name['TensorFlow default'], by_name['trimmed']
    ratios[mesh] = {
        'compile_cpu_default_over_trimmed':
            (default['first_step_cpu'] + default['first_eval_cpu'])
            / (trimmed['first_step_cpu'] + trimmed['first_eval_cpu']),
        'later_step_trimmed_over_default': trimmed['later_step_ms'] / default['later_step_ms'],
        'later_step_no_folding_over_trimmed':
            by_name['trimmed, no constant folding']['later_step_ms'] / trimmed['later_step_ms']}
    print(f'{mesh}: first step + eval {ratios[mesh]["compile_cpu_default_over_trimmed"]:.2f}x '
          f'the CPU with TensorFlow\'s default passes; a later step trimmed / default '
          f'{ratios[mesh]["later_step_trimmed_over_default"]:.2f}, without constant folding / '
          f'trimmed {ratios[mesh]["later_step_no_folding_over_trimmed"]:.2f}; losses equal bit '
          f'for bit across all: {same_losses[mesh]}')
  write_json({'best': best, 'ratios': ratios, 'same_losses': same_losses,
              'rounds': {m: {n: [{k: v for k, v in r.items() if k != 'losses'} for r in runs]
                             for n, runs in by_name.items()} for m, by_name in rounds.items()}},
             os.path.join(RESULTS, 'grappler_passes.json'))


if __name__ == '__main__':
  main()
