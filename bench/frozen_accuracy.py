"""Benchmark: what a frozen base stored in bfloat16 or int8 costs in accuracy
(`train.frozen_dtype`).

  1. Logits. A random Llama-shaped bfloat16 Hugging Face checkpoint
     (bench/import_hf.py's: `--layers` 16, about 1.1B parameters; and a
     2-layer one) is imported in float32, then read as a LoRA run's base
     (the adapters start at zero: the base's function) with each frozen
     dtype, each in a fresh process on one CPU device: max |logits - the
     float32 base's| / max |the float32 base's logits| over 2 x 64 tokens.
     Random weights: a trained model's may round otherwise.
  2. Fine-tuning. The quickstart LM (configs/experiments/quickstart.gin)
     trained `--base_steps` steps on 8 CPU devices is the base; LoRA (rank
     8 on attention's q and v, learning rate 1e-2) trains `--lora_steps`
     from it with each frozen dtype, side by side: each eval loss against
     float32's, and each run's steps/s.

    python bench/frozen_accuracy.py [--layers 16] [--out bench/results/frozen_accuracy.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import RESULTS, read_tensors, run_child, write_json  # noqa: E402
from bench.import_hf import write_checkpoint  # noqa: E402

DTYPES = ('float32', 'bfloat16', 'int8')
LORA = ['lora.rank = 8', "lora.targets = [r'.*/attn/w[qv]']"]

LOGITS = """
import json, sys
import numpy as np
from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer
from layout_core.infer import decode
from layout_core.model import frozen
from layout_core.model.lora import is_adapter
from plugins import gin_setup, inference
from plugins.plan import make_plan
from plugins.training import build_trainer
run, dtype, out = sys.argv[1:4]
with gin_setup.parsed_config(files=[inference.run_config(model_dir=run)],
                             bindings=json.loads(sys.argv[4]) + [f"train.frozen_dtype = '{dtype}'"]):
  plan = make_plan(data_splits=())
trainer = build_trainer(plan)
variables = trainer.engine.variables
Checkpointer(directory=out + '.unused', state=trainer.state(), config=CheckpointConfig()).init_from(
    run, variables, new=[p for p in variables if is_adapter(p) or frozen.is_scale(p)])
tokens = np.random.default_rng(0).integers(3, 32000, size=(2, 64)).astype(np.int32)
np.save(out, decode.CachedLM(plan.params, variables, batch_axis='data').logits(tokens).numpy())
print('RESULT {}')
"""

IMPORT = """
import sys
from plugins import hf
hf.import_run(hf_dir=sys.argv[1], model_dir=sys.argv[2], weights_dtype='float32',
              bindings=["mesh.shape = {'data': 1}"])
print('RESULT {}')
"""


def logit_errors(scratch: str, layers: int) -> dict[str, float]:
  import numpy as np  # pylint: disable=import-outside-toplevel
  hf_dir, run = os.path.join(scratch, f'hf{layers}'), os.path.join(scratch, f'run{layers}')
  write_checkpoint(hf_dir, layers=layers)
  run_child(IMPORT, hf_dir, run)
  shutil.rmtree(hf_dir)
  logits = {}
  for dtype in DTYPES:
    out = os.path.join(scratch, f'logits{layers}-{dtype}.npy')
    run_child(LOGITS, run, dtype, out, '["lora.rank = 4", "lora.targets = [r\'.*/attn/wq\']"]')
    logits[dtype] = np.load(out)
  shutil.rmtree(run)
  reference = logits['float32']
  errors = {dtype: float(np.abs(logits[dtype] - reference).max() / np.abs(reference).max())
            for dtype in DTYPES[1:]}
  print(f'{layers} layers: relative logit error {errors}', flush=True)
  return errors


def train(model_dir: str, *bindings: str) -> None:
  command = [sys.executable, '-m', 'launch.train',
             '--gin_file=configs/experiments/quickstart.gin', f'--model_dir={model_dir}',
             *(f'--gin_bindings={b}' for b in bindings)]
  subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True,
                 env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))


def fine_tunes(scratch: str, *, base_steps: int, lora_steps: int) -> dict:
  base = os.path.join(scratch, 'base')
  train(base, f'train.num_steps = {base_steps}', 'train.eval_every = 0')
  runs = {}
  for dtype in DTYPES:
    directory = os.path.join(scratch, f'lora-{dtype}')
    train(directory, *LORA, f"train.frozen_dtype = '{dtype}'",
          f"checkpoint.init_from = '{base}'", f'train.num_steps = {lora_steps}',
          f'train.eval_every = {lora_steps // 4}', 'train.log_every = 10',
          'optimizer.learning_rate = 0.01',
          'optimizer.warmup_steps = 0')
    tensors = read_tensors(directory)
    evals = tensors.get('eval/loss') or read_tensors(os.path.join(directory, 'eval'))['eval/loss']
    rate = [float(v) for _, v in read_tensors(directory)['train/steps_per_sec']]
    runs[dtype] = {'eval_loss': [(int(s), float(v)) for s, v in evals],
                   'steps_per_sec': sum(rate[1:]) / max(len(rate) - 1, 1)}
    print(f'LoRA on a {dtype} base: eval losses {runs[dtype]["eval_loss"]}, '
          f'{runs[dtype]["steps_per_sec"]:.2f} steps/s', flush=True)
  reference = dict(runs['float32']['eval_loss'])
  for dtype in DTYPES[1:]:
    losses = dict(runs[dtype]['eval_loss'])
    runs[dtype]['max_relative_eval_difference'] = max(
        abs(losses[s] - reference[s]) / reference[s] for s in reference)
    runs[dtype]['steps_per_sec / float32'] = (runs[dtype]['steps_per_sec']
                                              / runs['float32']['steps_per_sec'])
  return runs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--layers', type=int, default=16, help='the large model (16: ~1.1B)')
  parser.add_argument('--base_steps', type=int, default=40)
  parser.add_argument('--lora_steps', type=int, default=60)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'frozen_accuracy.json'))
  args = parser.parse_args()
  scratch = tempfile.mkdtemp(prefix='meshgin-frozen-accuracy-')
  try:
    logits = {str(layers): logit_errors(scratch, layers) for layers in (2, args.layers)}
    tuned = fine_tunes(scratch, base_steps=args.base_steps, lora_steps=args.lora_steps)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  write_json({'logit_errors_by_layers': logits, 'lora': tuned, 'base_steps': args.base_steps,
              'lora_steps': args.lora_steps}, args.out)


if __name__ == '__main__':
  main()
