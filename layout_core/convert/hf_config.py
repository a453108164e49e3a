"""A Hugging Face `config.json` <-> the `transformer_lm` keyword arguments.

    kwargs, facts = lm_kwargs_from_hf(json.load(open('llama/config.json')),
                                      source='llama/config.json')
    kwargs['norm'], kwargs['ffn'], kwargs['num_kv_heads']   # 'rms', 'swiglu', 8
    facts.family, facts.tied                                # 'llama', False
    config = hf_config_from_lm(kwargs, tied=False)          # config.json again

Six families, told apart by `model_type`: 'llama', 'mistral', 'qwen2'
(RMSNorm, RoPE, SwiGLU, grouped-query attention), 'gpt2' (LayerNorm,
learned positions, a GELU MLP, every bias) and the mixtures of experts
'mixtral' (Mistral's blocks, each feed-forward layer routed: top-k of E
SwiGLU experts, the k weights renormalised) and 'qwen2_moe' (Qwen2's
blocks, every `decoder_sparse_step`-th routed, with a gated shared expert).
An MoE model's kwargs hold `moe`, the keyword arguments of
`moe_feed_forward` as a dict (JSON, like the rest); `lm_params(kwargs)`
makes the Params. A field meshgin does not
implement is refused only when it would change what the model computes (a
Qwen2 sliding window, experts in another family, another RoPE scaling, an
activation other than the family's), with a ConfigError that names the
field, its value and the file: an import never yields a model that computes
something else than the checkpoint's. A field missing from the file takes
the default Hugging Face's config class gives it.

Tied input and output embeddings (`facts.tied`: the checkpoint has one
matrix for both) become a tied model, `tie_embeddings=True` in the kwargs.
The inverse writes `tie_word_embeddings` true for a tied model, or as the
export decides (`tied`: an untied model whose matrices are still equal).

Nothing here imports TensorFlow (`layout_core.model.lm` does not either).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping

from layout_core.errors import ConfigError
from layout_core.model.lm import (ROPE_SCALING_KEYS, moe_feed_forward_params,
                                  transformer_lm_params)

FAMILIES = ('llama', 'mistral', 'qwen2', 'gpt2', 'mixtral', 'qwen2_moe')
MOE_FAMILIES = ('mixtral', 'qwen2_moe')
# moe_feed_forward's arguments that change training only (an import's are a
# starting point the user may rebind).
MOE_TRAINING = ('aux_loss_coef', 'z_loss_coef', 'capacity_factor')

# transformer_lm's defaults (from its signature): they fill what a run's kwargs
# leave out, for the inverse.
LM_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(transformer_lm_params).parameters.items()
    if parameter.default is not inspect.Parameter.empty}
# Fields that give a model experts (mixture of experts), in any family's spelling.
_EXPERT_FIELDS = ('num_local_experts', 'num_experts', 'num_experts_per_tok',
                  'n_routed_experts', 'moe_intermediate_size')
# Hugging Face's activation names -> transformer_lm.activation of a GPT-2 MLP.
_GPT2_ACTIVATIONS = {'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh',
                     'gelu': 'gelu', 'relu': 'relu'}
_ARCHITECTURES = {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM',
                  'qwen2': 'Qwen2ForCausalLM', 'gpt2': 'GPT2LMHeadModel',
                  'mixtral': 'MixtralForCausalLM', 'qwen2_moe': 'Qwen2MoeForCausalLM'}
# moe_feed_forward's defaults (from its signature), for the inverse.
MOE_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(moe_feed_forward_params).parameters.items()}
# Fields an export carries over from the imported config.json when it has them.
KEPT_FIELDS = ('bos_token_id', 'eos_token_id', 'pad_token_id', 'resid_pdrop', 'embd_pdrop',
               'attn_pdrop')


@dataclasses.dataclass(frozen=True)
class HFFacts:
  """What an import needs beside the model's kwargs."""
  family: str           # 'llama', 'mistral', 'qwen2' or 'gpt2'
  tied: bool            # one matrix for the input embedding and the output projection
  dtype: str | None     # `torch_dtype` as written ('bfloat16'), None if absent


def _refuse(source: str, field: str, value: Any, why: str, fix: str) -> ConfigError:
  return ConfigError(f'{source}: {field} is {value!r}, {why}', where=f'{source}, field {field!r}',
                     fix=fix)


class _Fields:
  """The fields of one config.json, read with their Hugging Face defaults."""

  def __init__(self, config: Mapping[str, Any], source: str):
    self.config, self.source = config, source

  def required(self, *names: str) -> Any:
    """The first of `names` present (spellings of one field); ConfigError if none is."""
    for name in names:
      if self.config.get(name) is not None:
        return self.config[name]
    raise ConfigError(f'{self.source} has no {names[0]!r}', where=f'{self.source}, field '
                      f'{names[0]!r}', fix='give the config.json saved with the checkpoint '
                      '(save_pretrained writes every field)')

  def get(self, name: str, default: Any) -> Any:
    value = self.config.get(name)
    return default if value is None else value

  def positive_int(self, *names: str) -> int:
    value = self.required(*names)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise _refuse(self.source, names[0], value, 'not a positive integer',
                    'give the config.json saved with the checkpoint')
    return value

  def refuse_if(self, name: str, bad: bool, why: str, fix: str) -> None:
    if bad:
      raise _refuse(self.source, name, self.config.get(name), why, fix)


def lm_kwargs_from_hf(config: Mapping[str, Any], *, source: str = 'config.json'
                      ) -> tuple[dict[str, Any], HFFacts]:
  """(transformer_lm kwargs, HFFacts) of a Hugging Face config; ConfigError
  for a family or a field meshgin does not implement (module doc)."""
  fields = _Fields(config, source)
  family = config.get('model_type')
  if family not in FAMILIES:
    raise _refuse(source, 'model_type', family, 'a model family meshgin cannot import',
                  f"import one of {', '.join(map(repr, FAMILIES))} (Llama 2/3, Mistral, Qwen2, "
                  'GPT-2, Mixtral, Qwen2-MoE checkpoints)')
  for name in _EXPERT_FIELDS if family not in MOE_FAMILIES else ():
    value = config.get(name)
    fields.refuse_if(name, value not in (None, 0, 1, False),
                     f'a mixture of experts in a {family} config, which meshgin does not '
                     'implement', "import a dense checkpoint, or a 'mixtral' or 'qwen2_moe' one")
  dtype = config.get('torch_dtype', config.get('dtype'))
  if family == 'gpt2':
    kwargs, tied = _gpt2_kwargs(fields)
  else:
    kwargs, tied = _llama_kwargs(fields, family)
  if family in MOE_FAMILIES:
    kwargs.update(_moe_kwargs(fields, family))
  return kwargs, HFFacts(family=family, tied=tied, dtype=dtype if isinstance(dtype, str) else None)


def _llama_kwargs(fields: _Fields, family: str) -> tuple[dict[str, Any], bool]:
  """Llama, Mistral and Qwen2: the same layers, different bias and window fields."""
  config = fields.config
  model_dim = fields.positive_int('hidden_size')
  num_heads = fields.positive_int('num_attention_heads')
  num_kv_heads = fields.get('num_key_value_heads', num_heads)
  head_dim = fields.get('head_dim', model_dim // num_heads)
  fields.refuse_if('num_key_value_heads', not isinstance(num_kv_heads, int) or num_kv_heads < 1
                   or num_heads % num_kv_heads, f'which does not divide num_attention_heads '
                   f'{num_heads}', 'give the config.json saved with the checkpoint')
  activation = fields.get('hidden_act', 'silu')
  fields.refuse_if('hidden_act', activation != 'silu',
                   "not 'silu': meshgin's gated feed-forward for this family is SwiGLU",
                   "import a checkpoint whose hidden_act is 'silu'")
  max_len = fields.positive_int('max_position_embeddings')
  window = 0  # transformer_lm.sliding_window: 0 attends to the whole context
  if family in ('mistral', 'mixtral'):
    # absent: MistralConfig's default (4096; MixtralConfig's: none); null: none
    window = config.get('sliding_window', 4096 if family == 'mistral' else None)
    fields.refuse_if('sliding_window', window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1),
                     'not a positive number of tokens or null',
                     'give the config.json saved with the checkpoint')
    window = window or 0
  if family in ('qwen2', 'qwen2_moe'):
    fields.refuse_if('use_sliding_window', bool(config.get('use_sliding_window')),
                     'a sliding-window attention meshgin does not implement',
                     'import a checkpoint with use_sliding_window false')
    layer_types = config.get('layer_types') or []
    fields.refuse_if('layer_types', any(t != 'full_attention' for t in layer_types),
                     'not all full attention', 'import a checkpoint of full-attention layers')
  theta, scaling = _rope(fields)
  attention_bias = bool(fields.get('attention_bias', False))
  qwen = family in ('qwen2', 'qwen2_moe')
  qkv_bias = True if qwen else attention_bias
  kwargs = dict(
      vocab_size=fields.positive_int('vocab_size'), model_dim=model_dim, num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim,
      ffn_dim=fields.positive_int('intermediate_size'),
      num_layers=fields.positive_int('num_hidden_layers'), max_len=max_len,
      norm='rms', norm_epsilon=float(fields.get('rms_norm_eps', 1e-6)),
      positions='rope', rope_theta=theta, rope_scaling=scaling, ffn='swiglu',
      qkv_bias=qkv_bias, attention_out_bias=attention_bias if not qwen else False,
      ffn_bias=bool(fields.get('mlp_bias', False)) if family == 'llama' else False,
      output_bias=False, **({'sliding_window': window} if window else {}))
  return _tie(kwargs, bool(fields.get('tie_word_embeddings', False)))


def _moe_kwargs(fields: _Fields, family: str) -> dict[str, Any]:
  """transformer_lm's `moe` (moe_feed_forward's arguments, a dict) and
  `moe_every` of a Mixtral or Qwen2-MoE config."""
  config = fields.config
  if family == 'mixtral':
    experts = fields.positive_int('num_local_experts')
    moe = dict(num_experts=experts, experts_per_token=fields.positive_int('num_experts_per_tok'),
               expert_dim=fields.positive_int('intermediate_size'), normalize_top_k=True,
               aux_loss_coef=float(fields.get('router_aux_loss_coef', 0.02)))
    return {'moe': moe, 'moe_every': 1}
  fields.refuse_if('mlp_only_layers', bool(config.get('mlp_only_layers')),
                   'dense layers chosen by index, which meshgin does not implement '
                   '(transformer_lm.moe_every routes every n-th block)',
                   'import a checkpoint whose mlp_only_layers is empty')
  shared = int(fields.get('shared_expert_intermediate_size', 0))
  moe = dict(num_experts=fields.positive_int('num_experts'),
             experts_per_token=fields.positive_int('num_experts_per_tok'),
             expert_dim=fields.positive_int('moe_intermediate_size'),
             normalize_top_k=bool(fields.get('norm_topk_prob', False)), shared_dim=shared,
             aux_loss_coef=float(fields.get('router_aux_loss_coef', 0.001)))
  return {'moe': moe, 'moe_every': fields.positive_int('decoder_sparse_step')}


def lm_params(kwargs: Mapping[str, Any]):
  """transformer_lm's Params of `kwargs`, an MoE model's `moe` dict made
  moe_feed_forward's Params."""
  moe = kwargs.get('moe')
  if isinstance(moe, Mapping):
    kwargs = {**kwargs, 'moe': moe_feed_forward_params(**moe)}
  return transformer_lm_params(**kwargs)


def _rope(fields: _Fields) -> tuple[float, dict | None]:
  """(rope_theta, rope_scaling) from `rope_theta` and `rope_scaling`, or
  transformers 5's `rope_parameters` holding both."""
  parameters = fields.config.get('rope_parameters') or {}
  theta = float(parameters.get('rope_theta', fields.get('rope_theta', 10000.0)))
  name = 'rope_scaling' if fields.config.get('rope_scaling') is not None else 'rope_parameters'
  scaling = fields.config.get('rope_scaling') or parameters or None
  if scaling is None:
    return theta, None
  kind = scaling.get('rope_type', scaling.get('type', 'default'))
  if kind == 'default':
    return theta, None
  fields.refuse_if(name, kind != 'llama3', f"a RoPE scaling of type {kind!r}: meshgin "
                   "implements Llama 3's ('llama3') only",
                   "import a checkpoint whose rope_scaling is null or of rope_type 'llama3'")
  missing = [k for k in ROPE_SCALING_KEYS if k not in scaling]
  fields.refuse_if(name, bool(missing), f'missing {missing}',
                   'give the config.json saved with the checkpoint')
  return theta, {k: (int(scaling[k]) if k == 'original_max_position_embeddings'
                     else float(scaling[k])) for k in ROPE_SCALING_KEYS}


def _gpt2_kwargs(fields: _Fields) -> tuple[dict[str, Any], bool]:
  model_dim = fields.positive_int('n_embd', 'hidden_size')
  activation = fields.get('activation_function', 'gelu_new')
  fields.refuse_if('activation_function', activation not in _GPT2_ACTIVATIONS,
                   'an activation meshgin does not implement',
                   f"import a checkpoint whose activation_function is one of "
                   f"{', '.join(map(repr, _GPT2_ACTIVATIONS))}")
  for name, default in (('scale_attn_by_inverse_layer_idx', False),
                        ('reorder_and_upcast_attn', False), ('add_cross_attention', False)):
    fields.refuse_if(name, bool(fields.get(name, default)),
                     'a variant of GPT-2 attention meshgin does not implement',
                     f'import a checkpoint with {name} false')
  fields.refuse_if('scale_attn_weights', not fields.get('scale_attn_weights', True),
                   'unscaled attention, which meshgin does not implement',
                   'import a checkpoint with scale_attn_weights true')
  kwargs = dict(
      vocab_size=fields.positive_int('vocab_size'), model_dim=model_dim,
      num_heads=fields.positive_int('n_head', 'num_attention_heads'),
      ffn_dim=int(fields.get('n_inner', 4 * model_dim)),
      num_layers=fields.positive_int('n_layer', 'num_hidden_layers'),
      max_len=fields.positive_int('n_positions', 'max_position_embeddings'),
      activation=_GPT2_ACTIVATIONS[activation], norm='layer',
      norm_epsilon=float(fields.get('layer_norm_epsilon', 1e-5)), positions='learned',
      ffn='mlp', qkv_bias=True, attention_out_bias=True, ffn_bias=True, output_bias=False)
  return _tie(kwargs, bool(fields.get('tie_word_embeddings', True)))


def _tie(kwargs: dict[str, Any], tied: bool) -> tuple[dict[str, Any], bool]:
  """(kwargs, tied), kwargs tying the model's embeddings where the checkpoint's are."""
  return ({**kwargs, 'tie_embeddings': True} if tied else kwargs), tied


# -- the inverse --------------------------------------------------------------------------
def resolved(kwargs: Mapping[str, Any]) -> dict[str, Any]:
  """`kwargs` with transformer_lm's defaults filled in and its 0 / None
  meaning spelt out (num_kv_heads, head_dim, ffn_bias)."""
  full = {**LM_DEFAULTS, **kwargs}
  if full['moe'] is not None:
    full['moe'] = {**MOE_DEFAULTS, **full['moe']}
    full['moe']['expert_dim'] = full['moe']['expert_dim'] or full['ffn_dim']
  full['num_kv_heads'] = full['num_kv_heads'] or full['num_heads']
  full['head_dim'] = full['head_dim'] or full['model_dim'] // full['num_heads']
  if full['ffn_bias'] is None:
    full['ffn_bias'] = full['ffn'] == 'mlp'
  return full


def family_of(kwargs: Mapping[str, Any]) -> str:
  """The Hugging Face family that computes what transformer_lm(**kwargs)
  computes: 'gpt2', 'qwen2' or 'llama' (which also covers Mistral);
  ConfigError naming the first argument no family has."""
  k = resolved(kwargs)

  def refuse(name: str, why: str) -> ConfigError:
    return ConfigError(f'transformer_lm.{name} is {k[name]!r}: {why}, so the model has no '
                       'Hugging Face config.json', where=f'transformer_lm.{name}',
                       fix='export it in meshgin\'s own format (launch.export without '
                           '--format=hf)')
  if k['output_bias']:
    raise refuse('output_bias', 'no Llama, Qwen2 or GPT-2 has a bias on the output logits')
  if k['sliding_window'] and (k['norm'] == 'layer' or k['qkv_bias'] or k['ffn_bias']):
    raise refuse('sliding_window', 'of the families only Mistral (RMSNorm, no biases) has a '
                 'sliding window meshgin writes')
  if k['norm'] == 'layer':
    for name, want in (('positions', 'learned'), ('ffn', 'mlp'), ('qkv_bias', True),
                       ('attention_out_bias', True), ('ffn_bias', True)):
      if k[name] != want:
        raise refuse(name, f"a LayerNorm model is GPT-2, which has {name} = {want!r}")
    if k['num_kv_heads'] != k['num_heads'] or k['head_dim'] * k['num_heads'] != k['model_dim']:
      raise refuse('num_kv_heads', 'GPT-2 has num_heads heads of model_dim / num_heads')
    if k['activation'] not in _GPT2_ACTIVATIONS.values():
      raise refuse('activation', 'GPT-2 has no such activation')
    if not k['max_len']:
      raise refuse('max_len', 'GPT-2 has max_len learned positions')
    return 'gpt2'
  for name, want in (('norm', 'rms'), ('positions', 'rope'), ('ffn', 'swiglu')):
    if k[name] != want:
      raise refuse(name, f'an RMSNorm model is Llama or Qwen2, which have {name} = {want!r}')
  if k['moe'] is not None:
    return _moe_family(k, refuse)
  if k['qkv_bias'] and not k['attention_out_bias'] and not k['ffn_bias']:
    return 'qwen2'
  if k['qkv_bias'] != k['attention_out_bias']:
    raise refuse('attention_out_bias', 'Llama has biases on all of q, k, v and the output '
                 'or on none, and Qwen2 on q, k and v only, with no feed-forward bias')
  return 'llama'


def _moe_family(k: Mapping[str, Any], refuse) -> str:
  """'mixtral' or 'qwen2_moe' for a routed model; ConfigError naming the
  first argument neither has."""
  moe = k['moe']
  fixed = dict(kind='swiglu', router='softmax')  # (the losses, capacity: training only)
  for name, want in fixed.items():
    if moe[name] != want:
      raise ConfigError(f'moe_feed_forward.{name} is {moe[name]!r}: Mixtral and Qwen2-MoE '
                        f'have {want!r}, so the model has no Hugging Face config.json',
                        where=f'moe_feed_forward.{name}',
                        fix="export it in meshgin's own format (launch.export without "
                            '--format=hf)')
  if moe['shared_dim'] or k['qkv_bias']:
    if not (moe['shared_dim'] and moe['shared_gate'] and k['qkv_bias']
            and not k['attention_out_bias'] and not k['ffn_bias']):
      raise refuse('qkv_bias', 'Qwen2-MoE has q/k/v biases and a gated shared expert '
                   '(moe_feed_forward.shared_dim), Mixtral neither')
    return 'qwen2_moe'
  if k['moe_every'] != 1 or not moe['normalize_top_k'] or k['attention_out_bias'] \
      or k['ffn_bias']:
    raise refuse('moe_every', 'Mixtral routes every block, renormalises the top-k weights '
                 'and has no biases')
  return 'mixtral'


def hf_config_from_lm(kwargs: Mapping[str, Any], *, tied: bool, dtype: str = 'float32',
                      kept: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The config.json of transformer_lm(**kwargs) (`family_of` picks the
  family); `tied`: whether the weights written have no separate output
  matrix; `kept`: fields carried over (KEPT_FIELDS of the imported file)."""
  family = family_of(kwargs)
  k = resolved(kwargs)
  if family == 'llama' and not k['qkv_bias'] and not k['ffn_bias'] and (
      k['sliding_window'] or (kept and kept.get('model_type') == 'mistral')):
    family = 'mistral'  # an imported Mistral goes back as one (Llama's math, and a window)
  extra = {name: kept[name] for name in KEPT_FIELDS if kept and name in kept}
  common = dict(architectures=[_ARCHITECTURES[family]], model_type=family,
                vocab_size=k['vocab_size'], tie_word_embeddings=tied or k['tie_embeddings'],
                torch_dtype=dtype, **extra)
  if family == 'gpt2':
    activation = {v: n for n, v in reversed(_GPT2_ACTIVATIONS.items())}[k['activation']]
    return dict(common, n_embd=k['model_dim'], n_head=k['num_heads'], n_layer=k['num_layers'],
                n_positions=k['max_len'], n_ctx=k['max_len'],
                n_inner=None if k['ffn_dim'] == 4 * k['model_dim'] else k['ffn_dim'],
                activation_function=activation, layer_norm_epsilon=k['norm_epsilon'],
                scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                reorder_and_upcast_attn=False)
  if not k['max_len']:
    raise ConfigError('transformer_lm.max_len is 0 (no limit), but config.json needs '
                      'max_position_embeddings', where='transformer_lm.max_len',
                      fix='bind transformer_lm.max_len to the context the model was trained '
                          'for (--gin_bindings; with RoPE it changes no weight)')
  config = dict(common, hidden_size=k['model_dim'], intermediate_size=k['ffn_dim'],
                num_hidden_layers=k['num_layers'], num_attention_heads=k['num_heads'],
                num_key_value_heads=k['num_kv_heads'], head_dim=k['head_dim'],
                hidden_act='silu', max_position_embeddings=k['max_len'],
                rms_norm_eps=k['norm_epsilon'], rope_theta=k['rope_theta'],
                rope_scaling=(dict(rope_type='llama3', **k['rope_scaling'])
                              if k['rope_scaling'] else None),
                attention_dropout=0.0)
  if family in ('qwen2', 'qwen2_moe'):
    config = dict(config, use_sliding_window=False, sliding_window=None,
                  max_window_layers=k['num_layers'])
  if family == 'qwen2':
    return config
  if family == 'qwen2_moe':
    moe = k['moe']
    return dict(config, num_experts=moe['num_experts'],
                num_experts_per_tok=moe['experts_per_token'],
                moe_intermediate_size=moe['expert_dim'],
                shared_expert_intermediate_size=moe['shared_dim'],
                norm_topk_prob=moe['normalize_top_k'], decoder_sparse_step=k['moe_every'],
                mlp_only_layers=[], router_aux_loss_coef=moe['aux_loss_coef'],
                output_router_logits=False)
  if family == 'mixtral':
    moe = k['moe']
    return dict(config, intermediate_size=moe['expert_dim'],
                num_local_experts=moe['num_experts'],
                num_experts_per_tok=moe['experts_per_token'],
                router_aux_loss_coef=moe['aux_loss_coef'], output_router_logits=False,
                sliding_window=k['sliding_window'] or None)
  if family == 'mistral':
    return dict(config, sliding_window=k['sliding_window'] or None)
  return dict(config, attention_bias=k['qkv_bias'], mlp_bias=k['ffn_bias'])
