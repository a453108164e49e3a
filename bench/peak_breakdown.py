r"""Where a gradients step's peak memory goes: live tensors by op at the peak.

`bench/memory.py` measures a run's peak RSS; this says what makes it. For
bench/memory.py's LM (quickstart's Markov task, 2 blocks, ffn = 4 x width,
batch 32 x 64, `data=8`) under one of its settings, in this process: build
the trainer, run the gradients function once (compile), then run it again
under TensorFlow's profiler. TensorFlow's CPU allocator (oneDNN's, a BFC
pool shared by the 8 virtual devices) records each allocation and free with
the op that made it; from those this finds the moment the allocator held
the most bytes during the call and lists the tensors made during the call
that were live then, summed by op (numbers stripped) with their shapes and
dtypes. Also: bytes held before the call (variables and optimizer slots)
and the process's RSS.

    python bench/peak_breakdown.py [--width 1728] [--setting bf16+remat+fsdp]
        [--out bench/results/peak_breakdown.json]

Measured (width 1728, bf16 + remat + FSDP, 72.0M parameters; results in
bench/results/peak_breakdown.json): 0.80 GiB held before the call (the
parameters and Adam's slots), 2.12 GiB at the allocator's peak in it, of
which 1.27 GiB was made during the call, now in the forward pass: the
all-to-alls that gather each matrix per replica (0.71 GiB of whole bfloat16
weights, one per device each) and their broadcast inputs (0.53 GiB), a
block's matrices all at once. Before `train.fsdp` moved matrices by
all-to-all in bfloat16 (`layout_core.layout.fsdp.per_replica`), the same call
peaked at 2.76 GiB, 1.47 GiB of it the float32 whole-weight buffers of
DTensor's reduce-scatter (an all-reduce of the whole weight on every device,
then the split) and 0.31 GiB its ring's chunks, each device's buffer living
until the last of the 8 time-sliced devices reached that collective.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import RESULTS, read_trace, write_json  # noqa: E402
from bench.memory import SETTINGS, lm_bindings  # noqa: E402
from plugins.suggest.measure import rss_bytes  # noqa: E402

GIB = 2**30


def memory_events(logdir: str) -> list[tuple[int, str, dict]]:
  """(time ns, 'MemoryAllocation' | 'MemoryDeallocation', stats) from the trace."""
  events = []
  for plane in read_trace(logdir).planes:
    names = {k: v.name for k, v in plane.event_metadata.items()}
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    for line in plane.lines:
      for event in line.events:
        kind = names.get(event.metadata_id, '')
        if kind in ('MemoryAllocation', 'MemoryDeallocation'):
          stats = {}
          for s in event.stats:
            value = getattr(s, s.WhichOneof('value'))
            stats[stat_names.get(s.metadata_id, '')] = (
                stat_names.get(value, value) if s.WhichOneof('value') == 'ref_value' else value)
          events.append((line.timestamp_ns + event.offset_ps // 1000, kind, stats))
  return sorted(events, key=lambda e: e[0])


def breakdown(events, *, min_bytes: int) -> dict:
  """The allocator's largest in-use bytes during the trace, and the tensors
  allocated in it and live at that moment, by op."""
  live, peak, at_peak = {}, 0, {}
  for _, kind, stats in events:
    if kind == 'MemoryAllocation':
      live[stats.get('addr')] = stats
    else:
      live.pop(stats.get('addr'), None)
    if stats.get('bytes_allocated', 0) > peak:
      peak, at_peak = stats['bytes_allocated'], dict(live)
  by_op = collections.defaultdict(lambda: {'bytes': 0, 'tensors': collections.Counter()})
  for stats in at_peak.values():
    op = re.sub(r'_?\d+', '', stats.get('tf_op', '') or '(no op)')
    entry = by_op[op]
    entry['bytes'] += stats.get('requested_bytes', 0)
    entry['tensors'][f"{stats.get('shape', '')} dtype {stats.get('data_type', '')}"] += 1
  rows = [{'op': op, 'bytes': v['bytes'], 'tensors': dict(v['tensors'])}
          for op, v in sorted(by_op.items(), key=lambda kv: -kv[1]['bytes'])
          if v['bytes'] >= min_bytes]
  return {'allocator_peak_bytes': peak,
          'made_in_call_live_at_peak_bytes': sum(s.get('requested_bytes', 0)
                                                 for s in at_peak.values()),
          'by_op': rows}


def live_at_peak(call, *, min_bytes: int) -> dict:
  """`breakdown` of one `call()` run under TensorFlow's profiler: the
  allocator's peak in it and what was made in it and live then, by op."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as logdir:
    tf.profiler.experimental.start(logdir)
    call()
    tf.profiler.experimental.stop()
    return breakdown(memory_events(logdir), min_bytes=min_bytes)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--width', type=int, default=1728)
  parser.add_argument('--setting', default='bf16+remat+fsdp', choices=sorted(SETTINGS))
  parser.add_argument('--min_mib', type=float, default=1.0)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'peak_breakdown.json'))
  args = parser.parse_args()
  os.chdir(REPO_ROOT)
  from plugins import gin_setup, plan as plan_lib  # pylint: disable=import-outside-toplevel
  from plugins.training import build_trainer  # pylint: disable=import-outside-toplevel
  from layout_core.layout.variables import to_numpy  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  bindings = SETTINGS[args.setting] + lm_bindings(args.width, 1)
  with gin_setup.parsed_config(files=['configs/experiments/quickstart.gin'], bindings=bindings,
                               search_paths=[]):
    plan = plan_lib.make_plan()
  trainer = build_trainer(plan)
  engine = trainer.engine
  packed = engine.pack(next(plan.task.reader(
      split='eval', batch_size=plan.train.batch_size,
      rows=engine.client_rows(plan.train.batch_size))))
  to_numpy(engine.loss_and_gradients(packed)[0])  # compiles
  before = tf.config.experimental.get_memory_info('CPU:0')['current']
  result = live_at_peak(lambda: to_numpy(engine.loss_and_gradients(packed)[0]),
                        min_bytes=int(args.min_mib * 2**20))
  result = {'setting': args.setting, 'bindings': bindings, 'width': args.width,
            'parameters': plan.num_parameters, 'held_before_call_bytes': before,
            'rss_bytes': rss_bytes(os.getpid()),
            'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **result}
  print(f"{args.setting}, width {args.width} ({plan.num_parameters:,} parameters): held before "
        f"the call {before / GIB:.2f} GiB; allocator peak in the call "
        f"{result['allocator_peak_bytes'] / GIB:.2f} GiB, of which made in the call "
        f"{result['made_in_call_live_at_peak_bytes'] / GIB:.2f} GiB; peak RSS "
        f"{result['peak_rss_bytes'] / GIB:.2f} GiB")
  for row in result['by_op']:
    shapes = ', '.join(f'{n} x {t}' for t, n in sorted(row['tensors'].items(),
                                                      key=lambda kv: -kv[1])[:3])
    print(f"  {row['bytes'] / 2**20:8.1f} MiB  {row['op'][:90]}  [{shapes}]")
  write_json(result, args.out)


if __name__ == '__main__':
  main()
