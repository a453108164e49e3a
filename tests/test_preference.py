"""Preference tuning: pairs, the DPO-family losses, and the reference model.

The pairs: each side is the conversation the instruction task renders, its
loss mask exactly the answer (decoded back to text); bad lines are named by
file and line. The losses and their gradients equal numpy's formulas, the
answers' log-probabilities a hand computation. The reference is the base
model (adapters off): step 0's loss is ln 2 with rewards 0, and after
training the reference log-probabilities are still the untuned model's.
One device, data=8, the 2x4 Megatron mesh with accumulation, FSDP with
remat, and both pipelines train the same losses. Launched: a run learns the
rule of a synthetic set (held-out accuracy above 0.9, the margin growing),
a preempted run resumes exactly, two clients train as one process, and a
bad line exits 2.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from examples.preference.write_pairs import write_pairs
from layout_core.errors import ConfigError
from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model.lm import transformer_lm_params
from layout_core.model.lora import LoraConfig
from layout_core.model.tuning import tune
from layout_core.optim import OptimizerConfig
from layout_core.pipeline import PipelineConfig
from layout_core.run import make_trainer
from layout_core.tasks import dpo
from layout_core.tasks.instruct import InstructionTask
from layout_core.tasks.preference import PreferenceTask
from layout_core.train import reference_logps
from layout_core.train.config import TrainConfig
from layout_core.train.reference_logps import attach_reference
from tests.conftest import (REPO_ROOT, Launched, killed_if_left, read_events, run_module,
                            run_modules, train_trace)
from tests.numerics import assert_close
from tests.test_layout_scope import MEGATRON

MODEL = dict(vocab_size=256, model_dim=32, num_heads=4, ffn_dim=64, num_layers=2, max_len=64)
LORA = LoraConfig(rank=4, alpha=8.0, targets=(r'.*/attn/w[qv]', r'.*/ffn/w_.*'))
BATCH = 8  # 4 pairs


def write_lines(path, lines) -> str:
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines((line if isinstance(line, str) else json.dumps(line)) + '\n' for line in lines)
  return str(path)


def user(text):
  return {'role': 'user', 'content': text}


def assistant(text):
  return {'role': 'assistant', 'content': text}


@pytest.fixture(scope='module')
def pairs(tmp_path_factory) -> str:
  root = str(tmp_path_factory.mktemp('pairs'))
  write_pairs(root, num_train=96, num_eval=16)
  return root


def preference_task(root, seq_len=64, **settings) -> PreferenceTask:
  return PreferenceTask(train_files=f'{root}/train.jsonl', eval_files=f'{root}/eval.jsonl',
                        tokenizer='bytes', vocab_size=256, seq_len=seq_len, **settings)


def text(ids) -> str:
  return bytes(int(i) for i in ids).decode('utf-8')


def test_each_side_is_the_conversation_the_instruction_task_renders(tmp_path):
  """Row 2i is the prompt and the chosen answer, row 2i + 1 the prompt and
  the rejected one, as the instruction task tokenizes that conversation;
  the mask is exactly the answer and its end of turn, not the prompt's own
  assistant turns. Both line forms give the same rows."""
  multi_turn = [user('a'), assistant('b'), user('c')]
  lines = [{'prompt': 'Hi', 'chosen': 'yes', 'rejected': 'no'},
           {'chosen': [user('Hi'), assistant('yes')], 'rejected': [user('Hi'), assistant('no')]},
           {'prompt': multi_turn, 'chosen': 'd', 'rejected': [assistant('e')]}]
  for split in ('train', 'eval'):
    write_lines(tmp_path / f'{split}.jsonl', lines)
  task = preference_task(tmp_path, seq_len=96, num_streams=1, shuffle_window=1)
  task.check_data()
  batch = task.features(split='train', step=0, batch_size=6)
  conversations = [[user('Hi'), assistant('yes')], [user('Hi'), assistant('no')]] * 2 + [
      multi_turn + [assistant('d')], multi_turn + [assistant('e')]]
  answers = ['yes', 'no', 'yes', 'no', 'd', 'e']
  write_lines(tmp_path / 'chats.jsonl', [{'messages': m} for m in conversations])
  instruct = InstructionTask(train_files=f'{tmp_path}/chats.jsonl',
                             eval_files=f'{tmp_path}/chats.jsonl', tokenizer='bytes',
                             vocab_size=256, seq_len=96, pack=False, num_streams=1,
                             shuffle_window=1)
  rows = instruct.features(split='train', step=0, batch_size=6)
  np.testing.assert_array_equal(batch['tokens'], rows['tokens'])
  np.testing.assert_array_equal(batch['segments'], rows['segments'])
  for row, answer in enumerate(answers):
    assert text(batch['tokens'][row][batch['loss_mask'][row] > 0]) == f'{answer}<|end|>', row
  np.testing.assert_array_equal(batch['loss_mask'][:4], rows['loss_mask'][:4])
  assert rows['loss_mask'][4].sum() > batch['loss_mask'][4].sum()  # instruct trains 'b' too


@pytest.mark.parametrize('line, why', [
    ('{"prompt": "Hi", "chosen": "", "rejected": "no"}', 'empty chosen answer'),
    ('{"prompt": "Hi", "chosen": "yes", "rejected": "yes"}', 'same chosen and rejected'),
    (json.dumps({'chosen': [user('Hi'), assistant('a')], 'rejected': [user('Ho'), assistant('b')]}),
     'share no prefix'),
    ('{"prompt": "Hi", "chosen": "yes"}', 'needs "chosen" and "rejected"'),
    ('{"prompt": "Hi", "chosen": "yes", "rejected": [{"role": "bot", "content": "x"}]}',
     "role 'bot'"),
    ('not json', 'is not JSON'),
])
def test_a_bad_pair_is_named_by_file_and_line(tmp_path, line, why):
  good = '{"prompt": "Hi", "chosen": "yes", "rejected": "no"}'
  write_lines(tmp_path / 'train.jsonl', [good, line])
  write_lines(tmp_path / 'eval.jsonl', [good])
  with pytest.raises(ConfigError) as error:
    preference_task(tmp_path).check_data()
  assert f'{tmp_path}/train.jsonl:2' in str(error.value) and why in str(error.value)


def numpy_loss(policy, reference, tokens, *, beta, loss, label_smoothing=0.0):
  """The mean loss over pairs, in float64, from rows (chosen, rejected) * pairs."""
  policy, reference, tokens = (np.asarray(v, np.float64) for v in (policy, reference, tokens))
  ratio = policy - reference
  z = beta * (ratio[0::2] - ratio[1::2])
  log_sigmoid = lambda x: -np.logaddexp(0.0, -x)  # noqa: E731
  if loss == 'sigmoid':
    losses = -(1 - label_smoothing) * log_sigmoid(z) - label_smoothing * log_sigmoid(-z)
  elif loss == 'ipo':
    per_token = ratio / tokens
    losses = (per_token[0::2] - per_token[1::2] - 1 / (2 * beta)) ** 2
  else:
    losses = np.maximum(0.0, 1.0 - z)
  return losses.mean()


@pytest.mark.parametrize('loss, label_smoothing', [('sigmoid', 0.0), ('sigmoid', 0.2),
                                                   ('ipo', 0.0), ('hinge', 0.0)])
def test_each_loss_and_its_gradient_equal_numpy(loss, label_smoothing):
  """The loss of `preference_loss` and its gradient in the policy's
  log-probabilities against numpy's formula and its central differences
  (float64); the metrics against their definitions."""
  rng = np.random.default_rng(7)
  policy = rng.normal(-20.0, 4.0, 8)
  reference = policy + rng.normal(0.0, 3.0, 8)
  tokens = rng.integers(1, 12, 8).astype(np.float64)
  objective = dpo.DPOConfig(beta=0.3, loss=loss, label_smoothing=label_smoothing)
  variable = tf.Variable(policy.astype(np.float32))
  with tf.GradientTape() as tape:
    sums, metrics = dpo.preference_loss(variable, tf.constant(reference, tf.float32),
                                        tokens=tf.constant(tokens, tf.float32),
                                        objective=objective)
    value = sums.total / sums.count
  gradient = tape.gradient(value, variable).numpy()
  settings = dict(beta=0.3, loss=loss, label_smoothing=label_smoothing)
  expected = numpy_loss(policy, reference, tokens, **settings)
  assert_close(float(value), expected, rel=1e-6, what=f'{loss} loss')
  step = 1e-4
  differences = [(numpy_loss(policy + step * e, reference, tokens, **settings)
                  - numpy_loss(policy - step * e, reference, tokens, **settings)) / (2 * step)
                 for e in np.eye(8)]
  assert_close(gradient, differences, rel=1e-5, what=f'{loss} gradient')
  chosen, rejected = 0.3 * (policy - reference)[0::2], 0.3 * (policy - reference)[1::2]
  found = {name: float(v.total / v.count) if isinstance(v, dpo.Mean) else float(v.value)
           for name, v in metrics.items()}
  assert_close([found['rewards/chosen'], found['rewards/rejected'], found['rewards/margins'],
                found['rewards/accuracies'], found['logps/chosen'], found['logps/rejected']],
               [chosen.mean(), rejected.mean(), (chosen - rejected).mean(),
                (chosen > rejected).mean(), policy[0::2].mean(), policy[1::2].mean()],
               rel=1e-6, what='metrics')
  assert found['pairs'] == 4 and found['tokens_trained'] == tokens.sum()


def test_an_answers_log_probability_is_the_sum_over_its_tokens():
  """`answer_logps`: per row, the log-softmax of each answer token's logit,
  summed over the answer (the loss mask, inside the row's example, not
  padding), by hand in numpy."""
  rng = np.random.default_rng(3)
  logits = rng.normal(0.0, 2.0, (4, 6, 10)).astype(np.float32)
  tokens = rng.integers(0, 10, (4, 7)).astype(np.int32)
  segments = np.array([[1] * 7, [1] * 5 + [0] * 2, [1] * 7, [1] * 3 + [0] * 4], np.int32)
  loss_mask = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0],
                        [0, 0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 0, 0, 0]], np.int32)
  batch = {'tokens': tokens, 'segments': segments, 'loss_mask': loss_mask}
  found = dpo.answer_logps(tf.constant(logits), {k: tf.constant(v) for k, v in batch.items()})
  log_softmax = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
  expected = [sum(log_softmax[b, t, tokens[b, t + 1]] for t in range(6)
                  if loss_mask[b, t + 1] and segments[b, t + 1] and segments[b, t])
              for b in range(4)]
  assert_close(found.numpy(), expected, rel=1e-6, what='answer log-probabilities')


def make(pairs_root, mesh, *, rules=(), pipeline=None, lora=LORA, steps=3, objective=None,
         **config):
  return make_trainer(
      model=tune(transformer_lm_params(**MODEL), lora=lora, trainable=None), mesh=mesh,
      rules=LayoutRules(list(rules)), task=preference_task(pairs_root, objective=objective),
      pipeline=pipeline,
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
      config=TrainConfig(num_steps=steps, batch_size=BATCH, log_every=1, eval_every=0,
                         eval_batches=1, **config))


def trace(trainer) -> dict:
  return train_trace(trainer, steps=3, batch_size=BATCH)


@pytest.fixture(scope='module')
def one_device(pairs, devices8):
  trainer = make(pairs, build_mesh(MeshSpec(shape={'data': 1})))
  return trainer, trace(trainer)


def test_step_0_is_ln_2_and_the_reference_stays_the_base_model(pairs, one_device):
  """Policy = reference at step 0 (LoRA's B starts at 0): the loss is ln 2,
  every reward 0. After 3 steps the reference's log-probabilities
  (logps - rewards / beta) are still those of the untuned model."""
  trainer, traced = one_device
  assert traced['loss'][0] == pytest.approx(math.log(2), rel=1e-7)
  assert traced['loss'][1:] != pytest.approx([math.log(2)] * 2, rel=1e-4)  # it trains
  loss, metrics = trainer.evaluate()
  assert loss != pytest.approx(math.log(2), rel=1e-4)
  beta = trainer.task.objective.beta
  reference = [metrics[f'logps/{side}'] - metrics[f'rewards/{side}'] / beta
               for side in ('chosen', 'rejected')]
  base = make_trainer(  # the untuned model; its task only shapes it (nothing is read)
      model=transformer_lm_params(**MODEL), mesh=build_mesh(MeshSpec(shape={'data': 1})),
      rules=LayoutRules([]), task=InstructionTask(
          train_files='unread', eval_files='unread', tokenizer='bytes', vocab_size=256,
          seq_len=64, pack=False),
      optimizer=OptimizerConfig(), config=TrainConfig(batch_size=BATCH))
  packed = base.engine.pack(trainer.task.features(split='eval', step=0, batch_size=BATCH))

  @tf.function
  def answer_logps(packed):  # DTensor runs a model inside a function
    logits = base.engine.program.model.call(base.task.model_inputs(packed), False)
    return dpo.answer_logps(tf.cast(logits, tf.float32), packed)
  logps = to_numpy(answer_logps(packed))
  assert_close(reference, [logps[0::2].mean(), logps[1::2].mean()], rel=1e-5,
               what='reference log-probabilities')
  step0 = make(pairs, build_mesh(MeshSpec(shape={'data': 1})))
  assert step0.evaluate()[1]['rewards/margins'] == 0.0


SPLITS = {  # name: (mesh shape, rules, pipeline, TrainConfig settings)
    'data=8': ({'data': 8}, (), None, {}),
    'megatron 2x4, accumulation 2': ({'data': 2, 'model': 4}, MEGATRON, None,
                                     {'grad_accum_steps': 2}),
    'fsdp data=8, remat': ({'data': 8}, (), None, {'fsdp': True, 'remat': 'block'}),
    'spmd pipeline': ({'stage': 2, 'data': 2, 'model': 2}, MEGATRON,
                      PipelineConfig(num_stages=2, num_micro_batches=2, engine='spmd'), {}),
    'gpipe': ({'stage': 2, 'data': 2, 'model': 2}, MEGATRON,
              PipelineConfig(num_stages=2, num_micro_batches=2, engine='submesh'), {}),
    'bfloat16 data=8': ({'data': 8}, (), None, {'compute_dtype': 'bfloat16'}),
}


@pytest.mark.parametrize('split', list(SPLITS))
def test_every_split_trains_the_one_device_losses(pairs, one_device, split):
  """Pairs stay whole in every part of a split batch (a data=8 device holds
  one row: its pair is on two devices), and the reference runs on every
  engine: the losses and gradient norms of 3 steps equal one device's."""
  shape, rules, pipeline, config = SPLITS[split]
  traced = trace(make(pairs, build_mesh(MeshSpec(shape=shape)), rules=rules,
                      pipeline=pipeline, **config))
  rel = 3e-2 if 'bfloat16' in split else 1e-5  # tests/composition.py's 'bf16' and 'order'
  for key in ('loss', 'grad_norm'):
    assert_close(traced[key], one_device[1][key], rel=rel, what=f'{key} on {split}')


def test_a_keras_model_has_no_adapters_to_turn_off(pairs, devices8):
  from layout_core.model import keras as keras_models  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(REPO_ROOT, 'tests', 'fixtures'))
  from my_project import models  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError) as refused:
    make_trainer(model=keras_models.KerasModel(build_fn=models.token_classifier),
                 mesh=build_mesh(MeshSpec(shape={'data': 2})), rules=LayoutRules([]),
                 task=preference_task(pairs), optimizer=OptimizerConfig(),
                 config=TrainConfig(batch_size=BATCH))
  assert 'Keras' in str(refused.value) and 'model.params' in str(refused.value)


@pytest.mark.parametrize('settings, words', [
    (dict(lora=None), ('lora.rank',)),
    (dict(grad_accum_steps=8, mesh={'data': 1}), ('train.batch_size', 'multiple of 16')),
    (dict(pipeline=PipelineConfig(num_stages=2, num_micro_batches=8, engine='spmd'),
          mesh={'stage': 2, 'data': 1, 'model': 4}), ('pipeline.num_micro_batches',)),
])
def test_what_cannot_hold_whole_pairs_or_a_reference_is_refused(pairs, devices8, settings,
                                                                words):
  settings = dict(settings)
  mesh = build_mesh(MeshSpec(shape=settings.pop('mesh', {'data': 2})))
  with pytest.raises(ConfigError) as refused:
    make(pairs, mesh, rules=MEGATRON if 'pipeline' in settings else (), **settings)
  for word in words:
    assert word in str(refused.value)


# -- launched -------------------------------------------------------------------------
STEPS = 40


def bindings(root, *extra) -> list[str]:
  return ['--gin_file=configs/experiments/dpo_tiny.gin',
          f"--gin_bindings=preference.train_files = '{root}/train.jsonl'",
          f"--gin_bindings=preference.eval_files = '{root}/eval.jsonl'",
          f'--gin_bindings=train.num_steps = {STEPS}', '--gin_bindings=train.eval_every = 10',
          '--gin_bindings=train.log_every = 5', '--gin_bindings=train.eval_batches = 2',
          *extra]


@pytest.fixture(scope='module')
def launched(tmp_path_factory):
  """dpo_tiny straight through, the same preempted at step 15 and resumed,
  and the same on 2 clients x 4 devices."""
  root = str(tmp_path_factory.mktemp('launched'))
  write_pairs(root, num_train=256, num_eval=32)
  straight, cut, clients = (os.path.join(root, name) for name in ('straight', 'cut', 'clients'))
  preempted = Launched('launch.train', *bindings(root), f'--model_dir={cut}', label='preempted')
  with killed_if_left(preempted):
    done = run_modules([('launch.train', *bindings(root), f'--model_dir={straight}'),
                        ('launch.local_cluster', '--num_clients=2', '--devices_per_client=4',
                         '--', *bindings(root), f'--model_dir={clients}')], timeout=400)
    output = preempted.stop_after(r'step 15/')
  for result in done:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert preempted.process.returncode == 0, output[-3000:]
  resumed = run_module('launch.train', *bindings(root), f'--model_dir={cut}')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  return {'straight': straight, 'cut': cut, 'clients': clients, 'root': root,
          'console': done[0].stderr + done[0].stdout}


def test_a_run_learns_the_preference_and_logs_trl_names(launched):
  """Held-out pairs (words never trained on): rewards/accuracies ends above
  0.9 and the margin grows from 0 at step 0; every TRL name is in
  TensorBoard for train and eval, the margins and accuracies on the console."""
  scalars = read_events(launched['straight'])['scalars']
  for split in ('train', 'eval'):
    for name in ('rewards/chosen', 'rewards/rejected', 'rewards/margins',
                 'rewards/accuracies', 'logps/chosen', 'logps/rejected'):
      assert f'{split}/{name}' in scalars, (split, name, sorted(scalars))
  margins = [value for _, value in scalars['eval/rewards/margins']]
  assert margins[0] == 0.0 and margins[-1] > margins[1] > 0, margins
  assert scalars['eval/rewards/accuracies'][-1][1] > 0.9
  assert scalars['eval/loss'][0][1] == pytest.approx(math.log(2), rel=1e-6)
  assert 'rewards/margins' in launched['console'] and 'rewards/accuracies' in launched['console']


def test_a_preempted_run_resumes_exactly_and_two_clients_train_as_one(launched):
  expected = read_events(launched['straight'])['scalars']
  for run in ('cut', 'clients'):
    found = read_events(launched[run])['scalars']
    for tag in ('train/loss', 'eval/loss', 'eval/rewards/margins'):
      steps = dict(found[tag])
      for step, value in expected[tag]:
        if run == 'cut':
          assert steps[step] == value, (run, tag, step)
        else:  # another process layout sums in another order
          assert_close(steps[step], value, rel=1e-5, what=f'{run} {tag} at {step}')


def test_a_bad_pair_exits_2_naming_its_line(tmp_path):
  write_lines(tmp_path / 'train.jsonl', ['{"prompt": "Hi", "chosen": "a", "rejected": "a"}'])
  write_lines(tmp_path / 'eval.jsonl', ['{"prompt": "Hi", "chosen": "a", "rejected": "b"}'])
  result = run_module('launch.train', *bindings(tmp_path), f'--model_dir={tmp_path}/run')
  assert result.returncode == 2, result.stderr[-2000:]
  assert f'{tmp_path}/train.jsonl:1' in result.stderr
  assert not os.path.exists(f'{tmp_path}/run/checkpoints')


def precomputed(pairs_root, mesh, tmp_path, **settings):
  """A trainer whose reference log-probabilities are precomputed, attached."""
  trainer = make(pairs_root, mesh, objective=dpo.DPOConfig(precompute_reference=True),
                 **settings)
  attach_reference(trainer.task, trainer.engine, model_dir=str(tmp_path), batch_size=BATCH,
                   resumed=False)
  return trainer


def test_a_precomputed_reference_trains_as_the_reference_run_in_each_step(
    pairs, one_device, tmp_path):
  """LoRA: the precomputed values are the in-step reference's, so the
  losses are one device's; the file holds every pair of both splits."""
  traced = trace(precomputed(pairs, build_mesh(MeshSpec(shape={'data': 1})), tmp_path))
  for key in ('loss', 'grad_norm'):
    assert_close(traced[key], one_device[1][key], rel=1e-5, what=f'precomputed {key}')
  with open(tmp_path / reference_logps.FILE) as f:
    stored = json.load(f)
  assert {split: len(values) for split, values in stored['pairs'].items()} == {
      'train': 96, 'eval': 16}


def test_full_dpo_with_a_precomputed_reference_on_the_pipelines(pairs, devices8, tmp_path):
  """Every weight trains (no adapters): the reference is the starting
  model, precomputed, on the one-device engine and both pipelines alike."""
  traces = {}
  for name, (shape, rules, pipeline) in {
      'one device': ({'data': 1}, (), None),
      'spmd': (SPLITS['spmd pipeline'][:3]), 'gpipe': (SPLITS['gpipe'][:3])}.items():
    trainer = precomputed(pairs, build_mesh(MeshSpec(shape=shape)), tmp_path / name,
                          rules=rules, pipeline=pipeline, lora=None)
    assert trainer.task.needs_reference is False
    traces[name] = trace(trainer)
  assert traces['one device']['loss'][0] == pytest.approx(math.log(2), rel=1e-6)
  for name in ('spmd', 'gpipe'):
    for key in ('loss', 'grad_norm'):
      assert_close(traces[name][key], traces['one device'][key], rel=1e-5,
                   what=f'{name} {key}')


def test_full_dpo_with_a_precomputed_reference_resumes_exactly_and_refuses_changed_data(
    tmp_path):
  """Launched, every weight training: straight through against preempted at
  step 10 and resumed (which reads the stored reference back); then a
  changed eval file stops the resumed run with exit 2, naming it."""
  write_pairs(str(tmp_path), num_train=64, num_eval=16)
  full = bindings(tmp_path, '--gin_bindings=lora.rank = 0',
                  '--gin_bindings=dpo.precompute_reference = True',
                  '--gin_bindings=optimizer.learning_rate = 1e-3',
                  '--gin_bindings=train.num_steps = 20')
  straight, cut = str(tmp_path / 'straight'), str(tmp_path / 'cut')
  preempted = Launched('launch.train', *full, f'--model_dir={cut}', label='preempted')
  with killed_if_left(preempted):
    done = run_module('launch.train', *full, f'--model_dir={straight}')
    output = preempted.stop_after(r'step 10/')
  assert done.returncode == 0, done.stderr[-3000:]
  assert preempted.process.returncode == 0, output[-3000:]
  assert 'Reference log-probabilities of 64 train pairs computed' in done.stderr
  resumed = run_module('launch.train', *full, f'--model_dir={cut}')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'Reference log-probabilities read from' in resumed.stderr
  expected, found = (read_events(run)['scalars'] for run in (straight, cut))
  assert expected['eval/loss'][0][1] == pytest.approx(math.log(2), rel=1e-6)
  for tag in ('train/loss', 'eval/loss', 'eval/rewards/margins'):
    assert dict(found[tag]) == dict(expected[tag]), tag
  with open(tmp_path / 'eval.jsonl', 'a') as f:
    f.write(json.dumps({'prompt': 'Say it.', 'chosen': 'it', 'rejected': 'IT'}) + '\n')
  changed = run_module('launch.train', *full, f'--model_dir={cut}',
                       '--gin_bindings=train.num_steps = 30')
  assert changed.returncode == 2, changed.stderr[-3000:]
  assert 'reference_logps.json' in changed.stderr and 'files' in changed.stderr


def test_starting_from_trained_adapters_needs_a_merge_or_a_precomputed_reference(
    launched, tmp_path):
  """A LoRA run started from trained adapters (a LoRA SFT, here the DPO run)
  would compare with the base, not with where it starts: exit 2 naming the
  fixes; with the reference precomputed from the start, step 0 is ln 2."""
  start = [f"--gin_bindings=checkpoint.init_from = '{launched['straight']}'",
           '--gin_bindings=train.num_steps = 2']
  refused, started = run_modules([
      ('launch.train', *bindings(launched['root']), *start, f'--model_dir={tmp_path}/in_step'),
      ('launch.train', *bindings(launched['root']), *start, f'--model_dir={tmp_path}/ahead',
       '--gin_bindings=dpo.precompute_reference = True')])
  assert refused.returncode == 2, refused.stderr[-3000:]
  assert 'trained LoRA adapters' in refused.stderr and 'precompute_reference' in refused.stderr
  assert started.returncode == 0, started.stderr[-3000:]
  scalars = read_events(f'{tmp_path}/ahead')['scalars']
  assert scalars['eval/loss'][0][1] == pytest.approx(math.log(2), rel=1e-6)
  assert scalars['eval/rewards/accuracies'][0][1] == 0.0


def test_a_published_model_sft_then_dpo_ships_as_hugging_face(tmp_path):
  """The docs' path end to end on a tiny Llama in Hugging Face's format:
  import, LoRA SFT on instruction examples, merged export and import, LoRA
  DPO on pairs from that merged model, merged export. KerasHub's reading of
  the export computes the DPO run's logits; transformers reads its
  tokenizer, chat template and stop ids; the DPO run's step 0 is ln 2 (its
  reference is the SFT model)."""
  from plugins import hf, inference  # pylint: disable=g-import-not-at-top
  from tests import hf_fixtures  # pylint: disable=g-import-not-at-top
  from tests.test_hf_models import TOKENS, TOLERANCE, keras_hub_logits, relative_error  # pylint: disable=g-import-not-at-top
  from tests.test_lora import assert_ships_with_tokens  # pylint: disable=g-import-not-at-top
  paths = write_pairs(str(tmp_path / 'data'), num_train=32, num_eval=8)
  chats = str(tmp_path / 'data' / 'chats.jsonl')
  with open(paths['train']) as source, open(chats, 'w') as out:
    out.writelines(json.dumps({'prompt': json.loads(line)['prompt'],
                               'response': json.loads(line)['chosen']}) + '\n' for line in source)
  base_hf, base, sft, merged, tuned = (
      str(tmp_path / name) for name in ('hf', 'base', 'sft', 'merged', 'dpo'))
  hf_fixtures.write_checkpoint(base_hf, 'llama', tokenizer='chat')
  hf.import_run(hf_dir=base_hf, model_dir=base)
  common = ['--gin_bindings=lora.rank = 4', "--gin_bindings=lora.targets = [r'.*/attn/w[qv]']",
            '--gin_bindings=train.num_steps = 3', '--gin_bindings=train.batch_size = 4',
            '--gin_bindings=train.eval_every = 0', '--gin_bindings=optimizer.warmup_steps = 0',
            '--gin_bindings=optimizer.learning_rate = 0.01']
  done = run_module(
      'launch.train', f'--gin_file={base}/config.gin', f'--model_dir={sft}', *common,
      f"--gin_bindings=checkpoint.init_from = '{base}'", '--gin_bindings=data.task = @instruct()',
      f"--gin_bindings=instruct.train_files = '{chats}'",
      f"--gin_bindings=instruct.eval_files = '{chats}'",
      f"--gin_bindings=instruct.tokenizer = '{base}'",
      f'--gin_bindings=instruct.vocab_size = {hf_fixtures.VOCAB}',
      '--gin_bindings=instruct.seq_len = 64')
  assert done.returncode == 0, done.stderr[-3000:]
  hf.export_run(export_dir=str(tmp_path / 'sft_hf'), model_dir=sft,
                files=[inference.run_config(model_dir=sft)])
  hf.import_run(hf_dir=str(tmp_path / 'sft_hf'), model_dir=merged)
  done = run_module(
      'launch.train', f'--gin_file={merged}/config.gin', f'--model_dir={tuned}', *common,
      f"--gin_bindings=checkpoint.init_from = '{merged}'",
      '--gin_bindings=data.task = @preference()',
      f"--gin_bindings=preference.train_files = '{paths['train']}'",
      f"--gin_bindings=preference.eval_files = '{paths['eval']}'",
      f"--gin_bindings=preference.tokenizer = '{merged}'",
      f'--gin_bindings=preference.vocab_size = {hf_fixtures.VOCAB}',
      '--gin_bindings=preference.seq_len = 64', '--gin_bindings=train.eval_batches = 1')
  assert done.returncode == 0, done.stderr[-3000:]
  assert read_events(tuned)['scalars']['eval/loss'][0][1] == pytest.approx(math.log(2),
                                                                           rel=1e-6)
  exported = str(tmp_path / 'dpo_hf')
  hf.export_run(export_dir=exported, model_dir=tuned,
                files=[inference.run_config(model_dir=tuned)])

  def logits(run):
    loaded = inference.load_decoder(files=[inference.run_config(model_dir=run)], model_dir=run)
    return loaded.lm.logits(TOKENS).numpy()
  ours = logits(tuned)
  assert relative_error(logits(merged), ours) > 100 * TOLERANCE  # DPO's adapters matter
  assert relative_error(keras_hub_logits(exported), ours) < TOLERANCE
  assert_ships_with_tokens(exported, tuned=tuned, base=merged)
