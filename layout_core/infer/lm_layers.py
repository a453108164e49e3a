"""A Transformer LM's layers and weights as the decoder reads them.

    layers = lm_layers(params)          # embedding, blocks, final norm, softmax; or ConfigError
    layers.max_len, layers.vocab_size
    check_fits(prompt_length=20, max_new_tokens=5, max_len=24)   # 24 positions: fits
    w = TensorWeights(weights, 'lm/stack/block_000', dtype='float32')
    w('attn/wq')                        # weights['lm/stack/block_000/attn/wq'], as the math uses it

`layout_core.infer.decode` runs the layers' own math over these; the checks
here are also the config-time ones of `train.sample_every` and
`launch.decode` (TensorFlow is imported only when a weight is read).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from layout_core.errors import ConfigError
from layout_core.layout import fsdp
from layout_core.lazy import dtensor, tf
from layout_core.model.base import leaf_layers
from layout_core.model.layers import Embedding, LayerNorm, Softmax, TransformerBlock
from layout_core.model.weights import Weights
from layout_core.params import Params

_LM_FIX = ('decoding runs the Transformer LM of layout_core.model.lm '
           '(model.params = @transformer_lm())')


@dataclasses.dataclass(frozen=True)
class LMLayers:
  """The Transformer LM's leaf layers in order, each (path, params)."""
  embedding: tuple[str, Params]
  blocks: tuple[tuple[str, Params], ...]
  final_norm: tuple[str, Params]
  softmax: tuple[str, Params]

  @property
  def max_len(self) -> int:
    """Positions the model has (0: no position table, no limit)."""
    return self.embedding[1].max_len

  @property
  def vocab_size(self) -> int:
    return self.softmax[1].num_classes


def lm_layers(params) -> LMLayers:
  """`params`' leaves as a Transformer LM (embedding, blocks, final norm,
  softmax); a ConfigError for any other model (a Keras model, a classifier)."""
  if not isinstance(params, Params):
    raise ConfigError(f'the model is a {type(params).__name__}, not a Params tree',
                      where='model.params', fix=_LM_FIX)
  leaves = leaf_layers(params)
  kinds = [p.cls for _, p in leaves]
  if (len(leaves) < 4 or kinds[0] is not Embedding or kinds[-2] is not LayerNorm
      or kinds[-1] is not Softmax or any(k is not TransformerBlock for k in kinds[1:-2])):
    names = ', '.join(f'{path} ({p.cls.__name__})' for path, p in leaves[:6])
    raise ConfigError(f'the model ({names}{", ..." if len(leaves) > 6 else ""}) is not a '
                      'Transformer LM: an embedding, Transformer blocks, a layer norm and '
                      'a softmax', where='model.params', fix=_LM_FIX)
  for path, p in leaves[1:-2]:
    if not TransformerBlock.child_params(p)['attn'].causal:
      raise ConfigError(f'{path} attends both ways (causal = False): it cannot generate',
                        where='model.params', fix=_LM_FIX)
  return LMLayers(embedding=leaves[0], blocks=tuple(leaves[1:-2]), final_norm=leaves[-2],
                  softmax=leaves[-1])


def positions_needed(prompt_length: int, max_new_tokens: int) -> int:
  """Positions a prompt and its continuation take in the model: the prompt
  and every new token but the last are fed to it."""
  return prompt_length + max_new_tokens - 1


def check_fits(*, prompt_length: int, max_new_tokens: int, max_len: int,
               where: str = 'the prompt / max_new_tokens') -> None:
  """ConfigError when a prompt of `prompt_length` tokens and `max_new_tokens`
  new ones need more positions than the model's `max_len` (0: no limit)."""
  if max_new_tokens < 1:
    raise ConfigError(f'max_new_tokens is {max_new_tokens}', where=where,
                      fix='ask for at least 1 new token')
  if prompt_length < 1:
    raise ConfigError('a prompt is empty', where=where,
                      fix='give every prompt at least one token')
  needed = positions_needed(prompt_length, max_new_tokens)
  if max_len and needed > max_len:
    fix = (f'ask for at most {max_len - prompt_length + 1} new tokens, or shorten the prompt'
           if prompt_length <= max_len else
           f'shorten the prompt to at most {max_len} tokens (and its continuation with it)')
    raise ConfigError(f'a prompt of {prompt_length} tokens and {max_new_tokens} new ones '
                      f'need {needed} positions (the prompt and every new token but the '
                      f'last), more than the model\'s max_len = {max_len}', where=where,
                      fix=fix)


class TensorWeights(Weights):
  """The weights of the layer at `path`, read from a mapping path -> variable
  or tensor, as a layer's `apply` reads them: cast to `dtype`, gathered first
  where FSDP stores them split. No dropout (`random()` is None)."""

  def __init__(self, values: Mapping[str, object], path: str, *, dtype, adapters=None):
    self._values, self.path, self.dtype, self.adapters = values, path, dtype, adapters

  def has(self, name):
    return f'{self.path}/{name}' in self._values

  def _read(self, name):
    return fsdp.at_use(self._values[f'{self.path}/{name}'], self.dtype)

  def child(self, name):
    return TensorWeights(self._values, f'{self.path}/{name}', dtype=self.dtype,
                         adapters=self.adapters)

  def random(self):
    return None


def compute_dtype(p: Params) -> str:
  """The dtype a layer's math runs in: its fprop_dtype, else its variables'."""
  return p.fprop_dtype or p.dtype


def check_weights(params: Params, values: Mapping[str, object]) -> None:
  """ConfigError naming the model's variables `values` lacks or holds in another shape."""
  missing, reshaped = [], []
  for spec in params.cls.variable_specs(params):
    value = values.get(spec.path)
    if value is None:
      missing.append(spec.path)
    elif tf.TensorShape(value.shape).as_list() != list(spec.shape):
      reshaped.append(f'{spec.path}: {tf.TensorShape(value.shape).as_list()} vs the '
                      f'model\'s {list(spec.shape)}')
  if missing or reshaped:
    shown = (missing + reshaped)[:4]
    more = len(missing) + len(reshaped) - len(shown)
    raise ConfigError(f'the weights do not fit the model: {len(missing)} missing, '
                      f'{len(reshaped)} of another shape [{"; ".join(shown)}'
                      f'{f"; ... {more} more" if more else ""}]', where='weights',
                      fix='give the weights of this model, by variable path (as in the '
                          'run\'s layouts.txt)')


def mesh_of(values: Mapping[str, object]):
  """The mesh the weights are laid out on, or None (plain variables or tensors)."""
  meshes = []
  for value in values.values():
    layout = _layout(value)
    if layout is not None and layout.mesh not in meshes:
      meshes.append(layout.mesh)
  if len(meshes) > 1:
    raise ConfigError(f'the weights are on {len(meshes)} meshes (a model pipelined over '
                      'sub-meshes)', where='weights',
                      fix='load the model without its pipeline (one mesh), e.g. '
                          'plugins.inference.load_trained(..., pipelined=False)')
  return meshes[0] if meshes else None


def _layout(value):
  if isinstance(value, dtensor.DVariable):
    return value.layout
  if not tf.is_tensor(value) or isinstance(value, tf.Variable):
    return None
  try:
    return dtensor.fetch_layout(value)
  except Exception:  # pylint: disable=broad-except  # not a DTensor
    return None
