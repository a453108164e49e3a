r"""Benchmark: preference tuning (DPO) against supervised fine-tuning, side by side.

One LM (bytes, `--width` wide, 4 blocks, ffn = 4 x width) trains `--steps`
steps on the pairs of `examples.preference.write_pairs`, batch `--batch`
rows (half as many pairs), data-parallel on 8 virtual CPU devices, float32,
each setting in a fresh `launch.train` child:

    lora_sft         LoRA rank 8 on attention's q and v: the instruction task
                     on the same rows (each pair's two conversations as two
                     examples), the loss on the answers
    lora_dpo         the same adapters, DPO with the reference in each step
                     (the model with its adapters off, forward only)
    lora_dpo_pre     the same, the reference precomputed once before step 1
                     (dpo.precompute_reference = True)
    full_dpo_pre     every weight trains, the reference precomputed

Measured: each child's peak RSS (the process, TensorFlow included) and
steps/s over its last logged window (after the compile); the ratios
lora_dpo / lora_sft (the issue's goal: at most 1.15x the memory, no second
copy of the weights) and full_dpo_pre / lora_dpo_pre.

    python bench/dpo.py [--quick] [--out bench/results/dpo.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import write_json  # noqa: E402
from bench.memory import train  # noqa: E402

LORA = ['lora.rank = 8', "lora.targets = [r'.*/attn/w[qv]']"]
SETTINGS = {
    'lora_sft': ['data.task = @instruct()', 'instruct.tokenizer = "bytes"',
                 'instruct.vocab_size = 256', 'instruct.seq_len = 64', 'instruct.pack = False',
                 *LORA],
    'lora_dpo': LORA,
    'lora_dpo_pre': [*LORA, 'dpo.precompute_reference = True'],
    'full_dpo_pre': ['lora.rank = 0', 'dpo.precompute_reference = True'],
}


def write_data(directory: str) -> dict[str, str]:
  """The pairs, and the same conversations as instruction examples."""
  sys.path.insert(0, REPO_ROOT)
  from examples.preference.write_pairs import write_pairs  # pylint: disable=g-import-not-at-top
  paths = write_pairs(directory, num_train=512, num_eval=64)
  for split, path in list(paths.items()):
    chats = os.path.join(directory, f'{split}_chats.jsonl')
    with open(path) as source, open(chats, 'w') as out:
      for line in source:
        pair = json.loads(line)
        for side in ('chosen', 'rejected'):
          out.write(json.dumps({'prompt': pair['prompt'], 'response': pair[side]}) + '\n')
    paths[f'{split}_chats'] = chats
  return paths


def run(name: str, *, data: dict[str, str], width: int, batch: int, steps: int) -> dict:
  """One launch.train child (`bench.memory.train`): {peak_bytes, steps_per_sec, ok, error, ...}."""
  return train([
      f"preference.train_files = '{data['train']}'", f"preference.eval_files = '{data['eval']}'",
      f"instruct.train_files = '{data['train_chats']}'",
      f"instruct.eval_files = '{data['eval_chats']}'",
      f'transformer_lm.model_dim = {width}', f'transformer_lm.ffn_dim = {4 * width}',
      'transformer_lm.num_layers = 4', f'train.batch_size = {batch}',
      f'train.num_steps = {steps}', f'train.log_every = {max(steps // 2, 1)}',
      'train.eval_every = 0', 'train.eval_batches = 1', 'checkpoint.every_steps = 0',
      'checkpoint.save_at_end = False', *SETTINGS[name]],
      budget=64 * 2**30, gin_file='configs/experiments/dpo_tiny.gin')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true', help='smoke run: width 128, 4 steps')
  parser.add_argument('--width', type=int, default=1024)
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--out', default=os.path.join(REPO_ROOT, 'bench', 'results', 'dpo.json'))
  args = parser.parse_args()
  width, steps = (128, 4) if args.quick else (args.width, args.steps)
  data = write_data(tempfile.mkdtemp(prefix='meshgin_pairs_'))
  results = {'width': width, 'batch_rows': args.batch, 'steps': steps, 'devices': 8,
             'settings': {name: ' ; '.join(bindings) for name, bindings in SETTINGS.items()}}
  for name in SETTINGS:
    results[name] = run(name, data=data, width=width, batch=args.batch, steps=steps)
    measured = results[name]
    print(f'{name}: peak {measured["peak_bytes"] / 2**30:.2f} GiB, '
          f'{measured["steps_per_sec"]:.2f} steps/s {measured["error"]}', flush=True)
  for a, b in (('lora_dpo', 'lora_sft'), ('lora_dpo_pre', 'lora_sft'),
               ('full_dpo_pre', 'lora_dpo_pre'), ('lora_dpo_pre', 'lora_dpo')):
    results[f'peak {a} / {b}'] = results[a]['peak_bytes'] / max(results[b]['peak_bytes'], 1)
    results[f'steps/s {a} / {b}'] = (results[a]['steps_per_sec']
                                     / max(results[b]['steps_per_sec'], 1e-9))
    print(f"{a} / {b}: peak {results[f'peak {a} / {b}']:.3f}x, "
          f"steps/s {results[f'steps/s {a} / {b}']:.2f}x")
  write_json(results, args.out)


if __name__ == '__main__':
  main()
