"""The search: every layout, its fastest settings that fit, ranked by predicted time.

    result = search(layouts=enumerate_layouts(num_devices=8, ...), ladders_of=ladders,
                    evaluate=evaluate, budget=Budget(limit=4 * 2**30, per_process=True))
    result.ranked[0].candidate.bindings(), result.refused, result.smallest_need()

For each layout, each ladder of settings (`space.settings_for`: one compute
dtype, remat policy and pipeline schedule at growing gradient accumulation)
is climbed until a rung fits the budget: more accumulation only lowers
memory and adds time, so the first rung that fits is that ladder's
fastest. The layout keeps the rung predicted fastest over all ladders
(found best-first, `search`); the layouts are ranked by it. The caller owns
both models (`plugins.suggest.planner`): `time_of` and `memory_of` plan a
candidate (a ConfigError: it cannot run, and why) and predict its step time
or its memory.

A layout none of whose rungs fit is kept with its smallest need, so that a
model that fits nowhere can say the smallest budget that would fit it.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable, Iterable, Mapping, Sequence

from layout_core.errors import ConfigError
from layout_core.suggest.space import Candidate, Layout, Settings


@dataclasses.dataclass(frozen=True)
class Budget:
  """Memory a candidate may need: per process (CPU: a process holds all its
  devices) or per device, less a safety margin per layout family (the
  memory estimate's worst measured error for that pipeline engine and state
  split, as a fraction; `default_margin` for a family not measured)."""
  limit: int
  per_process: bool
  processes: int = 1
  margins: Mapping[str, float] = dataclasses.field(default_factory=dict)
  default_margin: float = 0.0

  def margin(self, layout: Layout) -> float:
    return self.margins.get(layout.family, self.default_margin)

  def fits(self, need: int, layout: Layout) -> bool:
    return need * (1.0 + self.margin(layout)) <= self.limit

  def smallest_limit(self, need: int, layout: Layout) -> int:
    """The budget that would just fit `need`, the margin included."""
    return int(need * (1.0 + self.margin(layout))) + 1


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """A planned candidate: what it needs against the budget, and its time."""
  candidate: Candidate
  need: int                 # bytes, per process or per device as the budget counts
  seconds: float            # predicted step time
  terms: dict               # the cost model's parts, seconds
  memory: dict              # the memory estimate's categories, bytes per device


@dataclasses.dataclass
class SearchResult:
  ranked: list[Evaluation]                       # each layout's best, fastest first
  refused: dict[str, list[Layout]]               # why a layout cannot run -> layouts
  too_big: list[Evaluation]                      # each layout's smallest, none fitting
  evaluated: int = 0

  def smallest_need(self, budget: Budget) -> Evaluation | None:
    """The candidate that needs the smallest budget of all, its family's
    margin included (None: none planned)."""
    pool = self.too_big + self.ranked
    return (min(pool, key=lambda e: budget.smallest_limit(e.need, e.candidate.layout))
            if pool else None)


def search(*, layouts: Iterable[Layout],
           ladders_of: Callable[[Layout], Iterable[Sequence[Settings]]],
           time_of: Callable[[Candidate], tuple[float, dict]],
           memory_of: Callable[[Candidate], tuple[int, dict]], budget: Budget,
           least_memory: Callable[[Layout], Sequence[Candidate]] = lambda layout: ()
           ) -> SearchResult:
  """See the module docstring. Per layout, best first: the first rung of
  every ladder is timed (`time_of`: no memory estimate yet), then the
  fastest rung is sized (`memory_of`); if it fits, no other rung can beat it
  (rungs only get slower up a ladder), else the next rung of its ladder is
  timed and queued. `least_memory(layout)`, when given, names the
  candidates among which one needs the least memory of the layout, sized
  until one fits: a layout where none of them fits is dropped before any
  ladder is climbed. Either
  callable raises ConfigError for a candidate launch.train would refuse;
  `ladders_of` and `least_memory` for a layout with nothing to try. Each
  refused layout is kept with its most common reason."""
  result = SearchResult(ranked=[], refused={}, too_big=[])
  for layout in layouts:
    reasons: list[str] = []

    def attempt(fn, candidate):
      try:
        return fn(candidate)
      except ConfigError as error:
        reasons.append(error.message)
        return None

    try:
      ladders = [list(ladder) for ladder in ladders_of(layout)]
      lightest = list(least_memory(layout))
    except ConfigError as error:
      result.refused.setdefault(error.message, []).append(layout)
      continue
    floors = []  # sized until one fits: then some candidate of the layout fits
    for candidate in lightest:
      sized = attempt(memory_of, candidate)
      if sized is not None:
        result.evaluated += 1
        floors.append((sized, candidate))
        if budget.fits(sized[0], layout):
          break
    if floors and not any(budget.fits(sized[0], layout) for sized, _ in floors):
      sized, floor = min(floors, key=lambda f: f[0][0])
      timed = attempt(time_of, floor) or (0.0, {})
      result.too_big.append(Evaluation(floor, sized[0], timed[0], timed[1], sized[1]))
      continue
    queue: list[tuple[float, int, int, dict]] = []

    def push(ladder: int, rung: int) -> None:
      while rung < len(ladders[ladder]):
        timed = attempt(time_of, Candidate(layout, ladders[ladder][rung]))
        if timed is not None:
          heapq.heappush(queue, (timed[0], ladder, rung, timed[1]))
          return
        rung += 1

    for ladder in range(len(ladders)):
      push(ladder, 0)
    best: Evaluation | None = None
    smallest: Evaluation | None = None
    while queue:
      seconds, ladder, rung, terms = heapq.heappop(queue)
      candidate = Candidate(layout, ladders[ladder][rung])
      sized = attempt(memory_of, candidate)
      if sized is None:
        push(ladder, rung + 1)
        continue
      result.evaluated += 1
      done = Evaluation(candidate, sized[0], seconds, terms, sized[1])
      if budget.fits(done.need, layout):
        best = done
        break
      if smallest is None or done.need < smallest.need:
        smallest = done
      push(ladder, rung + 1)
    if best is not None:
      result.ranked.append(best)
    elif smallest is not None:
      result.too_big.append(smallest)
    elif reasons:
      result.refused.setdefault(_shortest(reasons), []).append(layout)
  result.ranked.sort(key=lambda e: e.seconds)
  return result


def _shortest(reasons: list[str]) -> str:
  """The most common reason (ties: the first given)."""
  return max(dict.fromkeys(reasons), key=reasons.count)
