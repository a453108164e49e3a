"""What a step's math needs to know besides its inputs and weights, as one object.

A layer deep inside the model reads a few facts about the step it runs in
that nobody passes through every `fprop`: the step's dropout seed, packed
documents' segments, where the residual stream lives, the axis FSDP splits
the batch over, whether it runs rematerialized. They travel together as one
frozen `StepContext`, set for the length of a block:

    context = StepContext(random=RandomState(seed, batch_offset=0))
    with entered(context.replace(sequence=SequenceInputs(segments, positions))):
      logits = model(tokens)          # each layer's weights carry it: w.context

`entered` is the only way to set it, and a change is always a whole new
object made by `replace` from the one in force, so a block that adds one
fact keeps all the others. It is read where a layer's weights are made
(`layout_core.model.weights`: `BaseLayer.fprop`, the SPMD engine's cells)
and handed to the layer's math with them (`w.context`), not looked up inside
it. What runs later, outside the block, takes the
object with it: `layout_core.model.remat.rematerialized` keeps the forward
pass's `current()` and enters that same object again for the recomputation
in the backward pass, so a recomputed layer sees exactly the step its
forward saw (masks, segments, residual pin, batch split).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, NamedTuple

from layout_core.scoped import Scoped


class RandomState(NamedTuple):
  """Random layers (dropout) are on: the step's seed (int64 scalar tensor) and
  the global row index of this (micro-)batch's first row."""
  seed: Any
  batch_offset: Any = 0


class SequenceInputs(NamedTuple):
  """Packed documents: per input token its segment (1, 2, ... per document,
  0 for padding) and its position within its document, int [B, T] each."""
  segments: Any
  positions: Any


class ResidualPin(NamedTuple):
  """Where a transformer's residual stream lives (`layout_core.model.activations`):
  the mesh and the sharding of its leading dims (lead axes, then the batch)."""
  mesh: Any
  split: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class StepContext:
  """What a step's math needs besides its inputs and weights (module doc).

  The defaults are an evaluation step's: no dropout, one document per row,
  the residual stream where DTensor puts it, no FSDP batch split, nothing
  recomputed.

  A layer reads it from its weights, `w.context` in `apply` (or
  `current()` in an `fprop` that builds no `Weights`):

      sequence = w.context.sequence
      if sequence is not None:             # packed rows: stay in one document
        same = tf.equal(sequence.segments[:, :, None], sequence.segments[:, None, :])

  Attributes:
    random: The dropout state (`RandomState`); None: random layers are the
      identity.
    sequence: Packed documents' segments and positions (`SequenceInputs`);
      None: each row is one sequence (causal over the whole row).
    residual: Where a transformer's residual stream lives (`ResidualPin`);
      None: left to DTensor.
    batch_split: The mesh axis FSDP splits the batch over; None: no split.
    remat: Whether this runs inside a rematerialized layer (the forward pass
      recomputed in the backward one).
    adapters: Whether LoRA adapters add their low-rank path; False: the
      frozen base alone (a preference task's reference model).
    router_terms: Where mixture-of-experts layers put their router terms
      (`layout_core.model.moe.collecting`); None: not collected.
  """
  random: RandomState | None = None        # None: random layers are the identity
  sequence: SequenceInputs | None = None   # None: causal over the whole row
  residual: ResidualPin | None = None      # None: left to DTensor
  batch_split: str | None = None           # the mesh axis the batch is split over (FSDP)
  remat: bool = False                      # inside a rematerialized layer
  adapters: bool = True                    # False: LoRA weights run as their base
  router_terms: Any = None                 # MoE layers' terms go here (moe.collecting)

  def replace(self, **changes) -> 'StepContext':
    """A copy with `changes` (field: value); the others kept."""
    return dataclasses.replace(self, **changes)


_current = Scoped(default=StepContext())


def current() -> StepContext:
  """The context in force (an evaluation step's outside any block)."""
  return _current.get()


@contextlib.contextmanager
def entered(context: StepContext) -> Iterator[StepContext]:
  """`context` in force for the block (per thread); the previous one after it."""
  if not isinstance(context, StepContext):
    raise TypeError(f'entered() takes a StepContext, got {type(context).__name__}')
  with _current.set(context):
    yield context
