"""The composition matrix: which features run together, and against what reference.

Each feature of the trainer is tested on its own elsewhere; this crosses
them. `FACTORS` lists the features and their settings, `REFUSED` the pairs
the planner refuses before training (a ConfigError naming both), and
`all_pairs()` a small set of runs (cells) in which every allowed pair of
settings of two features appears at least once (an all-pairs design, not
the full product). A cell is compared with its `reference()`: the same run
with every feature that must not change the function it trains switched off
(remat none, no FSDP, no accumulation, unsharded optimizer state, the
one-program engine). `tolerance()` says how close they must be, relative to
the values' scale (`tests.numerics.assert_close`):

  * 'exact' (1e-6): only the recomputation differs;
  * 'order' (1e-5): the same math summed in another order (FSDP's collectives,
    micro-steps, pipelines' micro-batches, another mesh);
  * 'bf16' (3e-2): the above in bfloat16, whose rounding amplifies it.

`tests/test_composition.py` runs the cells; `python -m tests.composition`
prints the table of docs/composition.md, which a test checks is up to date.
Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import itertools
import sys

FACTORS = {  # feature -> its settings, the reference's first
    'engine': ('plain', 'spmd', 'gpipe', 'keras'),
    'remat': ('none', 'block', 'full'),
    'packed': (False, True),
    'fsdp': (False, True),
    'dtype': ('float32', 'bfloat16'),
    'accum': (1, 2),
    'shard_state': (False, True),
    'optimizer': ('adam', 'adafactor'),
    'arch': ('classic', 'llama'),   # transformer_lm's defaults, or its Llama-family options
    'lora': (False, True),          # a frozen base with LoRA adapters (`LORA`)
    'tied': (False, True),          # transformer_lm.tie_embeddings: the softmax reads the table
    'frozen': ('float32', 'bfloat16', 'int8'),  # train.frozen_dtype: the LoRA base's storage
    'moe': (False, True),           # transformer_lm.moe: routed feed-forward layers (`MOE`)
}
# Settings that change what is trained (kept in the reference) ...
KEPT = ('packed', 'dtype', 'optimizer', 'arch', 'lora', 'tied', 'frozen', 'moe')
# ... and those that must not (the reference switches them off).
TRANSPARENT = ('remat', 'fsdp', 'accum', 'shard_state')
# Relative to the values' scale (tests/numerics.py). measured (default / no oneDNN / 1 thread,
# the same under each): 'exact' 0; 'order' 9.6e-08 in process (one-program cells on 2x2,
# pipelines on 2x2x2), the two-client runs up to 9.1e-05 with 'bf16' among them; 'bf16'
# 8.5e-04 for losses, 7.8e-03 for gradient norms (2026-11-29).
TOLERANCES = {'exact': 1e-6, 'order': 1e-5, 'bf16': 3e-2}

# (feature, setting, feature, setting) -> the words both errors must name.
REFUSED = {
    ('engine', 'spmd', 'packed', True): ('lm_corpus.pack', 'pipeline'),
    ('engine', 'gpipe', 'packed', True): ('lm_corpus.pack', 'pipeline'),
    ('engine', 'keras', 'packed', True): ('lm_corpus.pack', 'Keras'),
    ('engine', 'keras', 'fsdp', True): ('train.fsdp', 'Keras'),
    ('engine', 'keras', 'lora', True): ('lora', 'Keras'),
    ('engine', 'gpipe', 'tied', True): ('tie_embeddings', 'pipeline.engine'),
    ('engine', 'keras', 'frozen', 'bfloat16'): ('frozen_dtype', 'Keras'),
    ('engine', 'keras', 'frozen', 'int8'): ('frozen_dtype', 'Keras'),
    ('engine', 'spmd', 'moe', True): ('pipeline.engine', 'moe'),
}
# The routed layers of 'moe' (moe_feed_forward's settings): 4 experts, 2 per
# token, no token dropped, in every second block (the first keeps its dense
# feed-forward layer), split over the 'data' axis
# in process (GShard's expert parallelism: the batch's own axis). The load-balancing loss is off:
# it is each micro-step's own, so accumulation would change it
# (tests/test_moe.py shows both); the z-loss, a mean over tokens, is on.
MOE = dict(num_experts=4, experts_per_token=2, aux_loss_coef=0.0, z_loss_coef=1e-3)
MOE_RULE = (r'.*/moe/w_.*', ('data', 'unsharded', 'unsharded'))
# The adapters of 'lora': attention's queries and values and every
# feed-forward matrix, with dropout on their inputs.
LORA = dict(rank=4, alpha=8.0, dropout=0.1, targets=(r'.*/attn/w[qv]', r'.*/ffn/w_.*'))
# ... and with 'moe', every expert matrix too (one adapter pair per expert).
MOE_LORA_TARGET = r'.*/moe/w_.*'


def lora_settings(cell: Cell, dense_blocks: bool = True) -> dict:
  """`LORA`, with the experts' matrices among the targets in a 'moe' cell
  (and without the dense feed-forward layers' where no block keeps one)."""
  targets = LORA['targets'] if dense_blocks else LORA['targets'][:1]
  return {**LORA, 'targets': targets + ((MOE_LORA_TARGET,) if cell['moe'] else ())}

# Pairs that mean nothing together: a Keras model has no transformer_lm options.
# A narrow frozen dtype needs frozen weights (without LoRA it is an error of its own).
NOT_APPLICABLE = {('engine', 'keras', 'arch', 'llama'), ('engine', 'keras', 'tied', True),
                  ('engine', 'keras', 'moe', True),
                  ('lora', False, 'frozen', 'bfloat16'), ('lora', False, 'frozen', 'int8')}

Cell = dict  # feature -> setting


def refused_pair(cell: Cell, pairs=REFUSED) -> tuple | None:
  """The first refused pair (of `pairs`) `cell` holds, or None."""
  for pair in pairs:
    a, x, b, y = pair
    if cell.get(a) == x and cell.get(b) == y:
      return pair
  return None


def _excluded(cell: Cell) -> bool:
  return (refused_pair(cell) or refused_pair(cell, NOT_APPLICABLE)) is not None


def _pairs_of(cell: Cell) -> set[tuple]:
  names = [n for n in FACTORS if n in cell]
  return {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(names, 2)}


def all_pairs() -> list[Cell]:
  """Cells covering every allowed pair of settings (greedy, deterministic).

  Each new cell starts from the pair not yet covered that comes first, and
  fills the other features with the setting that covers the most uncovered
  pairs; settings that would make a refused pair are never chosen."""
  names = list(FACTORS)
  wanted = {(a, x, b, y) for a, b in itertools.combinations(names, 2)
            for x in FACTORS[a] for y in FACTORS[b]}
  wanted = {p for p in wanted if not _excluded({p[0]: p[1], p[2]: p[3]})}
  cells: list[Cell] = []
  while wanted:
    a, x, b, y = min(wanted, key=lambda p: (names.index(p[0]), names.index(p[2]),
                                            FACTORS[p[0]].index(p[1]),
                                            FACTORS[p[2]].index(p[3])))
    cell = {a: x, b: y}
    for name in names:
      if name in cell:
        continue
      options = [v for v in FACTORS[name] if not _excluded({**cell, name: v})]
      cell[name] = max(options, key=lambda v: (
          len(_pairs_of({**cell, name: v}) & wanted), -FACTORS[name].index(v)))
    cells.append({n: cell[n] for n in names})
    wanted -= _pairs_of(cell)
  return cells


def reference(cell: Cell) -> Cell:
  """`cell` with every transparent feature off and the one-program engine
  (a Keras model stays a Keras model)."""
  ref = dict(cell)
  for name in TRANSPARENT:
    ref[name] = FACTORS[name][0]
  if ref['engine'] in ('spmd', 'gpipe'):
    ref['engine'] = 'plain'
  return ref


def tolerance(cell: Cell) -> str:
  if cell == reference(cell):
    return 'exact'
  differs = {n for n in FACTORS if cell[n] != reference(cell)[n]}
  if differs == {'remat'}:
    return 'bf16' if cell['dtype'] == 'bfloat16' else 'exact'
  return 'bf16' if cell['dtype'] == 'bfloat16' else 'order'


def name(cell: Cell) -> str:
  parts = [cell['engine']]
  for feature in FACTORS:
    setting = cell[feature]
    if feature == 'engine' or setting == FACTORS[feature][0]:
      continue
    parts.append(feature if setting is True else f'{feature}={setting}')
  return '+'.join(parts)


# Runs on 2 clients x 4 devices (launch.local_cluster), each against one
# process of 8 devices running its reference (test_composition.py) ...
TWO_CLIENT_CELLS = [
    {'engine': 'plain', 'remat': 'block', 'packed': False, 'fsdp': False, 'dtype': 'float32',
     'accum': 2, 'shard_state': True, 'optimizer': 'adafactor', 'arch': 'llama', 'lora': True,
     'tied': True, 'frozen': 'int8', 'moe': True},
    {'engine': 'keras', 'remat': 'full', 'packed': False, 'fsdp': False, 'dtype': 'bfloat16',
     'accum': 2, 'shard_state': False, 'optimizer': 'adam', 'arch': 'classic', 'lora': False,
     'tied': False, 'frozen': 'float32', 'moe': False},
]
# ... and the settings other multi-client tests run against one process.
TWO_CLIENTS = {
    ('engine', 'plain'): 'test_multi_client.py',
    ('engine', 'spmd'): 'test_pipeline_clients.py',
    ('engine', 'gpipe'): 'test_pipeline_clients.py',
    ('fsdp', True): 'test_multi_client.py',
    ('dtype', 'bfloat16'): 'test_multi_client.py',
}
GIN = {'remat': 'train.remat', 'fsdp': 'train.fsdp', 'dtype': 'train.compute_dtype',
       'accum': 'train.grad_accum_steps', 'shard_state': 'optimizer.shard_state',
       'optimizer': 'optimizer.name', 'frozen': 'train.frozen_dtype'}


def gin_bindings(cell: Cell) -> list[str]:
  """`cell`'s settings as launch.train's --gin_bindings (engine and packed
  come from the config file)."""
  # The 2-client LM has one block: routed when the cell has 'moe'.
  lora = [f'--gin_bindings=lora.{key} = {value!r}'
          for key, value in lora_settings(cell, dense_blocks=not cell['moe']).items()]
  return [f'--gin_bindings={GIN[f]} = {cell[f]!r}' for f in GIN] + (
      lora if cell['lora'] else []) + (
      ['--gin_bindings=transformer_lm.tie_embeddings = True'] if cell['tied'] else []) + (
      ['--gin_bindings=transformer_lm.moe = @moe_feed_forward()',
       '--gin_bindings=transformer_lm.moe_every = 1'] + [
          f'--gin_bindings=moe_feed_forward.{key} = {value!r}' for key, value in MOE.items()]
      if cell['moe'] else [])


def _label(feature: str, setting) -> str:
  if feature == 'engine':
    return setting
  return feature if setting is True else f'{feature}={setting}'


def table() -> str:
  """docs/composition.md's tables, from the lists above: every pair of
  settings (other than the references') and how it is tested, then the runs."""
  settings = [(f, v) for f, values in FACTORS.items() for v in values
              if v != values[0] or f == 'engine']
  cells = all_pairs()
  index = {id(c): i + 1 for i, c in enumerate(cells)}
  lines = ['| | ' + ' | '.join(f'`{_label(*s)}`' for s in settings) + ' | 2 clients |',
           '|---|' + '---|' * (len(settings) + 1)]
  for a, x in settings:
    row = []
    for b, y in settings:
      if a == b:
        row.append('')
        continue
      pair = {a: x, b: y}
      if refused_pair(pair):
        row.append('exit 2')
        continue
      if refused_pair(pair, NOT_APPLICABLE):
        row.append('n/a')
        continue
      first = next((c for c in cells if all(c[k] == v for k, v in pair.items())), None)
      row.append(f'{index[id(first)]}' if first else '')
    tests = {TWO_CLIENTS.get((a, x), '')} | {
        'test_composition.py' for c in TWO_CLIENT_CELLS if c[a] == x}
    clients = ', '.join(sorted(tests - {''}))
    lines.append(f'| `{_label(a, x)}` | ' + ' | '.join(row) + f' | {clients} |')
  runs = ['| run | settings | reference | tolerance |', '|---|---|---|---|']
  for i, cell in enumerate(cells, 1):
    ref = reference(cell)
    runs.append(f'| {i} | `{name(cell)}` | `{name(ref) if ref != cell else "itself"}` | '
                f'{tolerance(cell)} ({TOLERANCES[tolerance(cell)]:g}) |')
  refused = ['| settings | refused with |', '|---|---|']
  for (a, x, b, y), words in REFUSED.items():
    refused.append(f'| `{_label(a, x)}` and `{_label(b, y)}` | exit 2, naming '
                   f'{" and ".join(words)} |')
  return '\n'.join(lines + ['', '## The runs', ''] + runs + ['', '## Refused pairs', '']
                   + refused) + '\n'


if __name__ == '__main__':
  sys.stdout.write(table())
