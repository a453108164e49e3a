"""Hugging Face tensor names <-> meshgin variable paths, one table per family.

    rules = tensor_rules(kwargs, family='llama', tied=False)
    rule = rules[1]      # model.layers.0.input_layernorm.weight -> lm/stack/block_000/ln_attn/scale
    [wq] = rules[2].to_meshgin(q_proj)        # [H*K, D] -> [D, H, K]
    q_proj = rules[2].to_hf([wq])             # and back, exactly

Each `TensorRule` is one Hugging Face tensor and the meshgin variable(s) it
becomes, with one transform written once and applied both ways, so an
import and an export are exact inverses (a transpose and a reshape move
values, they never round them):

  'linear'   a `torch.nn.Linear` weight, [out, in]: transposed to [in, out],
             then reshaped to the variable's shape (q_proj [H*K, D] ->
             wq [D, H, K]; o_proj [D, H*K] -> wo [H, K, D]).
  'reshape'  stored as meshgin computes with it, up to a reshape: norms,
             biases ([H*K] -> [H, K]) and GPT-2's `Conv1D` weights, which
             are already [in, out].
  A rule with several paths splits the tensor's last axis between them,
  each part reshaped: GPT-2's `c_attn` holds q | k | v.
  A rule with an `expert` index is one expert's matrix, slice `expert` of
  a routed layer's [E, in, out] variable (Mixtral's experts.e.w1 [F, D] ->
  slice e of moe/w_gate [E, D, F]): the import stacks the E slices
  (`HFSource.values`), the export takes each apart.

RoPE needs no permutation: meshgin rotates the two halves of each head
(Hugging Face's `rotate_half`), the layout Hugging Face's q_proj/k_proj
already have. Grouped-query heads keep their order (query head h reads kv
head h // (H / Hkv), as `repeat_kv` does).

A model with tied embeddings (`tie_embeddings`) has no output projection
of its own, so no rule writes or reads one; an untied model read from tied
embeddings (`tied=True`) gets a rule reading the embedding's tensor.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import numpy as np

from layout_core.convert.hf_config import resolved

Shape = tuple[int, ...]

# Tensors a checkpoint may hold that are buffers, not weights: skipped.
IGNORED = {
    'llama': (r'(.*\.)?rotary_emb\.inv_freq',),
    'gpt2': (r'(transformer\.)?h\.\d+\.attn\.(masked_)?bias',),
}


@dataclasses.dataclass(frozen=True)
class TensorRule:
  """One Hugging Face tensor <-> one or more meshgin variables (module doc)."""
  hf_name: str
  hf_shape: Shape
  paths: tuple[str, ...]
  shapes: tuple[Shape, ...]
  kind: str = 'reshape'   # 'linear' or 'reshape'
  expert: int | None = None  # one expert's slice of the variable (dim 0)

  def to_meshgin(self, array: np.ndarray, dtype=None) -> list[np.ndarray]:
    """The variables' values from the Hugging Face tensor (shape checked by
    the reader), in `dtype` (None: the tensor's): converted as they are
    copied out, so a value costs one copy of itself at most."""
    dtype = array.dtype if dtype is None else np.dtype(dtype)
    if self.kind == 'linear':
      shape = self.shapes[0] if self.expert is None else self.shapes[0][1:]
      return [np.asarray(array.T, dtype=dtype, order='C').reshape(shape)]
    if len(self.paths) == 1:
      return [np.asarray(array.reshape(self.shapes[0]), dtype=dtype)]
    sizes = [int(np.prod(s)) // int(np.prod(self.hf_shape[:-1])) for s in self.shapes]
    parts = np.split(array, np.cumsum(sizes)[:-1], axis=-1)
    return [np.asarray(p, dtype=dtype, order='C').reshape(s) for p, s in zip(parts, self.shapes)]

  def to_hf(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The Hugging Face tensor from the variables' values: `to_meshgin` undone."""
    if self.kind == 'linear':
      out, in_ = self.hf_shape
      value = arrays[0]  # an expert's rule: its slice, or the whole variable it is of
      if self.expert is not None and value.ndim == len(self.shapes[0]):
        value = value[self.expert]
      return np.ascontiguousarray(value.reshape(in_, out).T)
    if len(self.paths) == 1:
      return arrays[0].reshape(self.hf_shape)
    lead = self.hf_shape[:-1]
    return np.concatenate([a.reshape(lead + (-1,)) for a in arrays], axis=-1)


def _rule(hf_name: str, hf_shape: Sequence[int], path: str | Sequence[str],
          shape: Sequence[int] | Sequence[Sequence[int]], kind: str = 'reshape',
          expert: int | None = None) -> TensorRule:
  paths = (path,) if isinstance(path, str) else tuple(path)
  shapes = (tuple(shape),) if isinstance(path, str) else tuple(tuple(s) for s in shape)
  return TensorRule(hf_name, tuple(hf_shape), paths, shapes, kind, expert)


def tensor_rules(kwargs: Mapping[str, Any], *, family: str, tied: bool,
                 prefix: str = '') -> list[TensorRule]:
  """Every tensor of a `family` checkpoint of transformer_lm(**kwargs), in
  the model's order. `tied`: the output projection reads the embedding (a
  model that ties its embeddings, `tie_embeddings`, has no rule for it).
  `prefix`: GPT-2's names with ('transformer.') or without ('') the prefix
  of GPT2LMHeadModel."""
  k, blocks = resolved(kwargs), block_paths(kwargs)
  rules = _gpt2_rules(k, blocks, prefix) if family == 'gpt2' else _llama_rules(k, blocks)
  embedding = rules[0]
  head = rules[-1]
  if k['tie_embeddings']:  # the model's softmax reads the embedding: no tensor of its own
    return rules[:-1]
  if tied:  # the output projection is the embedding, transposed
    rules[-1] = dataclasses.replace(head, hf_name=embedding.hf_name,
                                    hf_shape=embedding.hf_shape)
  return rules


def block_paths(kwargs: Mapping[str, Any]) -> list[str]:
  """Each block's path prefix in transformer_lm(**kwargs), as the model names
  them ('lm/stack/block_000/', ...; a one-layer stack's block is 'lm/stack/block/')."""
  from layout_core.convert.hf_config import lm_params  # pylint: disable=g-import-not-at-top
  lm = lm_params(kwargs)
  stack = lm.sub[1]
  return [f'{lm.name}/{stack.name}/{name}/' for name in stack.cls.child_params(stack)]


def _llama_rules(k: Mapping[str, Any], blocks: list[str]) -> list[TensorRule]:
  """Llama, Mistral and Qwen2 name their tensors alike (Mixtral and
  Qwen2-MoE too, but for their routed blocks' feed-forward layers)."""
  V, D, F = k['vocab_size'], k['model_dim'], k['ffn_dim']  # pylint: disable=invalid-name
  H, G, K = k['num_heads'], k['num_kv_heads'], k['head_dim']  # pylint: disable=invalid-name
  rules = [_rule('model.embed_tokens.weight', [V, D], 'lm/emb/table', [V, D])]
  for i, mg in enumerate(blocks):
    hf = f'model.layers.{i}.'
    rules.append(_rule(hf + 'input_layernorm.weight', [D], mg + 'ln_attn/scale', [D]))
    for name, heads in (('q', H), ('k', G), ('v', G)):
      rules.append(_rule(hf + f'self_attn.{name}_proj.weight', [heads * K, D],
                         mg + f'attn/w{name}', [D, heads, K], 'linear'))
      if k['qkv_bias']:
        rules.append(_rule(hf + f'self_attn.{name}_proj.bias', [heads * K],
                           mg + f'attn/b{name}', [heads, K]))
    rules.append(_rule(hf + 'self_attn.o_proj.weight', [D, H * K], mg + 'attn/wo', [H, K, D],
                       'linear'))
    if k['attention_out_bias']:
      rules.append(_rule(hf + 'self_attn.o_proj.bias', [D], mg + 'attn/bo', [D]))
    rules.append(_rule(hf + 'post_attention_layernorm.weight', [D], mg + 'ln_ffn/scale', [D]))
    if k['moe'] is not None and (i + 1) % k['moe_every'] == 0:
      rules += _moe_rules(k, hf, mg)
      continue
    for name, out, in_, path, shape in (('gate', F, D, 'w_gate', [D, F]),
                                        ('up', F, D, 'w_up', [D, F]),
                                        ('down', D, F, 'w_down', [F, D])):
      rules.append(_rule(hf + f'mlp.{name}_proj.weight', [out, in_], mg + f'ffn/{path}', shape,
                         'linear'))
      if k['ffn_bias']:
        rules.append(_rule(hf + f'mlp.{name}_proj.bias', [out], mg + f'ffn/b{path[1:]}', [out]))
  rules.append(_rule('model.norm.weight', [D], 'lm/final_ln/scale', [D]))
  rules.append(_rule('lm_head.weight', [V, D], 'lm/softmax/w', [D, V], 'linear'))
  return rules


def _moe_rules(k: Mapping[str, Any], hf: str, mg: str) -> list[TensorRule]:
  """A routed block's feed-forward tensors: Mixtral's block_sparse_moe (the
  router `gate`, experts' w1 | w3 | w2 = gate | up | down), or Qwen2-MoE's
  mlp (the router `gate`, experts' gate_proj | up_proj | down_proj, the
  shared expert and its gate)."""
  moe, D = k['moe'], k['model_dim']  # pylint: disable=invalid-name
  E, F = moe['num_experts'], moe['expert_dim']  # pylint: disable=invalid-name
  mixtral = not moe['shared_dim']
  hf += 'block_sparse_moe.' if mixtral else 'mlp.'
  names = (('w1', 'w3', 'w2') if mixtral else ('gate_proj', 'up_proj', 'down_proj'))
  rules = [_rule(hf + 'gate.weight', [E, D], mg + 'moe/router', [D, E], 'linear')]
  for e in range(E):
    for name, path, out, in_ in zip(names, ('w_gate', 'w_up', 'w_down'), (F, F, D),
                                    (D, D, F)):
      rules.append(_rule(hf + f'experts.{e}.{name}.weight', [out, in_], mg + f'moe/{path}',
                         [E, in_, out], 'linear', expert=e))
  if not mixtral:
    S = moe['shared_dim']  # pylint: disable=invalid-name
    for name, path, out, in_ in zip(names, ('w_gate', 'w_up', 'w_down'), (S, S, D), (D, D, S)):
      rules.append(_rule(hf + f'shared_expert.{name}.weight', [out, in_],
                         mg + f'moe/shared/{path}', [in_, out], 'linear'))
    rules.append(_rule(hf + 'shared_expert_gate.weight', [1, D], mg + 'moe/shared_gate',
                       [D, 1], 'linear'))
  return rules


def _gpt2_rules(k: Mapping[str, Any], blocks: list[str], prefix: str) -> list[TensorRule]:
  """GPT-2: Conv1D weights are [in, out]; c_attn holds q | k | v."""
  V, D, F, L = k['vocab_size'], k['model_dim'], k['ffn_dim'], k['max_len']  # pylint: disable=invalid-name
  H, K = k['num_heads'], k['head_dim']  # pylint: disable=invalid-name
  rules = [_rule(prefix + 'wte.weight', [V, D], 'lm/emb/table', [V, D]),
           _rule(prefix + 'wpe.weight', [L, D], 'lm/emb/pos_table', [L, D])]
  for i, mg in enumerate(blocks):
    hf = f'{prefix}h.{i}.'
    rules += [
        _rule(hf + 'ln_1.weight', [D], mg + 'ln_attn/scale', [D]),
        _rule(hf + 'ln_1.bias', [D], mg + 'ln_attn/bias', [D]),
        _rule(hf + 'attn.c_attn.weight', [D, 3 * H * K],
              [mg + 'attn/wq', mg + 'attn/wk', mg + 'attn/wv'], [[D, H, K]] * 3),
        _rule(hf + 'attn.c_attn.bias', [3 * H * K],
              [mg + 'attn/bq', mg + 'attn/bk', mg + 'attn/bv'], [[H, K]] * 3),
        _rule(hf + 'attn.c_proj.weight', [H * K, D], mg + 'attn/wo', [H, K, D]),
        _rule(hf + 'attn.c_proj.bias', [D], mg + 'attn/bo', [D]),
        _rule(hf + 'ln_2.weight', [D], mg + 'ln_ffn/scale', [D]),
        _rule(hf + 'ln_2.bias', [D], mg + 'ln_ffn/bias', [D]),
        _rule(hf + 'mlp.c_fc.weight', [D, F], mg + 'ffn/w_in', [D, F]),
        _rule(hf + 'mlp.c_fc.bias', [F], mg + 'ffn/b_in', [F]),
        _rule(hf + 'mlp.c_proj.weight', [F, D], mg + 'ffn/w_out', [F, D]),
        _rule(hf + 'mlp.c_proj.bias', [D], mg + 'ffn/b_out', [D]),
    ]
  rules += [_rule(prefix + 'ln_f.weight', [D], 'lm/final_ln/scale', [D]),
            _rule(prefix + 'ln_f.bias', [D], 'lm/final_ln/bias', [D]),
            _rule('lm_head.weight', [V, D], 'lm/softmax/w', [D, V], 'linear')]
  return rules


def gpt2_prefix(names: Sequence[str]) -> str:
  """'transformer.' when a GPT-2 checkpoint's names carry GPT2LMHeadModel's prefix, else ''."""
  return 'transformer.' if any(n.startswith('transformer.') for n in names) else ''


def is_ignored(name: str, family: str) -> bool:
  """Whether `name` is a buffer a checkpoint of `family` may hold (not a weight)."""
  patterns = IGNORED['gpt2' if family == 'gpt2' else 'llama']
  return any(re.fullmatch(p, name) for p in patterns)


def variable_shapes(rules: Sequence[TensorRule]) -> dict[str, Shape]:
  """path -> shape of every meshgin variable the rules fill."""
  return {path: shape for rule in rules for path, shape in zip(rule.paths, rule.shapes)}
