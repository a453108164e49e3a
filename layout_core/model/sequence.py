"""Packed sequences: which document each token belongs to, for the layers.

    with sequence_context(segments=segments, positions=positions):
      logits = model(tokens)   # attention stays inside each segment; positions
                               # restart at 0 in each

A task that packs several documents into one row (`layout_core.tasks.corpus`)
gives, per input token, its segment (1, 2, ... per document, 0 for padding)
and its position within the document. `MultiHeadAttention` then lets a token
attend only to earlier tokens of its own segment, and `Embedding` adds the
position embedding of each token's own position. Outside a context (every
other task) both behave as before: causal over the whole row, positions
0..T-1.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

from layout_core.scoped import Scoped

_state = Scoped()  # SequenceInputs inside a sequence_context


class SequenceInputs(NamedTuple):
  segments: 'tf.Tensor'    # int [B, T]
  positions: 'tf.Tensor'   # int [B, T]


def current_sequence() -> SequenceInputs | None:
  return _state.get()


@contextlib.contextmanager
def sequence_context(*, segments, positions) -> Iterator[None]:
  with _state.set(SequenceInputs(segments, positions)):
    yield
