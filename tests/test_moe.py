"""Mixture of experts (`layout_core.model.moe`): the routed layer against
references written apart from it, its router terms against numpy, and
training on meshes that split the experts against one device.

References: numpy running each token through its k experts one by one; a
dense TensorFlow formulation that runs every expert on every token and
weights them (no dispatch, no capacity) for the gradients; numpy counts of
the router's loads and drops; the same model trained on one device.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from layout_core.checkpoint import manager as checkpoint_lib
from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer
from layout_core.errors import ConfigError
from layout_core.infer.decode import CachedLM
from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model.lm import moe_feed_forward_params, transformer_lm_params
from layout_core.model.moe import MoEFeedForward, capacity, collecting
from layout_core.optim import OptimizerConfig
from layout_core.pipeline import PipelineConfig
from layout_core.run import make_trainer
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig
from tests.conftest import train_trace
from tests.numerics import assert_close

D, H, E = 16, 12, 4
VARIANTS = {  # Mixtral, Qwen2-MoE (shared expert, no renormalisation), sigmoid + mlp
    'mixtral': dict(kind='swiglu'),
    'qwen2_moe': dict(kind='swiglu', normalize_top_k=False, shared_dim=20),
    'sigmoid_mlp': dict(kind='mlp', activation='gelu', router='sigmoid', experts_per_token=3),
}


def layer_of(**settings):
  p = MoEFeedForward.Params().Set(input_dim=D, hidden_dim=H, num_experts=E,
                                  **{'experts_per_token': 2, **settings})
  layer = p.Instantiate(parent_path='lm/stack/block_000')
  rng = np.random.default_rng(7)
  weights = {}
  for variable in layer.trainable_variables:
    value = rng.normal(0, 0.5, variable.shape).astype(np.float32)
    variable.assign(value)
    weights[variable.name[:-2].split('.moe.', 1)[1].replace('.', '/')] = value
  return layer, weights


def silu(v):
  return v / (1 + np.exp(-v))


def gelu(v):
  from scipy.special import erf  # pylint: disable=g-import-not-at-top
  return 0.5 * v * (1 + erf(v / np.sqrt(2)))


def numpy_expert(h, w, e, kind):
  if kind == 'mlp':
    return gelu(h @ w['w_in'][e]) @ w['w_out'][e]
  return (silu(h @ w['w_gate'][e]) * (h @ w['w_up'][e])) @ w['w_down'][e]


def numpy_moe(x, w, *, k, router='softmax', normalize_top_k=True, shared_dim=0, kind='swiglu',
              **_):
  """Each token through its k experts, one at a time."""
  logits = x @ w['router']
  if router == 'softmax':
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
  else:
    probs = 1 / (1 + np.exp(-logits))
  out = np.zeros_like(x)
  for index in np.ndindex(x.shape[:-1]):
    chosen = np.argsort(-probs[index])[:k]
    weights = probs[index][chosen]
    if normalize_top_k:
      weights = weights / weights.sum()
    for e, weight in zip(chosen, weights):
      out[index] += weight * numpy_expert(x[index], w, e, kind)
  if shared_dim:
    shared = (silu(x @ w['shared/w_gate']) * (x @ w['shared/w_up'])) @ w['shared/w_down']
    out += shared / (1 + np.exp(-(x @ w['shared_gate'])))
  return out, logits, probs


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_the_routed_layer_equals_numpy_running_each_tokens_experts(variant):
  settings = VARIANTS[variant]
  layer, w = layer_of(**settings)
  x = np.random.default_rng(1).normal(size=(3, 10, D)).astype(np.float32)
  expected, _, _ = numpy_moe(x, w, k=layer.params.experts_per_token, **settings)
  got = tf.function(layer)(tf.constant(x)).numpy()
  assert_close(got, expected, rel=2e-6, what=f'{variant} MoE vs numpy')


def dense_reference(layer, x):
  """Every expert on every token, weighted by the router's top k (TensorFlow,
  no dispatch, no capacity): the gradients' reference."""
  p = layer.params
  logits = tf.einsum('btd,de->bte', x, layer.router)
  probs = tf.nn.softmax(logits)
  chosen = tf.reduce_sum(tf.one_hot(tf.math.top_k(probs, p.experts_per_token).indices, E), 2)
  weights = probs * chosen
  weights /= tf.reduce_sum(weights, -1, keepdims=True)
  hidden = tf.nn.silu(tf.einsum('btd,edh->bteh', x, layer.w_gate)) * tf.einsum(
      'btd,edh->bteh', x, layer.w_up)
  return tf.einsum('bte,bted->btd', weights, tf.einsum('bteh,ehd->bted', hidden, layer.w_down))


def test_gradients_equal_the_dense_reference_of_every_expert():
  layer, _ = layer_of(kind='swiglu')
  x = tf.constant(np.random.default_rng(2).normal(size=(2, 8, D)).astype(np.float32))
  cotangent = tf.constant(np.random.default_rng(3).normal(size=(2, 8, D)).astype(np.float32))

  def gradients(fn):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.reduce_sum(fn(x) * cotangent)
    return tape.gradient(y, [x] + list(layer.trainable_variables))
  for got, expected, variable in zip(gradients(layer), gradients(lambda v: dense_reference(layer, v)),
                                     ['x'] + [v.name for v in layer.trainable_variables]):
    assert_close(got.numpy(), expected.numpy(), rel=2e-6, what=f'gradient of {variable}')


def numpy_terms(logits, probs, k):
  experts = probs.shape[-1]
  top = np.argsort(-probs, axis=-1)[..., :k].reshape(-1, k)
  share = np.bincount(top.ravel(), minlength=experts) / top.shape[0]       # f_e, sums to k
  aux = experts * np.sum(share * probs.reshape(-1, experts).mean(0))
  peak = logits.max(-1, keepdims=True)
  z = np.mean((np.log(np.exp(logits - peak).sum(-1)) + peak[..., 0]) ** 2)
  return aux, z, share / k


def test_the_router_terms_equal_numpy():
  layer, w = layer_of(kind='swiglu', aux_loss_coef=0.01, z_loss_coef=0.001)
  x = np.random.default_rng(4).normal(size=(4, 12, D)).astype(np.float32)
  _, logits, probs = numpy_moe(x, w, k=2)
  aux, z, load = numpy_terms(logits, probs, 2)
  with collecting() as terms:
    layer(tf.constant(x))
  (got,) = terms.layers.values()
  assert_close(float(got.aux_loss), aux, rel=1e-6, what='load-balancing loss')
  assert_close(float(got.z_loss), z, rel=1e-6, what='router z-loss')
  assert float(got.load_min) == pytest.approx(load.min(), abs=1e-7)
  assert float(got.load_max) == pytest.approx(load.max(), abs=1e-7)
  assert float(got.dropped) == 0.0
  # in the loss: a Mean loss gets coef x term per counted token
  from layout_core.tasks.objective import Mean, finish  # pylint: disable=g-import-not-at-top
  loss, metrics = finish(terms.added_to(Mean(tf.constant(6.0), tf.constant(3.0)), {}))
  assert_close(float(loss), 2.0 + 0.01 * aux + 0.001 * z, rel=1e-6, what='loss with terms')
  assert set(metrics) == {'moe/aux_loss', 'moe/z_loss', 'moe/block_000/load_min',
                          'moe/block_000/load_max', 'moe/block_000/dropped'}


def numpy_dropped(probs, k, slots):
  """Per row, every first choice in token order, then every second one, ...
  into slots per expert: the choices past them, and the tokens with none kept."""
  top = np.argsort(-probs, axis=-1)[..., :k]
  dropped, none_kept = 0, np.zeros(top.shape[:2], bool)
  for g in range(top.shape[0]):
    filled = np.zeros(probs.shape[-1], int)
    kept = np.zeros((top.shape[1], k), bool)
    for j in range(k):
      for s in range(top.shape[1]):
        e = top[g, s, j]
        kept[s, j] = filled[e] < slots
        filled[e] += 1
    dropped += (~kept).sum()
    none_kept[g] = ~kept.any(-1)
  return dropped / top.size, none_kept


@pytest.mark.parametrize('k', [1, 2])
def test_a_full_expert_drops_what_numpy_counts_and_a_dropped_token_leaves_zero(k):
  """Capacity factor 1.0, a router forced to favour expert 0 (feature 0 is 1
  on every token and weighs 8 for it): the logged dropped share equals a numpy
  count exactly, and a token with all its choices dropped leaves the layer
  as 0, so the block's residual carries it unchanged."""
  layer, w = layer_of(kind='swiglu', capacity_factor=1.0, experts_per_token=k)
  router = w['router'].copy()
  router[0, 0] = 8.0
  layer.router.assign(router)
  x = np.random.default_rng(5).normal(size=(3, 16, D)).astype(np.float32)
  x[..., 0] = 1.0
  slots = capacity(layer.params, 16)
  assert slots == int(np.ceil(16 * k / E))
  _, logits, probs = numpy_moe(x, {**w, 'router': router}, k=k)
  expected, none_kept = numpy_dropped(probs, k, slots)
  assert expected > 0.2
  with collecting() as terms:
    y = layer(tf.constant(x)).numpy()
  assert float(next(iter(terms.layers.values())).dropped) == pytest.approx(expected, abs=1e-7)
  assert none_kept.any()  # some tokens lost every choice
  np.testing.assert_array_equal(y[none_kept], 0.0)
  assert (np.abs(y[~none_kept]).max(-1) > 0).all()


LM = dict(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=48, num_layers=2, max_len=16,
          norm='rms', positions='rope', ffn='swiglu', output_bias=False)
EXPERT = [(r'.*/moe/w_(gate|up|down)', ('expert', 'unsharded', 'unsharded'))]
MEGATRON = [(r'.*/moe/w_(gate|up)', ('expert', 'unsharded', 'model')),
            (r'.*/moe/w_down', ('expert', 'model', 'unsharded')),
            (r'.*/attn/w[qkv]', ('unsharded', 'model', 'unsharded')),
            (r'.*/attn/wo', ('model', 'unsharded', 'unsharded'))]


def moe_trainer(shape, rules=(), *, batch_axis='data', moe=None, pipeline=None, **config):
  model = transformer_lm_params(**LM, moe=moe_feed_forward_params(
      **{'num_experts': 8, 'experts_per_token': 2, 'z_loss_coef': 1e-3, **(moe or {})}))
  return make_trainer(
      model=model, mesh=build_mesh(MeshSpec(shape=shape)), rules=LayoutRules(list(rules)),
      task=MarkovTask(vocab_size=32, seq_len=16, seed=3), pipeline=pipeline,
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0, **config.pop('opt', {})),
      config=TrainConfig(num_steps=20, batch_size=8, log_every=1, eval_every=0,
                         eval_batches=1, batch_axis=batch_axis, **config))


def trace(trainer, steps: int = 20) -> dict:
  """`train_trace`'s losses and gradient norms, and the first step's metrics."""
  reader = trainer.task.reader(split='train', batch_size=8)
  result = {'loss': [], 'grad_norm': [], 'metrics': None}
  for _ in range(steps):
    loss, _, norm, metrics = trainer.train_step(next(reader))
    result['loss'].append(float(to_numpy(loss)))
    result['grad_norm'].append(float(to_numpy(norm)))
    result['metrics'] = result['metrics'] or {k: float(to_numpy(v)) for k, v in metrics.items()}
  return result


@pytest.fixture(scope='module')
def one_device():
  return trace(moe_trainer({'data': 1}))


@pytest.fixture(scope='module')
def accumulated():
  """One device, the batch in two micro-steps of 4 rows."""
  return trace(moe_trainer({'data': 1}, grad_accum_steps=2))


SPLITS = {
    'expert=4 x data=2': ({'expert': 4, 'data': 2}, EXPERT, {}),
    'expert=4 x data=2, FSDP': ({'expert': 4, 'data': 2}, EXPERT, dict(fsdp=True)),
    'expert=2 x data=2 x model=2 (Megatron in each expert)': (
        {'expert': 2, 'data': 2, 'model': 2}, MEGATRON, {}),
}  # GShard's (the batch's own axis): in the pipeline below, tests/test_hf_models.py and the
# composition cells, with remat, ZeRO-1, Adafactor, bfloat16, packing


@pytest.mark.parametrize('split', list(SPLITS))
def test_twenty_steps_on_a_split_mesh_are_the_one_device_run(split, one_device):
  shape, rules, config = SPLITS[split]
  trace = train_trace(moe_trainer(shape, rules, **config), steps=20, batch_size=8)
  for key in ('loss', 'grad_norm'):
    assert_close(trace[key], one_device[key], rel=2e-5, what=f'{key}: {split}')
  assert one_device['loss'][-1] < one_device['loss'][0] - 0.3  # it trains


def test_dropping_tokens_changes_the_run(one_device):
  """Positive control for the split runs: capacity 1.0 drops choices, and by
  the third step the losses are far from the no-drop run's."""
  trainer = moe_trainer({'expert': 4, 'data': 2}, EXPERT, moe=dict(capacity_factor=1.0))
  reader = trainer.task.reader(split='train', batch_size=8)
  losses, dropped = [], []
  for _ in range(3):
    loss, _, _, metrics = trainer.train_step(next(reader))
    losses.append(float(to_numpy(loss)))
    dropped.append(float(to_numpy(metrics['moe/block_000/dropped'])))
  assert min(dropped) > 0.05
  assert abs(losses[2] - one_device['loss'][2]) > 1e-3 * abs(losses[2])


def test_accumulation_is_exact_without_router_losses_and_balances_each_micro_step(
    one_device, accumulated):
  """Gradient accumulation routes each micro-step's rows by themselves: with
  the router losses off, two micro-steps train as one batch (the losses
  equal); with them on, the load-balancing loss is each micro-step's own
  (its loads and mean probabilities), as Megatron and Hugging Face compute
  it: the first loss moves from the whole batch's by exactly the change in
  the penalty, whose load-balancing term is not the whole batch's."""
  off = dict(moe=dict(aux_loss_coef=0.0, z_loss_coef=0.0))
  whole = train_trace(moe_trainer({'data': 1}, **off), steps=2, batch_size=8)
  parts = train_trace(moe_trainer({'data': 1}, grad_accum_steps=2, **off), steps=2,
                      batch_size=8)
  for key in ('loss', 'grad_norm'):
    assert_close(parts[key], whole[key], rel=2e-6, what=f'{key}, accumulated')

  def penalty(metrics):
    return 0.01 * metrics['moe/aux_loss'] + 1e-3 * metrics['moe/z_loss']
  moved = accumulated['loss'][0] - one_device['loss'][0]
  expected = penalty(accumulated['metrics']) - penalty(one_device['metrics'])
  assert abs(moved - expected) <= 2e-6 * abs(one_device['loss'][0]), (moved, expected)
  assert abs(expected) > 1e-6  # the micro-steps' loads are not the batch's
  assert_close(accumulated['metrics']['moe/z_loss'], one_device['metrics']['moe/z_loss'],
               rel=1e-6, what='the z-loss, a mean over tokens, is the same')


def checkpoint_values(trainer):
  return {k: to_numpy(v) for k, v in checkpoint_lib.checkpoint_keys(trainer.state()).items()}


def test_a_checkpoint_saved_with_split_experts_resumes_on_data8_and_back(tmp_path, devices8):
  expert_split = moe_trainer({'expert': 4, 'data': 2}, EXPERT)
  train_trace(expert_split, steps=3, batch_size=8)
  saved = checkpoint_values(expert_split)
  Checkpointer(directory=str(tmp_path / 'a'), state=expert_split.state(),
               config=CheckpointConfig()).save(3, reason='final')
  data8 = moe_trainer({'data': 8})
  assert Checkpointer(directory=str(tmp_path / 'a'), state=data8.state(),
                      config=CheckpointConfig()).restore_latest() == 3
  for key, value in checkpoint_values(data8).items():
    np.testing.assert_array_equal(value, saved[key], err_msg=key)
  # and back: two more steps on data=8, restored into the expert split (which
  # holds its own step-3 values until then)
  train_trace(data8, steps=2, batch_size=8)
  Checkpointer(directory=str(tmp_path / 'b'), state=data8.state(),
               config=CheckpointConfig()).save(5, reason='final')
  again = expert_split
  assert Checkpointer(directory=str(tmp_path / 'b'), state=again.state(),
                      config=CheckpointConfig()).restore_latest() == 5
  expected = checkpoint_values(data8)
  for key, value in checkpoint_values(again).items():
    np.testing.assert_array_equal(value, expected[key], err_msg=key)


def test_the_cached_decoder_routes_as_the_whole_sequence_does():
  params = transformer_lm_params(**LM, moe=moe_feed_forward_params(num_experts=4))
  model = params.Instantiate()
  rng = np.random.default_rng(6)
  for variable in model.variables:
    variable.assign(rng.normal(0, 0.3, variable.shape).astype(np.float32)
                    + (1 if 'scale' in variable.name else 0))
  variables = {v.name[:-2].replace('.', '/'): v for v in model.variables}
  decoder = CachedLM(params, variables)
  ids = rng.integers(0, 32, (2, 9)).astype(np.int32)
  assert_close(decoder.logits(ids).numpy(), model(tf.constant(ids)).numpy(), rel=1e-5,
               what='decoder logits')
  prompts, lengths = ids[:, :5], np.array([5, 3], np.int32)
  np.testing.assert_array_equal(
      decoder.generate(prompts, lengths, max_new_tokens=6).numpy(),
      decoder.generate_by_recomputing(prompts, lengths, max_new_tokens=6).numpy())


def test_twenty_steps_in_a_sub_mesh_pipeline_are_the_one_device_run(accumulated):
  """GPipe on `stage=2 x data=2` (a routed block on each stage, the experts
  split over 'data' in each), 2 micro-batches: the losses and gradient norms
  of one device accumulating the same 2 parts of the batch (the
  load-balancing loss is each part's own either way). Stage 0's router
  learns only through the penalty its own unit differentiates (weighted by
  the micro-batch's tokens, carried down from the last stage), stage 1's
  terms through the loss itself; and the reported loss and metrics hold
  both stages' terms."""
  piped = trace(moe_trainer({'stage': 2, 'data': 2},
                            [(r'.*/moe/w_(gate|up|down)', ('data', 'unsharded', 'unsharded'))],
                            pipeline=PipelineConfig(num_stages=2, num_micro_batches=2)))
  for key in ('loss', 'grad_norm'):
    assert_close(piped[key], accumulated[key], rel=2e-5, what=f'pipelined {key}')
  for name in ('moe/aux_loss', 'moe/z_loss', 'moe/block_000/load_max', 'moe/block_001/load_max'):
    assert_close(piped['metrics'][name], accumulated['metrics'][name], rel=2e-5, what=name)


def test_the_spmd_pipeline_is_refused_naming_both(devices8):
  with pytest.raises(ConfigError) as refused:
    make_trainer(model=transformer_lm_params(**LM, moe=moe_feed_forward_params()),
                 mesh=build_mesh(MeshSpec(shape={'stage': 2, 'data': 4})), rules=LayoutRules([]),
                 task=MarkovTask(vocab_size=32, seq_len=16, seed=3),
                 pipeline=PipelineConfig(num_stages=2, num_micro_batches=2, engine='spmd'),
                 optimizer=OptimizerConfig(), config=TrainConfig(batch_size=8))
  assert 'pipeline.engine' in str(refused.value) and 'moe' in str(refused.value)


@pytest.mark.parametrize('options, words', [
    (dict(experts_per_token=9), 'experts_per_token'),
    (dict(router='relu'), 'router'),
    (dict(num_experts=0), 'num_experts'),
])
def test_a_bad_option_names_itself(options, words):
  with pytest.raises(ConfigError) as bad:
    moe_feed_forward_params(**options)
  assert words in str(bad.value)


def test_lora_on_expert_weights_trains_per_expert_adapters_and_merges_exactly():
  """Adapters on a routed layer's [E, D, F] experts are one pair per expert,
  A [E, D, r] and B [E, r, F]: the layer with them equals the layer with
  each expert's weight merged (W_e + scale A_e B_e, `lora.merged`), and
  only the adapters train."""
  from layout_core.model import lora as lora_lib  # pylint: disable=g-import-not-at-top
  from layout_core.model.tuning import tune  # pylint: disable=g-import-not-at-top
  config = lora_lib.LoraConfig(rank=3, alpha=6.0,
                               targets=(r'.*/moe/w_(gate|up|down)', r'.*/attn/wq'))
  tuned = tune(transformer_lm_params(**LM, moe=moe_feed_forward_params(num_experts=4)),
               lora=config, trainable=None)
  model = tuned.Instantiate()
  rng = np.random.default_rng(8)
  for variable in model.variables:
    variable.assign(rng.normal(0, 0.3, variable.shape).astype(np.float32)
                    + (1 if 'scale' in variable.name else 0))
  block = model.stack.block_000.moe
  assert block.w_gate_lora_a.shape == (4, 32, 3) and block.w_gate_lora_b.shape == (4, 3, 48)
  assert {v.name.split('.')[-1][:-2] for v in model.trainable_variables} <= {
      f'w_{m}_lora_{ab}' for m in ('gate', 'up', 'down') for ab in 'ab'} | {
      'wq_lora_a', 'wq_lora_b'}
  ids = tf.constant(rng.integers(0, 32, (2, 9)).astype(np.int32))
  with_adapters = model(ids).numpy()
  plain = transformer_lm_params(**LM, moe=moe_feed_forward_params(num_experts=4)).Instantiate()
  by_name = {v.name: v.numpy() for v in model.variables}
  for variable in plain.variables:  # the base weights, unmerged: a control
    variable.assign(by_name[variable.name])
  base = plain(ids).numpy()
  for variable in plain.variables:
    layer = variable.name[:-2]
    if layer.rsplit('.', 1)[1] in ('w_gate', 'w_up', 'w_down', 'wq'):
      variable.assign(lora_lib.merged(by_name[variable.name], by_name[f'{layer}_lora_a:0'],
                                      by_name[f'{layer}_lora_b:0'], scale=config.scale))
  assert_close(plain(ids).numpy(), with_adapters, rel=1e-5, what='merged experts')
  assert np.abs(base - with_adapters).max() > 1e-2 * np.abs(base).max()  # they matter


def test_peft_files_of_a_run_with_expert_adapters_are_refused_naming_the_merged_export(tmp_path):
  from layout_core.convert import hf_config, peft  # pylint: disable=g-import-not-at-top
  from layout_core.model.lora import LoraConfig  # pylint: disable=g-import-not-at-top
  from tests import hf_fixtures  # pylint: disable=g-import-not-at-top
  kwargs, _ = hf_config.lm_kwargs_from_hf(hf_fixtures.config('mixtral'))
  adapted = 'lm/stack/block_001/moe/w_up_lora_a'
  with pytest.raises(ConfigError) as refused:
    peft.write_peft_dir(str(tmp_path / 'peft'), kwargs=kwargs,
                        lora=LoraConfig(rank=2, targets=(r'.*/moe/w_.*',)),
                        read=lambda path: np.zeros([1]) if path == adapted else None)
  assert 'expert' in str(refused.value) and '--adapters_only' in str(refused.value)
  assert not (tmp_path / 'peft').exists()


def test_the_sub_mesh_pipeline_refuses_experts_on_an_axis_of_their_own(devices8):
  with pytest.raises(ConfigError) as refused:
    moe_trainer({'stage': 2, 'expert': 2, 'data': 2}, EXPERT,
                pipeline=PipelineConfig(num_stages=2, num_micro_batches=2))
  assert "'expert'" in str(refused.value) and "('data', 'unsharded', 'unsharded')" in str(
      refused.value)
