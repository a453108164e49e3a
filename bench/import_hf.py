"""Benchmark: importing a Hugging Face checkpoint (`launch.import_hf`): host
memory and speed.

Writes a random Llama-shaped checkpoint in Hugging Face's format (bfloat16
safetensors, sharded with an index, as published models are; about 1.1B
parameters by default), then, each in a fresh process, side by side:

  * `read`: every tensor read one at a time with safetensors and widened to
    float32, as the import reads them, and dropped (the files' own speed);
  * `import`: `plugins.hf.import_run` of the directory into a run for 8 CPU
    devices (`data=8`, FSDP), its step-0 checkpoint streamed to disk in the
    checkpoint's bfloat16.

Each process reports its peak resident memory (`ru_maxrss`): the import's
against the checkpoint's size (the goal: at most 1.3x; the model is never
held whole), and against reading alone (what converting and writing add).

    python bench/import_hf.py [--layers 16 --out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, run_child, write_json  # noqa: E402

SHAPE = dict(vocab_size=32000, model_dim=2048, num_heads=32, num_kv_heads=8, ffn_dim=8192,
             max_len=4096, norm='rms', positions='rope', rope_theta=500000.0, ffn='swiglu',
             output_bias=False, norm_epsilon=1e-5)
BINDINGS = ["mesh.shape = {'data': 8}", 'train.fsdp = True']

_PEAK = """
import json, resource, sys
def peak_gib():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
"""

READ = _PEAK + """
import time
from layout_core.convert import hf_files
import numpy as np
start = time.perf_counter()
reader = hf_files.SafetensorsReader(sys.argv[1])
for name in reader.shapes:
  value = reader.read(name).astype(np.float32)
  del value
print('RESULT ' + json.dumps({'seconds': time.perf_counter() - start, 'peak_gib': peak_gib()}))
"""

IMPORT = _PEAK + """
import time
from plugins import hf
hf.return_freed_memory_promptly()  # as launch.import_hf does
start = time.perf_counter()
report = hf.import_run(hf_dir=sys.argv[1], model_dir=sys.argv[2], bindings=json.loads(sys.argv[3]))
print('RESULT ' + json.dumps({'seconds': time.perf_counter() - start, 'peak_gib': peak_gib(),
                              'parameters': report.num_parameters}))
"""


def write_checkpoint(directory: str, *, layers: int) -> int:
  """A random Llama-shaped Hugging Face directory; returns its bytes."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from layout_core.convert import hf as hf_lib, hf_names  # pylint: disable=import-outside-toplevel
  from layout_core.convert.hf_config import hf_config_from_lm  # pylint: disable=import-outside-toplevel
  from layout_core.convert.hf_files import nbytes, write_safetensors  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  kwargs = dict(SHAPE, num_layers=layers)
  rules = {r.hf_name: r for r in hf_names.tensor_rules(kwargs, family='llama', tied=False)}
  rng = np.random.default_rng(0)
  bf16 = hf_lib._bfloat16()  # pylint: disable=protected-access

  def tensor(name: str):
    return (rng.standard_normal(rules[name].hf_shape, dtype=np.float32) * 0.02).astype(bf16)
  os.makedirs(directory)
  write_safetensors(directory, tensor, [(n, nbytes(r.hf_shape, bf16)) for n, r in rules.items()],
                    max_shard_bytes=1 << 30)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(hf_config_from_lm(kwargs, tied=False, dtype='bfloat16'), f)
  return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
             if n.endswith('.safetensors'))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--layers', type=int, default=16, help='decoder layers (16: ~1.1B)')
  parser.add_argument('--out', default=os.path.join(RESULTS, 'import_hf.json'))
  args = parser.parse_args()
  import json  # pylint: disable=import-outside-toplevel
  scratch = tempfile.mkdtemp(prefix='meshgin-import-bench-')
  try:
    hf_dir = os.path.join(scratch, 'hf')
    size = write_checkpoint(hf_dir, layers=args.layers)
    print(f'checkpoint: {size / 2**30:.2f} GiB of bfloat16 safetensors')
    bindings = json.dumps(BINDINGS)
    read = run_child(READ, hf_dir)
    print(f'read: {read}')
    imported = run_child(IMPORT, hf_dir, os.path.join(scratch, 'run'), bindings)
    print(f'import: {imported}')
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  gib = size / 2**30
  write_json({
      'model': dict(SHAPE, num_layers=args.layers), 'bindings': BINDINGS,
      'parameters': imported['parameters'], 'checkpoint_gib': gib,
      'read': read, 'import': imported,
      'import_peak / checkpoint': imported['peak_gib'] / gib,
      'import_peak - read_peak (GiB)': imported['peak_gib'] - read['peak_gib'],
      'import_seconds / read_seconds': imported['seconds'] / read['seconds'],
  }, args.out)


if __name__ == '__main__':
  main()
