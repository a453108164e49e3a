"""The checkpoint keys of a stacked variable: one key per element it stacks.

An engine that stacks identical layers into one variable (the SPMD pipeline's
`[S, Q, ...]` cells) tags it so that checkpoints keep the unstacked model's
keys, and a checkpoint moves between stacked and plain runs:

    set_unstacked(stacked, 'stacked_cells', [('block_000', (0, 0)), ('block_001', (1, 0))])
    unstacked_pieces(stacked)   # ('stacked_cells', (('block_000', (0, 0)), ...))
    unstacked_key('model/lm/stack/stacked_cells/ffn/w_in', 'stacked_cells', 'block_001')
    # -> 'model/lm/stack/block_001/ffn/w_in', which holds stacked[1, 0]

The tag lives here, below both the engines that set it and the checkpoint
code that reads it (`layout_core.checkpoint.shard_io`), so neither reaches
into the other. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import re
from typing import Sequence

_TAG = '_meshgin_unstacked'

# (placeholder, ((name, index), ...)): what a tagged variable stacks.
Pieces = tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]


def set_unstacked(variable, placeholder: str,
                  pieces: Sequence[tuple[str, tuple[int, ...]]]) -> None:
  """Declares that `variable` stacks several checkpoint tensors: for each
  (name, index) in `pieces`, the key of `variable` with its path component
  `placeholder` replaced by `name` holds `variable[index]`. E.g. placeholder
  'stacked_cells' and ('block_003', (1, 0)):
  model/lm/stack/stacked_cells/ffn/w_in -> model/lm/stack/block_003/ffn/w_in = v[1, 0]."""
  setattr(variable, _TAG, (placeholder, tuple((n, tuple(i)) for n, i in pieces)))


def unstacked_pieces(variable) -> Pieces | None:
  """What `set_unstacked` declared for `variable`; None for a plain variable."""
  return getattr(variable, _TAG, None)


def unstacked_key(key: str, placeholder: str, name: str) -> str:
  """`key` with its path component `placeholder` replaced by `name`
  (components are separated by '/' in keys and by '.S' inside escaped names);
  ValueError unless `placeholder` is exactly one component of `key`."""
  pattern = re.compile(r'(^|/|\.S)' + re.escape(placeholder) + r'(?=/|\.S|$)')
  replaced, count = pattern.subn(lambda m: m.group(1) + name, key)
  if count != 1:
    raise ValueError(f'{placeholder!r} is {count} components of checkpoint key {key!r}')
  return replaced
