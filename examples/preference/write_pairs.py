r"""Writes a small preference set: pairs whose chosen answer follows a rule
the rejected one breaks.

  python -m examples.preference.write_pairs --out_dir=/tmp/meshgin/preference
  python -m launch.train --gin_file=configs/experiments/dpo_tiny.gin \
      --model_dir=runs/dpo_tiny

Each line is {"prompt": "Say 'Quiet' softly.", "chosen": "quiet", "rejected": "QUIET"}:
the chosen answer is the prompt's word in lower case, the rejected one in
upper case. A model learns to prefer the chosen answers, and the held-out
pairs' words are not in the training pairs, so their margin grows only if
it learns the rule. Files: train.jsonl and eval.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

LETTERS = 'abcdefghijklmnopqrstuvwxyz'


def rule_pairs(count: int, *, seed: int, exclude: frozenset = frozenset()) -> list[dict]:
  """`count` pairs of distinct random 3-6 letter words (none of `exclude`)."""
  rng = np.random.default_rng(seed)
  pairs, seen = [], set(exclude)
  while len(pairs) < count:
    word = ''.join(rng.choice(list(LETTERS), int(rng.integers(3, 7))))
    if word in seen:
      continue
    seen.add(word)
    pairs.append({'prompt': f"Say '{word.capitalize()}' softly.", 'chosen': word,
                  'rejected': word.upper()})
  return pairs


def write_pairs(out_dir: str, *, num_train: int = 512, num_eval: int = 64,
                seed: int = 0) -> dict[str, str]:
  """Writes train.jsonl and eval.jsonl (held-out words); returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  evaluation = rule_pairs(num_eval, seed=seed + 1)
  train = rule_pairs(num_train, seed=seed,
                     exclude=frozenset(p['chosen'] for p in evaluation))
  paths = {}
  for split, pairs in (('train', train), ('eval', evaluation)):
    paths[split] = os.path.join(out_dir, f'{split}.jsonl')
    with open(paths[split], 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(pair) + '\n' for pair in pairs)
  return paths


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out_dir', default='/tmp/meshgin/preference')
  parser.add_argument('--num_train', type=int, default=512)
  parser.add_argument('--num_eval', type=int, default=64)
  args = parser.parse_args()
  for split, path in write_pairs(args.out_dir, num_train=args.num_train,
                                 num_eval=args.num_eval).items():
    print(f'{split}: {path}')


if __name__ == '__main__':
  main()
