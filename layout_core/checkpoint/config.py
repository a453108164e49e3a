"""What a checkpointer is told and what it reports: `CheckpointConfig`, `CheckpointEvent`.

    config = CheckpointConfig(every_steps=100, keep=3, init_from='runs/llama')
    Checkpointer(directory=..., state=..., config=config, on_event=print)
    # CheckpointEvent(step=100, path='.../ckpt-100/ckpt', reason='periodic', ...)

Bound in gin as `checkpoint.*` (plugins/configurables.py); re-exported by
`layout_core.checkpoint.manager`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from layout_core.errors import ConfigError
from layout_core.fields import at_least, check_types


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = 100        # save every N steps (0: never periodically)
  every_seconds: float = 0.0    # also save when this long since the last save (0: off)
  keep: int = 3                 # newest checkpoints kept; older ones deleted
  save_at_end: bool = True      # save when training finishes
  async_save: bool = False      # write in a background thread (single client only)
  init_from: str | None = None  # a checkpoint (or directory) to start a fresh run from
  # (regex on the new variable path, replacement) pairs: the name to read from
  # `init_from`; first fullmatch wins; unmatched paths are read under their own name.
  init_from_map: Sequence[Sequence[str]] = ()
  # Where the base checkpoint that holds a run's frozen weights is now, when
  # it was moved from the path its checkpoints record (`base.json`,
  # layout_core.checkpoint.frozen_base); it must be the same checkpoint.
  moved_base: str | None = None

  def __post_init__(self):
    check_types(self, name='checkpoint')
    at_least(self, 'checkpoint', every_steps=0, every_seconds=0, keep=1)
    for pair in self.init_from_map:
      if len(pair) != 2 or not all(isinstance(p, str) for p in pair):
        raise ConfigError(f'checkpoint.init_from_map entry {pair!r} is not a '
                          '(regex, replacement) pair of strings',
                          where='checkpoint.init_from_map',
                          fix="write entries as (r'new/path/(.*)', r'old/path/\\1')")


@dataclasses.dataclass(frozen=True)
class CheckpointEvent:
  step: int
  path: str
  reason: str        # periodic | final | preemption | resume | init_from
  seconds: float
  size_bytes: int

  def line(self) -> str:
    verb = 'restored' if self.reason in ('resume', 'init_from') else 'saved'
    return (f'step {self.step}: {verb} {self.path} ({self.reason}, '
            f'{self.size_bytes / 2**20:.1f} MiB in {self.seconds:.2f} s)')
