"""Benchmark: the frozen base's bytes per device and the process peak, for
each `train.frozen_dtype`, on two meshes of 8 CPU devices.

bench/memory.py's LM (the quickstart's Markov task, 2 blocks, ffn = 4 x
width, batch 32 x 64 tokens) at `--width`, LoRA of rank 8 on attention's q
and v, 3 steps in a fresh `launch.train` child per setting, on

    data=8 + FSDP   `mesh.shape = {'data': 8}`, `train.fsdp = True`
    2x4 Megatron    `mesh.shape = {'data': 2, 'model': 4}`, configs/layouts/megatron.gin

Per mesh and dtype: the frozen weights' bytes per device as the layout
records count them (what `launch.inspect` prints; tests/test_frozen_dtype.py
checks them against each device's own components) and each child's peak
resident memory; the ratios of both to float32's.

    python bench/frozen_memory.py [--width 1536] [--out bench/results/frozen_memory.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import RESULTS, write_json  # noqa: E402
from bench.memory import WHOLE_STATE, lm_bindings, train  # noqa: E402

DTYPES = ('float32', 'bfloat16', 'int8')
LORA = ['lora.rank = 8', "lora.targets = [r'.*/attn/w[qv]']"]
MESHES = {
    'data=8 + FSDP': (('configs/experiments/quickstart.gin',),
                      ["mesh.shape = {'data': 8}", 'train.fsdp = True']),
    '2x4 Megatron': (('configs/experiments/quickstart.gin', 'configs/layouts/megatron.gin'),
                     ["mesh.shape = {'data': 2, 'model': 4}"]),
}


def frozen_bytes(files, bindings) -> int:
  """The frozen variables' bytes on the fullest device, from the plan's layout records."""
  from layout_core.layout import scope  # pylint: disable=import-outside-toplevel
  from plugins import gin_setup, plan as plan_lib  # pylint: disable=import-outside-toplevel
  with gin_setup.parsed_config(files=list(files), bindings=bindings, search_paths=[]):
    records = plan_lib.make_plan().records
  return scope.bytes_per_device([r for r in records if not r.trainable])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--width', type=int, default=1536)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'frozen_memory.json'))
  args = parser.parse_args()
  results = {'width': args.width, 'steps': args.steps, 'meshes': {}}
  for mesh, (files, mesh_bindings) in MESHES.items():
    with tempfile.NamedTemporaryFile('w', suffix='.gin', dir=REPO_ROOT, delete=False) as gin:
      gin.write(''.join(f"include '{f}'\n" for f in files))
    try:
      rows = {}
      for dtype in DTYPES:
        bindings = (WHOLE_STATE + LORA + mesh_bindings + [f"train.frozen_dtype = '{dtype}'"]
                    + lm_bindings(args.width, args.steps))
        run = train(bindings, budget=2**62, gin_file=os.path.relpath(gin.name, REPO_ROOT))
        rows[dtype] = {'frozen_bytes_per_device': frozen_bytes(files, bindings),
                       'peak_bytes': run['peak_bytes'], 'ok': run['ok'], 'error': run['error']}
        print(f"{mesh}, {dtype} base: frozen {rows[dtype]['frozen_bytes_per_device'] / 2**20:.1f}"
              f" MiB per device, peak {run['peak_bytes'] / 2**30:.2f} GiB", flush=True)
    finally:
      os.unlink(gin.name)
    for dtype in DTYPES[1:]:
      rows[dtype]['frozen / float32'] = (rows[dtype]['frozen_bytes_per_device']
                                         / rows['float32']['frozen_bytes_per_device'])
      rows[dtype]['peak / float32'] = rows[dtype]['peak_bytes'] / rows['float32']['peak_bytes']
      rows[dtype]['peak saved / frozen saved'] = (
          (rows['float32']['peak_bytes'] - rows[dtype]['peak_bytes'])
          / (8 * (rows['float32']['frozen_bytes_per_device']
                  - rows[dtype]['frozen_bytes_per_device'])))
    results['meshes'][mesh] = rows
  write_json(results, args.out)


if __name__ == '__main__':
  main()
