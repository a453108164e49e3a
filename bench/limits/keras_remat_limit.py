r"""The limit behind "train.remat is not available for Keras 3 models": shown.

    python -m bench.limits.keras_remat_limit

Keras 3 (TensorFlow backend) rematerializes a layer by wrapping its call in
`tf.recompute_grad`, passing the call's keyword arguments (`training=...`)
through; TensorFlow's `custom_gradient` accepts keyword arguments only when
executing eagerly. Training steps run inside `tf.function`, so every mode
that wraps a layer call fails there; mode 'activations' (it wraps only the
activation function, called without keyword arguments) works, and is what
meshgin uses for Keras models under any train.remat but 'none'. This script tries each RematScope mode,
eagerly and in a tf.function, without DTensor (so the limit is Keras/TF's,
not meshgin's), and writes what happened to bench/results/keras_remat_limit.json.
"""

from __future__ import annotations

import os
import sys

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

os.environ.setdefault('KERAS_BACKEND', 'tensorflow')

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from bench.common import RESULTS, write_json  # noqa: E402


def attempt(mode: str, compiled: bool) -> str:
  keras.backend.clear_session()
  with keras.RematScope(mode=mode):
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation='relu')(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
  x = tf.constant(np.ones((8, 16), np.float32))

  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)
  try:
    (tf.function(step) if compiled else step)(x)
    return 'ok'
  except Exception as e:  # pylint: disable=broad-except
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    reason = next((l for l in lines if 'custom_gradient' in l), lines[-1] if lines else '')
    return f'{type(e).__name__}: {reason.replace(chr(27) + "[1m", "").replace(chr(27) + "[0m", "")}'


def main():
  results = {f'{mode}, {"tf.function" if compiled else "eager"}': attempt(mode, compiled)
             for mode in ('full', 'activations') for compiled in (False, True)}
  for name, outcome in results.items():
    print(f'{name:28s} {outcome}')
  write_json({'keras': keras.__version__, 'tensorflow': tf.__version__, 'results': results},
             os.path.join(RESULTS, 'keras_remat_limit.json'))


if __name__ == '__main__':
  main()
