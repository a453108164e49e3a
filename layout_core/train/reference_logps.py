"""A preference run's reference log-probabilities, computed once and kept
beside the run (`dpo.precompute_reference = True`).

    attach_reference(task, engine, model_dir='runs/dpo', batch_size=16, resumed=False)

With a precomputed reference the reference model need not run in each step
(nor exist: a run that trains every weight compares with its starting
point, which is gone after step 0). Before the first step, every pair of
the train and eval files, tokenized and cut as training reads it, goes
through the starting model (forward only, on the run's mesh and engine);
each side's summed answer log-probability is written to
`<model_dir>/reference_logps.json` with what it was computed from: each
file's name, size and SHA-256, and the task's tokenizer, template, seq_len
and too_long. The task's reader then hands each row its value as
`reference_logps`. A resumed run reads the file back and never recomputes
it (the weights have moved on): a missing file, or files or settings that
differ from those it records, is a ConfigError.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
from absl import logging

from layout_core.durable import write_atomically
from layout_core.errors import ConfigError
from layout_core.tasks.base import SPLITS

FILE = 'reference_logps.json'


def fingerprint(task) -> dict[str, Any]:
  """What the reference log-probabilities depend on besides the weights."""
  files = []
  for split in SPLITS:
    for path in task.split_files(split):
      digest = hashlib.sha256()
      with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
          digest.update(chunk)
      files.append([split, path, os.path.getsize(path), digest.hexdigest()])
  return {'files': files, 'tokenizer': task.tokenizer.describe(),
          'template': task.template.describe(), 'seq_len': task.seq_len,
          'too_long': task.too_long}


def compute(task, engine, *, batch_size: int) -> dict[str, dict[str, list[float]]]:
  """{split: {'path:line': [chosen, rejected]}}: every kept pair through the
  engine's model, `batch_size` rows (batch_size / 2 pairs) at a time."""
  found: dict[str, dict[str, list[float]]] = {}
  per_batch = batch_size // 2
  for split in SPLITS:
    keys, rows = [], []
    found[split] = {}

    def flush():
      padded = rows + [rows[-1]] * (per_batch - len(rows))  # the last batch, filled up
      batch = {name: np.concatenate([r[name] for r in padded]) for name in padded[0]}
      logps = engine.reference_features(batch)['reference_logps']
      for i, key in enumerate(keys):
        found[split][key] = [float(logps[2 * i]), float(logps[2 * i + 1])]
      keys.clear()
      rows.clear()

    for key, pair_rows in task.encoded_pairs(split):
      keys.append(key)
      rows.append(pair_rows)
      if len(rows) == per_batch:
        flush()
    if rows:
      flush()
    logging.info('Reference log-probabilities of %d %s pairs computed', len(found[split]),
                 split)
  return found


def attach_reference(task, engine, *, model_dir: str, batch_size: int, resumed: bool,
                     chief: bool = True) -> None:
  """Reads the run's reference log-probabilities, or computes and writes them
  (module doc), and gives them to `task`. `resumed`: the weights are a
  checkpoint's, no longer the reference."""
  path = os.path.join(model_dir, FILE)
  expected = fingerprint(task)
  if os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      try:
        stored = json.load(f)
      except ValueError as e:
        raise ConfigError(f'{path} is not JSON ({e})', where=path,
                          fix='restore it from a backup, or train in a new model_dir') from None
    if stored.get('fingerprint') != expected:
      changed = sorted(k for k in expected if stored.get('fingerprint', {}).get(k) != expected[k])
      raise ConfigError(
          f'the reference log-probabilities in {path} were computed from other data or '
          f'settings ({", ".join(changed)} changed), so they are not this data\'s reference',
          where=f'{task.settings_name}.train_files / eval_files',
          fix='train on the data the run started with, or start a new model_dir')
    task.attach_references(stored['pairs'])
    logging.info('Reference log-probabilities read from %s', path)
    return
  if resumed:
    raise ConfigError(f'this run resumes from a checkpoint but {path} is missing: the '
                      'reference log-probabilities were computed from the starting weights, '
                      'which the checkpoint no longer holds', where=path,
                      fix='restore the file, or start the run again in a new model_dir')
  pairs = compute(task, engine, batch_size=batch_size)
  if chief:
    write_atomically(path, json.dumps({'fingerprint': expected, 'pairs': pairs}).encode())
  task.attach_references(pairs)
