"""How `launch.decode` and `launch.export`'s `generate` pick each new token:
the sampling flags, defined once (layout_core.infer.sampling.Sampling).

Flags are defined in `launch/` only; `sampling()` hands the library a plain
Sampling, checked (a bad value is a ConfigError, exit 2, before any model
loads).
"""

from __future__ import annotations

from absl import flags

TEMPERATURE = flags.DEFINE_float(
    'temperature', 0.0, '0: greedy (the most likely token); > 0: sample from '
    'softmax(logits / temperature).')
TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample among the k most likely tokens; 0: all.')
TOP_P = flags.DEFINE_float(
    'top_p', 1.0, 'Sample among the fewest most likely tokens whose probability reaches '
    'top_p, in (0, 1]; 1: all.')


def sampling():
  """The flags' `Sampling` (ConfigError naming the flag for a bad value)."""
  from layout_core.infer.sampling import Sampling  # pylint: disable=g-import-not-at-top
  return Sampling(temperature=TEMPERATURE.value, top_k=TOP_K.value, top_p=TOP_P.value)
