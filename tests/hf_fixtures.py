"""Tiny Hugging Face checkpoints of each family, written as transformers writes them.

    write_checkpoint(str(tmp_path / 'llama'), 'llama')        # config.json, model.safetensors,
                                                             # tokenizer.json, tokenizer_config.json
    write_checkpoint(path, 'qwen2', shards=2)                # + model.safetensors.index.json
    write_checkpoint(path, 'llama', dtype='bfloat16')

The tensors are random and named, shaped and laid out as Hugging Face's own
classes name, shape and lay them out (nn.Linear weights [out, in], GPT-2's
Conv1D [in, out] with c_attn = q | k | v): spelled out here from
transformers' modeling files, independently of meshgin's tables in
`layout_core.convert.hf_names`, so the tests compare the two. The configs
are transformers' saved fields for each family, at sizes a test runs in
seconds: 2 layers, model width 32, vocabulary 96, grouped-query attention
(4 query heads, 2 kv heads) for Llama, Mistral and Qwen2. Llama uses
rms_norm_eps 1e-6 (KerasHub's Llama conversion ignores the field and uses
1e-6), Llama 3 RoPE scaling, and untied embeddings; Qwen2 ties them; Mistral
has a head_dim other than hidden_size / heads and a sliding window of 4
tokens, shorter than the tests' sequences (KerasHub's banded mask is then
the reference for meshgin's); GPT-2 names its tensors
without the `transformer.` prefix, as the hub's gpt2 files do.

Mistral's weights are float16 values (stored as float32): KerasHub 0.32's
Mistral conversion casts every weight to float16, which is then exact, so
the comparison with it measures the models, not that cast (measured: with
other float32 weights the logits differ by 1.4e-3 of their scale, from the
first position on).
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np

VOCAB = 96
WORDS = ('the quick brown fox jumps over the lazy dog while a small model learns to '
         'count one two three four five six seven eight nine ten and then stops').split()

CONFIGS = {
    'llama': dict(
        architectures=['LlamaForCausalLM'], model_type='llama', vocab_size=VOCAB,
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, hidden_act='silu', max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=500000.0,
        rope_scaling=dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16),
        attention_bias=False, attention_dropout=0.0, mlp_bias=False, pretraining_tp=1,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.02,
        use_cache=True, torch_dtype='float32', transformers_version='4.46.0'),
    'mistral': dict(
        architectures=['MistralForCausalLM'], model_type='mistral', vocab_size=VOCAB,
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, hidden_act='silu', max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=4, attention_dropout=0.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.02,
        use_cache=True, torch_dtype='float32', transformers_version='4.46.0'),
    'qwen2': dict(
        architectures=['Qwen2ForCausalLM'], model_type='qwen2', vocab_size=VOCAB,
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, hidden_act='silu', max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, use_sliding_window=False,
        sliding_window=128, max_window_layers=2, attention_dropout=0.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.02,
        use_cache=True, torch_dtype='float32', transformers_version='4.46.0'),
    # Mixtures of experts: Mixtral (every block routed, 4 experts, top 2) and
    # Qwen2-MoE (4 experts of width 24, top 2 not renormalised, a gated shared
    # expert; every block routed: KerasHub 0.32's conversion fails on Qwen2-MoE's
    # dense blocks, so decoder_sparse_step 2 is tested without it).
    'mixtral': dict(
        architectures=['MixtralForCausalLM'], model_type='mixtral', vocab_size=VOCAB,
        hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, hidden_act='silu', max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, attention_dropout=0.0,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=False,
        router_aux_loss_coef=0.02, router_jitter_noise=0.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, initializer_range=0.02, use_cache=True,
        torch_dtype='float32', transformers_version='4.46.0'),
    'qwen2_moe': dict(
        architectures=['Qwen2MoeForCausalLM'], model_type='qwen2_moe', vocab_size=VOCAB,
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, hidden_act='silu', max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, use_sliding_window=False,
        sliding_window=None, max_window_layers=2, attention_dropout=0.0,
        decoder_sparse_step=1, moe_intermediate_size=24, shared_expert_intermediate_size=48,
        num_experts_per_tok=2, num_experts=4, norm_topk_prob=False, output_router_logits=False,
        router_aux_loss_coef=0.001, mlp_only_layers=[], tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, initializer_range=0.02, use_cache=True,
        torch_dtype='float32', transformers_version='4.46.0'),
    'gpt2': dict(
        architectures=['GPT2LMHeadModel'], model_type='gpt2', vocab_size=VOCAB, n_embd=32,
        n_head=4, n_layer=2, n_positions=64, n_ctx=64, n_inner=None,
        activation_function='gelu_new', layer_norm_epsilon=1e-5, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, scale_attn_weights=True, bos_token_id=1,
        eos_token_id=2, initializer_range=0.02, summary_type='cls_index', use_cache=True,
        torch_dtype='float32', transformers_version='4.46.0'),
}


def config(family: str, **changes) -> dict:
  """A copy of the family's config.json fields, with `changes`."""
  return {**copy.deepcopy(CONFIGS[family]), **changes}


def state_dict(cfg: dict, *, seed: int = 0) -> dict[str, np.ndarray]:
  """Random weights under transformers' names and shapes for `cfg` (float32)."""
  rng = np.random.default_rng(seed)

  # KerasHub reads Mistral's weights as float16 (module doc): give it float16 values.
  exact = np.float16 if cfg['model_type'] == 'mistral' else np.float32

  def w(*shape, scale=0.2):
    return (rng.standard_normal(shape) * scale).astype(exact).astype(np.float32)

  def norm(n):
    return (1.0 + rng.standard_normal(n) * 0.1).astype(exact).astype(np.float32)

  tensors = {}
  if cfg['model_type'] == 'gpt2':
    d, v, n = cfg['n_embd'], cfg['vocab_size'], cfg['n_positions']
    f = cfg['n_inner'] or 4 * d
    tensors['wte.weight'], tensors['wpe.weight'] = w(v, d), w(n, d, scale=0.05)
    for i in range(cfg['n_layer']):
      h = f'h.{i}.'
      tensors.update({
          h + 'ln_1.weight': norm(d), h + 'ln_1.bias': w(d, scale=0.05),
          h + 'attn.c_attn.weight': w(d, 3 * d), h + 'attn.c_attn.bias': w(3 * d, scale=0.05),
          h + 'attn.c_proj.weight': w(d, d), h + 'attn.c_proj.bias': w(d, scale=0.05),
          h + 'ln_2.weight': norm(d), h + 'ln_2.bias': w(d, scale=0.05),
          h + 'mlp.c_fc.weight': w(d, f), h + 'mlp.c_fc.bias': w(f, scale=0.05),
          h + 'mlp.c_proj.weight': w(f, d), h + 'mlp.c_proj.bias': w(d, scale=0.05),
          # The causal-mask buffer older GPT-2 files carry: not a weight.
          h + 'attn.bias': np.tril(np.ones((n, n), np.float32))[None, None],
      })
    tensors['ln_f.weight'], tensors['ln_f.bias'] = norm(d), w(d, scale=0.05)
    if not cfg.get('tie_word_embeddings', True):
      tensors['lm_head.weight'] = w(v, d)
    return tensors
  d, v, f = cfg['hidden_size'], cfg['vocab_size'], cfg['intermediate_size']
  heads, kv = cfg['num_attention_heads'], cfg['num_key_value_heads']
  k = cfg.get('head_dim') or d // heads
  qwen = cfg['model_type'] in ('qwen2', 'qwen2_moe')
  qkv_bias = qwen or cfg.get('attention_bias', False)
  out_bias = not qwen and cfg.get('attention_bias', False)
  mlp_bias = cfg.get('mlp_bias', False)
  tensors['model.embed_tokens.weight'] = w(v, d)
  for i in range(cfg['num_hidden_layers']):
    p = f'model.layers.{i}.'
    tensors[p + 'input_layernorm.weight'] = norm(d)
    tensors[p + 'post_attention_layernorm.weight'] = norm(d)
    for name, rows in (('q', heads * k), ('k', kv * k), ('v', kv * k)):
      tensors[p + f'self_attn.{name}_proj.weight'] = w(rows, d)
      if qkv_bias:
        tensors[p + f'self_attn.{name}_proj.bias'] = w(rows, scale=0.1)
    tensors[p + 'self_attn.o_proj.weight'] = w(d, heads * k)
    if out_bias:
      tensors[p + 'self_attn.o_proj.bias'] = w(d, scale=0.1)
    if cfg['model_type'] == 'mixtral':  # MixtralSparseMoeBlock: gate, experts.e.w1/w3/w2
      tensors[p + 'block_sparse_moe.gate.weight'] = w(cfg['num_local_experts'], d, scale=0.5)
      for e in range(cfg['num_local_experts']):
        for name, shape in (('w1', (f, d)), ('w3', (f, d)), ('w2', (d, f))):
          tensors[p + f'block_sparse_moe.experts.{e}.{name}.weight'] = w(*shape)
      continue
    if cfg['model_type'] == 'qwen2_moe' and (i + 1) % cfg['decoder_sparse_step'] == 0:
      m, s = cfg['moe_intermediate_size'], cfg['shared_expert_intermediate_size']
      tensors[p + 'mlp.gate.weight'] = w(cfg['num_experts'], d, scale=0.5)
      for e in range(cfg['num_experts']):
        for name, shape in (('gate', (m, d)), ('up', (m, d)), ('down', (d, m))):
          tensors[p + f'mlp.experts.{e}.{name}_proj.weight'] = w(*shape)
      for name, shape in (('gate', (s, d)), ('up', (s, d)), ('down', (d, s))):
        tensors[p + f'mlp.shared_expert.{name}_proj.weight'] = w(*shape)
      tensors[p + 'mlp.shared_expert_gate.weight'] = w(1, d)
      continue
    for name, shape in (('gate', (f, d)), ('up', (f, d)), ('down', (d, f))):
      tensors[p + f'mlp.{name}_proj.weight'] = w(*shape)
      if mlp_bias:
        tensors[p + f'mlp.{name}_proj.bias'] = w(shape[0], scale=0.1)
  tensors['model.norm.weight'] = norm(d)
  if not cfg.get('tie_word_embeddings', False):
    tensors['lm_head.weight'] = w(v, d)
  return tensors


# A chat model's template in the style of Llama 3's: each turn ends with the
# special token <|eot|>, not with the tokenizer's eos_token </s>.
CHAT_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot|>"
                 "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")


def write_tokenizer(directory: str, *, vocab_size: int = VOCAB - 8, chat: bool = False) -> None:
  """A word-piece BPE trained on WORDS, saved as tokenizer.json (+ tokenizer_config.json);
  `chat`: with the special tokens <|start|> and <|eot|> and CHAT_TEMPLATE."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tokenizer = Tokenizer(models.BPE(unk_token='<unk>'))
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
  tokenizer.decoder = decoders.Metaspace()
  specials = ['<unk>', '<s>', '</s>'] + (['<|start|>', '<|eot|>'] if chat else [])
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                show_progress=False)
  tokenizer.train_from_iterator([' '.join(WORDS)] * 4, trainer=trainer)
  tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>',
               'tokenizer_class': 'PreTrainedTokenizerFast',
               **({'chat_template': CHAT_TEMPLATE} if chat else {})}, f, indent=2)


def write_checkpoint(directory: str, family: str, *, cfg: dict | None = None, seed: int = 0,
                     shards: int = 1, dtype: str = 'float32', tokenizer: bool | str = True,
                     tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
  """Writes a `family` checkpoint into `directory` as save_pretrained does
  (config.json, model.safetensors or `shards` shards and their index, the
  tokenizer, with a chat template if `tokenizer` is 'chat'); returns its
  tensors (float32, before any bfloat16 rounding)."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  cfg = cfg if cfg is not None else config(family)
  tensors = tensors if tensors is not None else state_dict(cfg, seed=seed)
  stored = tensors
  if dtype == 'bfloat16':
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    stored = {n: t.astype(ml_dtypes.bfloat16) for n, t in tensors.items()}
    tensors = {n: t.astype(np.float32) for n, t in stored.items()}
  cfg = {**cfg, 'torch_dtype': dtype}
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(cfg, f, indent=2)
  names = list(stored)
  if shards == 1:
    save_file(stored, os.path.join(directory, 'model.safetensors'), metadata={'format': 'pt'})
  else:
    weight_map = {}
    for s in range(shards):
      file_name = f'model-{s + 1:05d}-of-{shards:05d}.safetensors'
      part = {n: stored[n] for n in names[s::shards]}
      save_file(part, os.path.join(directory, file_name), metadata={'format': 'pt'})
      weight_map.update({n: file_name for n in part})
    with open(os.path.join(directory, 'model.safetensors.index.json'), 'w') as f:
      json.dump({'metadata': {'total_size': sum(t.nbytes for t in stored.values())},
                 'weight_map': weight_map}, f, indent=2)
  if tokenizer:
    write_tokenizer(directory, chat=tokenizer == 'chat')
  return tensors
