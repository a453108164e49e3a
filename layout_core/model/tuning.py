"""A Params tree fine-tuned: `layout_core.model.lora`'s settings on every layer.

    p = tune(lm_params, lora=LoraConfig(rank=8, targets=(r'.*/attn/w[qv]',)),
             trainable=None)            # checked: each regex must match
    lora_of(p)                          # the LoraConfig it carries
    base = untuned(p)                   # the model without adapters (a merged export)
"""

from __future__ import annotations

from typing import Sequence

from layout_core.errors import ConfigError
from layout_core.model.base import Sequential
from layout_core.model.lora import LoraConfig, Tuning, check_targets
from layout_core.params import Params


def tuned(p, tuning: Tuning):
  """A copy of the Params tree `p` whose every layer carries `tuning`
  (composite layers hand it to the children they make: `BaseLayer`)."""
  return _carrying(p, tuning) if tuning.active else p


def untuned(p):
  """A copy of the Params tree `p` without tuning: the base model."""
  return _carrying(p, None)


def _carrying(p, tuning: Tuning | None):
  """A frozen copy of `p` with `tuning` set on every node of its Sequentials."""
  p = p.Copy()

  def walk(node) -> None:
    node.tuning = tuning
    if issubclass(node.cls, Sequential):
      for sub in node.sub:
        walk(sub)
  walk(p)
  return p.Freeze()


def tune(model, *, lora: LoraConfig | None, trainable: Sequence[str] | None,
         frozen_dtype: str = 'float32'):
  """`model` (a Params tree) tuned as `lora` and `trainable` say, each regex
  checked to match (`check_targets`), its frozen weights stored in
  `frozen_dtype`; `model` itself when neither is set. A ConfigError for a
  Keras model, and for a `frozen_dtype` other than float32 that no weight
  is frozen for."""
  tuning = Tuning(lora=lora, trainable=trainable, frozen_dtype=frozen_dtype)
  if not tuning.active and frozen_dtype == 'float32':
    return model
  if not isinstance(model, Params):
    raise ConfigError('lora.*, train.trainable and train.frozen_dtype tune a Params model; '
                      f'this one is a {type(model).__name__}',
                      where='lora.rank / train.trainable / train.frozen_dtype',
                      fix="a Keras 3 model has its own layer.enable_lora(rank); or train a "
                          'Params model (model.params = @transformer_lm())')
  if not tuning.active:
    raise ConfigError(f'train.frozen_dtype is {frozen_dtype!r}, but no weight is frozen',
                      where='train.frozen_dtype',
                      fix='freeze the base with LoRA (lora.rank, lora.targets) or '
                          "train.trainable, or leave train.frozen_dtype = 'float32'")
  p = tuned(model, tuning)
  check_targets(p.cls.variable_specs(p), tuning.lora, tuning.trainable)
  return p


def lora_of(p) -> LoraConfig | None:
  """The LoRA settings a (tuned) Params tree carries, or None."""
  tuning = p.tuning if 'tuning' in p else None
  return tuning.lora if tuning is not None else None
