"""The clock order every pipeline engine follows (forward and reverse).

    for clock, work in enumerate(clock_order(num_stages=2, num_micro_batches=3)):
      for stage, item in work:   # clock 1: [(0, Item(micro=1, repeat=0)), (1, Item(micro=0, ...))]
        ...

Work item i (in 0 .. R*M-1) is micro-batch i % M on its repeat i // M; at
clock t stage s holds item t - s, so stage s works on micro-batch m while
stage s+1 works on m-1. `reverse=True` is the backward order: the last stage
starts (stage s holds item t - (S-1-s)). With circular repeats (R > 1) stage
S-1's output for item i returns to stage 0 as item i + M, which needs M >= S.
Clocks: R*M + S - 1, of which S - 1 are fill/drain: the bubble fraction
(S-1) / (R*M + S-1) of every stage's time.
"""

from __future__ import annotations

import dataclasses

from layout_core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Item:
  micro: int   # micro-batch index
  repeat: int  # circular repeat (0 without circular repeats)


def clock_order(num_stages: int, num_micro_batches: int, *, repeats: int = 1,
                reverse: bool = False) -> list[list[tuple[int, Item]]]:
  """Per clock, the (stage, item) pairs that do work, stages in ascending
  order (descending with `reverse`)."""
  if num_micro_batches < 1:
    raise ConfigError(f'pipeline.num_micro_batches is {num_micro_batches}',
                      fix='use at least 1')
  if repeats > 1 and num_micro_batches < num_stages:
    raise ConfigError(
        f'pipeline.circular_repeats={repeats} needs at least as many micro-batches as '
        f'stages, got {num_micro_batches} micro-batches for {num_stages} stages (a '
        "stage's output must come back to stage 0 before that stage needs it again)",
        where='pipeline.num_micro_batches',
        fix=f'use pipeline.num_micro_batches >= {num_stages}, or circular_repeats = 1')
  items = repeats * num_micro_batches
  order = []
  for clock in range(items + num_stages - 1):
    work = []
    stages = range(num_stages - 1, -1, -1) if reverse else range(num_stages)
    for stage in stages:
      i = clock - (num_stages - 1 - stage if reverse else stage)
      if 0 <= i < items:
        work.append((stage, Item(micro=i % num_micro_batches, repeat=i // num_micro_batches)))
    order.append(work)
  return order


def item_at(num_stages: int, num_micro_batches: int, repeats: int, clock: int,
            stage: int) -> Item | None:
  """The item stage `stage` holds at `clock` in the forward order, or None (bubble)."""
  i = clock - stage
  if 0 <= i < repeats * num_micro_batches:
    return Item(micro=i % num_micro_batches, repeat=i // num_micro_batches)
  return None


def bubble_fraction(num_stages: int, num_micro_batches: int, repeats: int = 1) -> float:
  """Idle share of every stage in theory: (S - 1) / (R*M + S - 1)."""
  return (num_stages - 1) / (repeats * num_micro_batches + num_stages - 1)
