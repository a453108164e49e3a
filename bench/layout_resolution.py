"""Benchmark: resolve 100,000 variable paths against 500 layout rules.

meshgin's resolver (`LayoutRules.match_many`) against the seed's approach, a
per-rule `re.fullmatch` loop in declared order (patterns precompiled, which
only helps the baseline), measured side by side in one run on the same paths
and rules, with every answer compared.

    python bench/layout_resolution.py [--paths 100000 --rules 500 --out FILE]

Rule set: 90% "digit-blind" rules of the usual shape (`.*/attn_<word>/w_in`,
`model/tower_<word>/.*`), 10% digit-specific rules (`.*/layer_00[0-4]\\d/...`,
`\\d`, character ranges) that take the slower path. Roughly a third of the
paths match no rule at all (the worst case for both: every rule is tried).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_json  # noqa: E402

from layout_core.layout.rules import LayoutRules, naive_first_match  # noqa: E402

WORDS = ['alpha', 'bravo', 'charlie', 'delta', 'echo', 'foxtrot', 'golf', 'hotel',
         'india', 'juliet', 'kilo', 'lima', 'mike', 'november', 'oscar', 'papa',
         'quebec', 'romeo', 'sierra', 'tango', 'uniform', 'victor', 'whiskey', 'xray']
VARIABLES = ['w_in', 'w_out', 'b_in', 'b_out', 'scale', 'bias', 'wq', 'wk', 'wv', 'wo']


def make_paths(count: int, rng: random.Random) -> list[str]:
  paths = []
  layer = 0
  while len(paths) < count:
    tower = WORDS[layer % 6]
    for module in rng.sample(WORDS, 4):
      for variable in rng.sample(VARIABLES, 5):
        paths.append(f'model/tower_{tower}/layer_{layer:04d}/{module}_{rng.choice(WORDS)}/{variable}')
    layer += 1
  return paths[:count]


def make_rules(count: int, rng: random.Random) -> list[tuple[str, tuple[str, ...]]]:
  rules = []
  for index in range(count):
    if index % 10 == 9:
      pattern = rng.choice([
          rf'model/tower_{rng.choice(WORDS)}/layer_00[0-{rng.randint(1, 9)}]\d/.*',
          rf'.*/layer_\d+{rng.randint(0, 9)}/{rng.choice(WORDS)}_.*/w_in',
          rf'.*/layer_{rng.randint(0, 2)}\d\d\d/.*/{rng.choice(VARIABLES)}',
      ])
    else:
      pattern = rng.choice([
          rf'.*/{rng.choice(WORDS)}_{rng.choice(WORDS)}/{rng.choice(VARIABLES)}',
          rf'model/tower_{rng.choice(WORDS)}/.*/{rng.choice(WORDS)}_.*/w_.*',
          rf'.*/{rng.choice(WORDS)}_{rng.choice(WORDS)}/(wq|wk|wv)',
          rf'model/tower_{rng.choice(WORDS[6:])}/.*',
      ])
    rules.append((pattern, ('unsharded',)))
  return rules


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--paths', type=int, default=100_000)
  parser.add_argument('--rules', type=int, default=500)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                    'layout_resolution.json'))
  args = parser.parse_args()
  rng = random.Random(args.seed)
  paths, rules = make_paths(args.paths, rng), make_rules(args.rules, rng)

  start = time.perf_counter()
  resolver = LayoutRules(rules)
  fast = resolver.match_many(paths)
  fast_seconds = time.perf_counter() - start

  start = time.perf_counter()
  compiled = [re.compile(pattern) for pattern, _ in rules]
  naive = [naive_first_match(compiled, p) for p in paths]
  naive_seconds = time.perf_counter() - start

  mismatches = sum(a != b for a, b in zip(fast, naive))
  matched = sum(a is not None for a in fast)
  result = {
      'paths': len(paths), 'rules': len(rules), 'matched_paths': matched,
      'meshgin_seconds': round(fast_seconds, 4), 'naive_seconds': round(naive_seconds, 4),
      'speedup': round(naive_seconds / fast_seconds, 1), 'mismatches': mismatches,
      'target': '< 2 s and >= 10x faster, same answers',
      'target_met': fast_seconds < 2 and naive_seconds / fast_seconds >= 10 and not mismatches,
  }
  print(f'{len(paths):,} paths x {len(rules)} rules ({matched:,} matched a rule)')
  print(f'  meshgin resolver : {fast_seconds:8.3f} s')
  print(f'  naive fullmatch  : {naive_seconds:8.3f} s')
  print(f'  speedup          : {result["speedup"]:8.1f}x   answers differ: {mismatches}')
  write_json(result, args.out)
  if mismatches:
    sys.exit(1)


if __name__ == '__main__':
  main()
