"""What tracing a SavedModel's signatures costs with and without AutoGraph.

`launch.export` traces each signature (`serving_default`, `generate`) once.
AutoGraph rewrites every Python function the trace calls (the model's layers,
the decoding loop) so that Python `if`/`for` on tensors become graph control
flow; meshgin's own code has none. `layout_core.model.built.traced_function`
traces without it unless the code needs it; the `with AutoGraph` contender
forces it on, as `tf.function`'s default did before.

    python bench/export_trace.py [--rounds 3]

It trains the quickstart for 2 steps on `data=2` once, then exports that
checkpoint in fresh processes, the contenders in turns round after round;
each figure is the best round's CPU seconds of `export_saved_model` (the
tracing and the write) and of the whole `launch.export` process. The two
exports' logits are compared too. Results go to
bench/results/export_trace.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, run_child, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTENDERS = ('without AutoGraph', 'with AutoGraph')

CHILD = r'''
import json, resource, sys, time
autograph, model_dir, export_dir = sys.argv[1] == '1', sys.argv[2], sys.argv[3]
from absl import app
from layout_core.infer import export
from layout_core.lazy import tf
if autograph:  # tf.function's default: AutoGraph converts everything traced
  def traced_function(fn, *, input_signature):
    function = tf.function(fn, input_signature=input_signature)
    return function, function.get_concrete_function()
  export.traced_function = traced_function
spent = {}
save = export.export_saved_model
def timed(*args, **kwargs):
  start = time.process_time()
  try:
    return save(*args, **kwargs)
  finally:
    spent['export'] = time.process_time() - start
export.export_saved_model = timed
import launch.export as launcher
sys.argv = ['launch.export', f'--model_dir={model_dir}', f'--export_dir={export_dir}']
try:
  app.run(launcher.main)
except SystemExit:
  pass
usage = resource.getrusage(resource.RUSAGE_SELF)
print('RESULT ' + json.dumps({'export_cpu': spent['export'],
                              'process_cpu': usage.ru_utime + usage.ru_stime}))
'''

LOGITS = r'''
import json, sys
import numpy as np
import tensorflow as tf
tokens = tf.constant(np.random.RandomState(0).randint(0, 64, (2, 64)), tf.int32)
outs = [tf.saved_model.load(d).signatures['serving_default'](tokens=tokens)['logits'].numpy()
        for d in sys.argv[1:]]
print('RESULT ' + json.dumps(float(np.max(np.abs(outs[0] - outs[1])))))
'''


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  work = tempfile.mkdtemp(prefix='export-trace-')
  model_dir = os.path.join(work, 'run')
  subprocess.run([sys.executable, '-m', 'launch.train',
                  '--gin_file=configs/experiments/quickstart.gin',
                  "--gin_bindings=mesh.shape = {'data': 2}", '--gin_bindings=train.num_steps = 2',
                  f'--model_dir={model_dir}'], cwd=REPO, check=True, capture_output=True,
                 env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  rounds = {name: [] for name in CONTENDERS}
  for number in range(args.rounds):
    for name in CONTENDERS:
      export_dir = os.path.join(work, f'{name.replace(" ", "_")}-{number}')
      rounds[name].append(run_child(CHILD, '1' if name == 'with AutoGraph' else '0',
                                    model_dir, export_dir))
      print(f'round {number + 1} {name:18s} export {rounds[name][-1]["export_cpu"]:6.2f} '
            f'CPU-s, process {rounds[name][-1]["process_cpu"]:6.2f}', flush=True)
  best = {name: {key: min(r[key] for r in runs) for key in ('export_cpu', 'process_cpu')}
          for name, runs in rounds.items()}
  difference = run_child(LOGITS, *(os.path.join(work, f'{n.replace(" ", "_")}-0')
                                   for n in CONTENDERS))
  ratio = best['with AutoGraph']['export_cpu'] / best['without AutoGraph']['export_cpu']
  print(f'export_saved_model: {ratio:.1f}x the CPU with AutoGraph; '
        f'logits differ by {difference:g}')
  write_json({'best': best, 'ratio_export_cpu_with_autograph': ratio,
              'max_logit_difference': difference, 'rounds': rounds},
             os.path.join(RESULTS, 'export_trace.json'))


if __name__ == '__main__':
  main()
