"""Matching a checkpoint's keys to a model's variables: by key, to resume, and
by name through a path mapping, to start a new run from another checkpoint.

    check_fits(prefix, entries, roots=('model/', 'optimizer/'))  # ConfigError if not
    entries, saved_bytes = entries_by_name(prefix, variables,
                                           rename_rules=[(r'lm/(.*)', r'old_lm/\1')])
    shard_io.read_entries(prefix, entries)

A mismatch is a ConfigError that lists every variable concerned (first few of
each kind, then a count) and changes nothing on disk.
"""

from __future__ import annotations

import re
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from layout_core.checkpoint.damage import saved_variables
from layout_core.checkpoint.shard_io import VALUE_SUFFIX, CheckpointEntry
from layout_core.errors import ConfigError
from layout_core.lazy import tf


def _listing(items: Sequence[str], *, shown: int = 4) -> str:
  more = f'; ... {len(items) - shown} more' if len(items) > shown else ''
  return '; '.join(items[:shown]) + more


def check_fits(prefix: str, entries: Sequence[CheckpointEntry], *,
               roots: Sequence[str], unread: Callable[[str], bool] | None = None,
               saved: Mapping[str, Sequence[int]] | None = None) -> None:
  """ConfigError listing every variable whose key or shape differs between
  the checkpoint at `prefix` and `entries`; keys under other `roots` than the
  model's (e.g. a data iterator's) are not the model's business, nor those
  `unread(key)` says the caller reads otherwise (merged LoRA adapters).
  `saved` (key -> shape): what it holds, when not only its own index says
  (`frozen_base.CheckpointView.shapes`). CheckpointDamage when the
  checkpoint's index cannot be read."""
  saved = saved_variables(prefix) if saved is None else saved
  expected = {e.key: list(e.shape) for e in entries}
  missing, reshaped = [], []
  for key, shape in expected.items():
    if key not in saved:
      missing.append(key)
    elif list(saved[key]) != shape:
      reshaped.append(f'{key}: checkpoint shape {list(saved[key])}, model shape {shape}')
  extra = [k for k in saved if k.startswith(tuple(roots)) and k.endswith(VALUE_SUFFIX)
           and k not in expected and not (unread and unread(k))]
  if missing or reshaped or extra:
    fine_tuning = missing and all('_lora_' in key for key in missing)  # LoRA added to a run
    raise ConfigError(
        f'the checkpoint {prefix} does not match this model: {len(reshaped)} '
        f'variable(s) with other shapes [{_listing(reshaped)}], {len(missing)} missing '
        f'from the checkpoint [{_listing(missing)}], {len(extra)} only in the '
        f'checkpoint [{_listing(extra)}]', where='model_dir',
        fix=(f"fine-tune in a new --model_dir with checkpoint.init_from = '{prefix}' "
             '(the adapters start fresh there; this checkpoint was left untouched)'
             if fine_tuning else 'use a new --model_dir for a different model (the '
             'existing checkpoint was left untouched)'))


def names_in(prefix: str, shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, str]:
  """name -> key of every tensor in the checkpoint at `prefix` (or of
  `shapes`' keys): a key less its `/.ATTRIBUTES/VARIABLE_VALUE`
  (`model/lm/emb/table`), or a TF1 name."""
  if shapes is None:
    shapes = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
  return {k[:-len(VALUE_SUFFIX)] if k.endswith(VALUE_SUFFIX) else k: k for k in shapes}


def key_for_name(name: str, by_name: Mapping[str, str]) -> str | None:
  """The key holding the variable `name` (a path such as `lm/emb/table`, or
  a TF1 name) among `by_name` (`names_in`): the name itself, else the model
  root's key for it (`model/` + the path below its root); None if neither."""
  return by_name.get(name) or by_name.get('model/' + name.split('/', 1)[-1])


def entries_by_name(prefix: str, variables: Mapping[str, tf.Variable], *,
                    rename_rules: Sequence[Sequence[str]],
                    new: Collection[str] = (),
                    shapes: Mapping[str, Sequence[int]] | None = None,
                    ) -> tuple[list[CheckpointEntry], int]:
  """(an entry per variable, the checkpoint's size in float32 bytes) for
  reading `variables` (path -> variable) by name from the checkpoint at `prefix`.

  The name looked for is the path, or the expansion of the first
  (regex, replacement) rule that fullmatches it. Works for object-graph
  checkpoints (meshgin's, keyed 'model/...') and name-based TF1 checkpoints
  (tf.compat.v1.train.Saver, keyed by variable name). ConfigError naming
  every variable not found or of another shape, but for the paths in `new`
  (a fine-tuning run's LoRA adapters), which keep their initial values when
  the checkpoint does not hold them. `shapes` (key -> shape): the tensors
  to look among, when not only the checkpoint's own index says."""
  if shapes is None:
    shapes = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
  by_name = names_in(prefix, shapes)
  rules = [(re.compile(pattern), replacement) for pattern, replacement in rename_rules]
  missing, wrong_shape, found = [], [], []
  for path, variable in variables.items():
    name = path
    for pattern, replacement in rules:
      match = pattern.fullmatch(path)
      if match:
        name = match.expand(replacement)
        break
    key = key_for_name(name, by_name)
    if key is None and path in new:
      continue
    if key is None:
      missing.append(f'{path} (looked for {name!r})')
      continue
    if list(shapes[key]) != variable.shape.as_list():
      wrong_shape.append(f'{path}: {list(shapes[key])} vs {variable.shape.as_list()}')
      continue
    found.append(CheckpointEntry(key, variable))
  if missing or wrong_shape:
    raise ConfigError(
        f'checkpoint.init_from {prefix}: {len(missing)} variable(s) not found '
        f'[{"; ".join(missing[:8])}] and {len(wrong_shape)} with other shapes '
        f'[{"; ".join(wrong_shape[:8])}]', where='checkpoint.init_from_map',
        fix='add (regex, replacement) pairs mapping new paths to the names in '
            'the checkpoint (tf.train.list_variables shows them)')
  return found, sum(int(np.prod(s)) * 4 for s in shapes.values())
