"""What Python's cyclic garbage collector costs the import of TensorFlow.

Importing TensorFlow (with DTensor) makes about 670,000 objects that live as
long as the process. With the collector on, their number triggers full
collections during the import, each walking every object made so far and
freeing almost none; every later full collection (one at exit, and others
in a long run) walks them again. `layout_core.lazy` imports with the
collector paused and then freezes what the import made (`gc.freeze`), so
later collections skip it. The contenders, each a fresh process:

* `collector on`: `import tensorflow` and DTensor, as a plain program does;
* `paused + frozen` (meshgin): the same modules through `layout_core.lazy`.

Per process: the CPU seconds of the import, the full collections during
it, and the CPU seconds of one full collection right after (what each
later one costs). The contenders run in turns, round after round; each
figure is the best round's.

    python bench/import_gc.py [--rounds 5]

Results go to bench/results/import_gc.json.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, children_in_turns, write_json  # noqa: E402

CONTENDERS = ('collector on', 'paused + frozen')
KEYS = ('import_cpu', 'full_collections', 'later_collection_cpu', 'objects', 'max_rss_mb')

CHILD = r'''
import gc, json, sys, time
contender = sys.argv[1]
full = []
gc.callbacks.append(lambda phase, info: full.append(1)
                    if phase == 'stop' and info['generation'] == 2 else None)
start = time.process_time()
if contender == 'collector on':
  import tensorflow
  from tensorflow.experimental import dtensor
  tensorflow.constant, dtensor.Mesh
else:
  from layout_core.lazy import dtensor, tf
  tf.constant, dtensor.Mesh
imported = time.process_time() - start
collections = len(full)
start = time.process_time()
gc.collect()
later = time.process_time() - start
import resource
print('RESULT ' + json.dumps({'import_cpu': imported, 'full_collections': collections,
                              'later_collection_cpu': later,
                              'objects': len(gc.get_objects()) + gc.get_freeze_count(),
                              'max_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                            / 1024}))
'''


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=5)
  args = parser.parse_args()
  rounds, best = children_in_turns(
      CHILD, {name: [name] for name in CONTENDERS}, rounds=args.rounds, keys=KEYS,
      describe=lambda r: (f'import {r["import_cpu"]:5.2f} CPU-s, {r["full_collections"]} full '
                          f'collections during it, one after {r["later_collection_cpu"]:.3f} '
                          f'CPU-s, {r["objects"]:,} objects, {r["max_rss_mb"]:.0f} MB'))
  on, paused = best['collector on'], best['paused + frozen']
  ratios = {'import_cpu_on_over_paused': on['import_cpu'] / paused['import_cpu'],
            'import_cpu_saved': on['import_cpu'] - paused['import_cpu'],
            'later_collection_on_over_frozen':
                on['later_collection_cpu'] / max(paused['later_collection_cpu'], 1e-6)}
  print(f'import: {on["import_cpu"]:.2f} CPU-s with the collector on, '
        f'{paused["import_cpu"]:.2f} paused ({ratios["import_cpu_on_over_paused"]:.2f}x); '
        f'a full collection after it: {on["later_collection_cpu"]:.3f} CPU-s unfrozen, '
        f'{paused["later_collection_cpu"]:.4f} frozen')
  write_json({'best': best, 'ratios': ratios, 'rounds': rounds},
             os.path.join(RESULTS, 'import_gc.json'))


if __name__ == '__main__':
  main()
