"""Fine-tuning a Params model: which weights train, and low-rank adapters.

    tuning = Tuning(lora=LoraConfig(rank=8, alpha=16, targets=(r'.*/attn/w[qv]',)))
    p = tuned(lm_params, tuning)          # layout_core.model.tuning: every layer carries it
    model = p.Instantiate()               # wq, wv frozen; wq_lora_a, wq_lora_b, ... train

A weight a LoRA target regex fullmatches stays as it is, frozen, and gets two
adapters beside it: `<name>_lora_a` [the weight's input dims..., r] and
`<name>_lora_b` [r, its output dims...]. Its contraction becomes

    y = x . W  +  (alpha / r) * ((dropout(x) . A) . B)

written once, in `layout_core.model.weights.Weights.dense` / `project`, so
every engine, the decoder and the export run the same math. B starts at zero:
step 0 of a LoRA run is the base model exactly. A starts Gaussian with
stddev 1/sqrt(fan-in) (PEFT's default draws uniformly with the same bound).
Only weights a layer contracts with its input can take adapters: the
`Declared.inputs` leading dims (attention's q/k/v/o, the feed-forward
matrices); an embedding table or the tied softmax cannot.

Where no layout rule names an adapter, it follows its weight's split
(`layout_core.layout.variables.Follows`): A on the input dims, B on the
output dims, the rank dim whole. Under Megatron's rules wq's A is
replicated and B is split over heads; wo's A is split over heads and B is
replicated.

`Tuning.trainable` freezes without adapters: regexes on variable paths
(None: every weight; with LoRA: the adapters only, plus what it names).
Frozen variables have no gradient and no optimizer state, and are
checkpointed as before (bit-identical after training).
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from typing import Sequence

import numpy as np

from layout_core.errors import ConfigError
from layout_core.fields import check_types
from layout_core.lazy import tf
from layout_core.layout import fsdp
from layout_core.layout.variables import Follows, Normal, VariableSpec, Zeros
from layout_core.model import frozen, random

A_SUFFIX, B_SUFFIX = '_lora_a', '_lora_b'
_RANK_LETTERS = 'rzyxwvuqponm'


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on the weights `targets` fullmatch (module doc).

  Attributes:
    rank: r, the adapters' inner width (0: no adapters).
    alpha: The update is scaled by alpha / rank.
    dropout: Dropout rate on the adapters' input (training only).
    targets: Regexes on variable paths, as in layout rules
      (r'.*/attn/w[qv]'); first match is enough.
  """
  rank: int = 0
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] = ()

  def __post_init__(self):
    check_types(self, name='lora')
    object.__setattr__(self, 'targets', tuple(self.targets))
    if self.rank < 0 or not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f'lora.rank={self.rank}, lora.dropout={self.dropout}', where='lora',
                        fix='use rank >= 1 (0: off) and 0 <= dropout < 1')
    if self.rank and not self.targets:
      raise ConfigError('lora.rank is set but lora.targets is empty', where='lora.targets',
                        fix="name the weights to adapt, e.g. (r'.*/attn/w[qv]',)")
    for pattern in self.targets:
      _compile(pattern, 'lora.targets')

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def adapts(self, path: str) -> bool:
    return bool(self.rank) and any(re.fullmatch(t, path) for t in self.targets)


@dataclasses.dataclass(frozen=True)
class Tuning:
  """What a fine-tuning run changes: adapters (`lora`), which base weights
  train (`trainable`: regexes; None: all without LoRA, none with), and the
  dtype the others are stored in (`frozen_dtype`: `layout_core.model.frozen`)."""
  lora: LoraConfig | None = None
  trainable: tuple[str, ...] | None = None
  frozen_dtype: str = 'float32'

  def __post_init__(self):
    frozen.check_frozen_dtype(self.frozen_dtype)
    if self.lora is not None and not self.lora.rank:
      object.__setattr__(self, 'lora', None)
    if self.trainable is not None:
      object.__setattr__(self, 'trainable', tuple(self.trainable))
      for pattern in self.trainable:
        _compile(pattern, 'train.trainable')

  @property
  def active(self) -> bool:
    return self.lora is not None or self.trainable is not None

  def trains(self, path: str) -> bool:
    """Whether the variable at `path` gets gradients and optimizer state."""
    if is_adapter(path):
      return True
    if self.trainable is None:
      return self.lora is None
    return any(re.fullmatch(t, path) for t in self.trainable)


def _compile(pattern: str, where: str) -> None:
  try:
    re.compile(pattern)
  except re.error as e:
    raise ConfigError(f'{where} has the bad regex {pattern!r}: {e}', where=where,
                      fix='write a Python regular expression') from None


def is_adapter(path: str) -> bool:
  return path.endswith((A_SUFFIX, B_SUFFIX))


def adapter_specs(spec: VariableSpec, *, inputs: int, lora: LoraConfig,
                  lead: int = 0) -> list[VariableSpec]:
  """The two adapters of the weight `spec`, whose `inputs` dims after its
  `lead` ones meet the layer's input: A [lead..., in..., r] (Gaussian), B
  [lead..., r, out...] (zeros): one pair per index of the lead dims (a
  routed layer's experts). Each follows the weight's layout where no rule
  names it."""
  shape, r = tuple(spec.shape), lora.rank
  leads, ins, outs = shape[:lead], shape[lead:lead + inputs], shape[lead + inputs:]
  fan_in = math.prod(ins)
  return [
      VariableSpec(path=spec.path + A_SUFFIX, shape=leads + ins + (r,), dtype=spec.dtype,
                   initializer=Normal(1.0 / math.sqrt(fan_in)),
                   follows=Follows(spec.path, shape, tuple(range(lead + inputs)) + (None,))),
      VariableSpec(path=spec.path + B_SUFFIX, shape=leads + (r,) + outs, dtype=spec.dtype,
                   initializer=Zeros(),
                   follows=Follows(spec.path, shape, tuple(range(lead)) + (None,)
                                   + tuple(range(lead + inputs, len(shape)))))]


def merged(weight: np.ndarray, a: np.ndarray, b: np.ndarray, *, scale: float) -> np.ndarray:
  """W + scale * A.B: the weight whose contraction equals W's plus its
  adapters' path (in float32, then W's dtype); per expert where the
  adapters carry the weight's lead dims (`adapter_specs`)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  lead = a.ndim + b.ndim - 2 - np.ndim(weight)  # dims A, B and W share, uncontracted
  if lead:
    update = np.stack([np.tensordot(a_e, b_e, axes=1) for a_e, b_e in
                       zip(a.reshape((-1,) + a.shape[lead:]), b.reshape((-1,) + b.shape[lead:]))]
                      ).reshape(np.shape(weight))
  else:
    update = np.tensordot(a, b, axes=1)
  return (np.asarray(weight, np.float32) + scale * update).astype(weight.dtype)


def check_targets(specs: Sequence[VariableSpec], lora: LoraConfig | None,
                  trainable: Sequence[str] | None = None) -> None:
  """ConfigError naming each LoRA target regex that adapted no weight, and
  each `trainable` regex that matched no variable (`specs`: the tuned
  model's)."""
  paths = [s.path for s in specs]
  if lora is not None:
    adapted = {p[:-len(A_SUFFIX)] for p in paths if p.endswith(A_SUFFIX)}
    idle = [t for t in lora.targets if not any(re.fullmatch(t, p) for p in adapted)]
    if idle:
      others = [p for p in paths if any(re.fullmatch(t, p) for t in idle)]
      said = (f'; it matches only {", ".join(others[:4])}, which no layer contracts with '
              'its input' if others else '')
      raise ConfigError(f'lora.targets {idle} adapted no weight{said}', where='lora.targets',
                        fix='match projection weights by path (launch.inspect lists them), '
                            "e.g. r'.*/attn/w[qv]' or r'.*/ffn/w_.*'")
  if trainable is not None:
    idle = [t for t in trainable if not any(re.fullmatch(t, p) for p in paths)]
    if idle:
      raise ConfigError(f'train.trainable {idle} matched no variable', where='train.trainable',
                        fix='match variable paths (launch.inspect lists them), e.g. '
                            r"r'.*/ln\w*/.*'")


# -- the math -------------------------------------------------------------------
def low_rank(w, equation: str, x, name: str, lora: LoraConfig):
  """(alpha / r) * (dropout(x) . A) . B for weight `name` of Weights `w`, for
  the contraction `equation` (subscripts after the lead: 'btd,dhk->bthk').
  The weight's leading subscripts that x shares are A's, the rest B's."""
  a, b = w(name + A_SUFFIX), w(name + B_SUFFIX)
  inputs, outs = equation.replace(' ', '').split('->')
  x_subs, w_subs = inputs.split(',')
  inner = a.shape.rank - len(w.lead) - 1
  w_in, w_out = w_subs[:inner], w_subs[inner:]
  shared = ''.join(c for c in w_in if c in outs)  # the weight's uncontracted lead (experts)
  r = next(c for c in _RANK_LETTERS if c not in equation)
  batch = ''.join(c for c in x_subs if c not in w_in or c in shared)
  drop = w.random() if lora.dropout else None
  if drop is not None:  # its own mask: the layer's key mixed with the adapter's name
    salt = zlib.crc32(f'{name}{A_SUFFIX}'.encode())
    keys = ([k ^ salt for k in drop.keys] if isinstance(drop.keys, (list, tuple))
            else drop.keys ^ salt)
    x = random.dropout(x, rate=lora.dropout, inputs=drop._replace(keys=keys), lead=w.lead)
  h = tf.einsum(fsdp.lead_equation(f'{x_subs},{w_in}{r}->{batch}{r}', w.lead), x, a)
  y = tf.einsum(fsdp.lead_equation(f'{batch}{r},{shared}{r}{w_out}->{outs}', w.lead), h, b)
  return y * tf.cast(lora.scale, y.dtype)
