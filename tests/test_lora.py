"""Fine-tuning: LoRA adapters on a frozen base, and `train.trainable`.

In process: step 0 equals the base model exactly; only the adapters train
and carry optimizer state; the same LoRA run on one device, `data=8` and the
2x4 Megatron mesh (FSDP and the pipelines are crossed with LoRA in the
composition matrix, tests/composition.py). A LoRA checkpoint holds its
adapters, their moments and counters, and names its base for the rest
(restored exactly on another mesh; a moved or changed base is an error);
on a Llama-shaped model its bytes on disk are within 1.1x of the adapters
and moments. Launched: a LoRA run started from a base run
(`checkpoint.init_from`), preempted and resumed, against the same run
straight through; eval with the base moved; targets that match nothing exit 2.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from layout_core.checkpoint.frozen_base import CheckpointView
from layout_core.errors import ConfigError
from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model.lm import transformer_lm_params
from layout_core.model.lora import LoraConfig, is_adapter
from layout_core.model.tuning import tune
from layout_core.optim import OptimizerConfig
from layout_core.run import make_trainer
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig
from tests import composition
from tests.conftest import (TWO_DEVICES, Launched, killed_if_left, read_events, run_module,
                            run_modules)
from tests.numerics import assert_close
from tests.test_layout_scope import MEGATRON

MODEL = dict(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64, num_layers=2, max_len=16,
             dropout_rate=0.1)
LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets=(r'.*/attn/w[qv]', r'.*/ffn/w_.*'))
BATCH = 8


def make(mesh, *, lora=None, trainable=None, rules=MEGATRON, steps=3):
  model = tune(transformer_lm_params(**MODEL), lora=lora, trainable=trainable)
  return make_trainer(
      model=model, mesh=mesh, rules=LayoutRules(list(rules)),
      task=MarkovTask(vocab_size=32, seq_len=16, seed=3),
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
      config=TrainConfig(num_steps=steps, batch_size=BATCH, log_every=1, eval_every=0,
                         eval_batches=1))


def values(trainer) -> dict[str, np.ndarray]:
  return {path: to_numpy(v) for path, v in trainer.engine.variables.items()}


def train(trainer, steps: int) -> list[float]:
  reader = trainer.task.reader(split='train', batch_size=BATCH)
  return [float(to_numpy(trainer.train_step(next(reader))[0])) for _ in range(steps)]


@pytest.fixture(scope='module')
def lora_run(mesh_2x4):
  """A LoRA trainer on the 2x4 Megatron mesh: its initial values, 3 steps'
  losses, its values after them."""
  trainer = make(mesh_2x4, lora=LORA)
  before = values(trainer)
  losses = train(trainer, 3)
  return trainer, before, losses, values(trainer)


def test_step_0_equals_the_base_model_exactly(lora_run, mesh_2x4):
  """B starts at zero: the first step's loss (with dropout) and the held-out
  loss equal the base model's bit for bit."""
  trainer, _, losses, _ = lora_run
  base = make(mesh_2x4)
  assert make(mesh_2x4, lora=LORA).evaluate()[0] == base.evaluate()[0]
  assert train(base, 1)[0] == losses[0]
  assert losses[1] != losses[0]  # and then it trains


def test_only_the_adapters_change_and_hold_optimizer_state(lora_run):
  trainer, before, _, after = lora_run
  adapters = sorted(p for p in before if is_adapter(p))
  assert len(adapters) == 2 * (2 * 2 + 2 * 2)  # A and B of wq, wv, w_in, w_out per block
  for path in before:
    if is_adapter(path):
      continue
    np.testing.assert_array_equal(after[path], before[path], err_msg=path)
  changed = [p for p in adapters if not np.array_equal(after[p], before[p])]
  assert changed == adapters
  optimizer = trainer.engine.optimizer
  assert sorted(optimizer.paths) == adapters
  slots = [v for name in optimizer.SLOT_NAMES for v in getattr(optimizer, name).values()]
  assert len(slots) == 2 * len(adapters)  # Adam's two moments each
  adapter_bytes = sum(before[p].nbytes for p in adapters)
  assert sum(int(np.prod(v.shape)) * 4 for v in slots) == 2 * adapter_bytes


def test_the_same_losses_on_one_device_data8_and_the_megatron_mesh(lora_run, mesh_data8):
  """Within 'order' (tests/composition.py: another mesh sums in another
  order; measured 6.9e-08 of the losses' scale for both meshes, by default,
  without oneDNN and on one thread); the adapters follow their weights'
  split on 2x4."""
  reference = train(make(build_mesh(MeshSpec(shape={'data': 1})), lora=LORA, rules=()), 3)
  assert_close(train(make(mesh_data8, lora=LORA, rules=()), 3), reference,
               rel=composition.TOLERANCES['order'], what='data=8 vs one device')
  assert_close(lora_run[2], reference, rel=composition.TOLERANCES['order'],
               what='2x4 Megatron vs one device')


def test_train_trainable_freezes_everything_else(mesh_2x4):
  norms = (r'.*/ln_\w+/.*', r'lm/final_ln/.*')
  trainer = make(mesh_2x4, trainable=norms, steps=2)
  before = values(trainer)
  train(trainer, 2)
  after = values(trainer)
  trained = sorted(p for p in before if not np.array_equal(before[p], after[p]))
  assert trained and all('ln' in p for p in trained), trained
  assert sorted(trainer.engine.optimizer.paths) == sorted(
      p for p in before if 'ln' in p.rsplit('/', 2)[-2])


def test_targets_that_adapt_nothing_are_named():
  with pytest.raises(ConfigError, match=r"\.\*/nothing") as error:
    tune(transformer_lm_params(**MODEL), lora=LoraConfig(rank=2, targets=('.*/nothing',)),
         trainable=None)
  with pytest.raises(ConfigError, match='no layer contracts') as error:
    tune(transformer_lm_params(**MODEL), lora=LoraConfig(rank=2, targets=('.*/emb/table',)),
         trainable=None)
  assert 'lm/emb/table' in str(error.value)
  with pytest.raises(ConfigError, match='train.trainable'):
    tune(transformer_lm_params(**MODEL), lora=None, trainable=('.*/nothing',))


def checkpoint_bytes(directory: str) -> tuple[int, int]:
  """(bytes of the tensor data files, bytes of every file) of a ckpt-N directory."""
  sizes = {n: os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)}
  return sum(v for n, v in sizes.items() if '.data-' in n), sum(sizes.values())


def trained_bytes(variables) -> int:
  """What a checkpoint must hold for training to go on: every trainable
  variable and Adam's two moments of it, from shapes and dtypes alone."""
  return sum(3 * int(np.prod(v.shape)) * v.dtype.size for v in variables if v.trainable)


def test_a_lora_checkpoint_holds_what_trains_and_names_its_base(lora_run, mesh_2x4, mesh_data8,
                                                                tmp_path):
  """A LoRA run started from a base checkpoint (`init_from`) saves its
  adapters, their Adam moments and its counters, and base.json, not the
  frozen weights. A fresh run on another mesh restores
  every value the trained one holds, the frozen ones read from the base.
  A moved base is an error naming it, until `checkpoint.moved_base` says
  where it went; a changed one (another checkpoint in its place) is an error
  saying what differs. Neither error changes anything on disk. A run started
  from the tuned one refers to the same base; the base and the tuned run
  moved together are found by the relative path base.json records."""
  from layout_core.checkpoint.frozen_base import BASE_FILE  # pylint: disable=g-import-not-at-top
  from layout_core.checkpoint.manager import (  # pylint: disable=g-import-not-at-top
      CheckpointConfig, Checkpointer, checkpoint_keys)
  trainer, before, _, after = lora_run
  base = make(mesh_2x4)
  for path, value in values(base).items():  # the run's frozen weights are the base's
    np.testing.assert_array_equal(before[path], value, err_msg=path)
  base_dir, tuned_dir = str(tmp_path / 'base'), str(tmp_path / 'tuned')
  saver = Checkpointer(directory=f'{base_dir}/checkpoints', state=base.state(),
                       config=CheckpointConfig())
  saver.prepare_directory()
  saver.save(0, reason='final')
  variables = trainer.engine.variables
  tuned = Checkpointer(directory=f'{tuned_dir}/checkpoints', state=trainer.state(),
                       config=CheckpointConfig())
  tuned.init_from(base_dir, variables, new=[p for p in variables if is_adapter(p)],
                  frozen=[p for p, v in variables.items() if not v.trainable])
  tuned.prepare_directory()
  prefix = tuned.save(3, reason='final')
  keys = set(tf.train.load_checkpoint(prefix).get_variable_to_shape_map())
  by_key = checkpoint_keys(trainer.state())
  frozen = {k for k, v in by_key.items() if k.startswith('model/') and not v.trainable}
  assert len(frozen) == len([v for v in variables.values() if not v.trainable])
  assert not frozen & keys, sorted(frozen & keys)[:3]
  assert set(by_key) - frozen <= keys  # adapters, moments, counters

  def restored(step: int = 4, run: str = tuned_dir, **config):
    fresh = make(mesh_data8, lora=LORA, rules=())
    restorer = Checkpointer(directory=f'{run}/checkpoints', state=fresh.state(),
                            config=CheckpointConfig(**config))
    assert restorer.restore_latest() == step
    return fresh, restorer
  fresh, restorer = restored(3)
  for path, value in values(fresh).items():
    np.testing.assert_array_equal(value, after[path], err_msg=path)
  slots = lambda t: {(n, p): to_numpy(v) for n in t.engine.optimizer.SLOT_NAMES  # noqa: E731
                     for p, v in getattr(t.engine.optimizer, n).items()}
  expected_slots = slots(trainer)
  for name, value in slots(fresh).items():
    np.testing.assert_array_equal(value, expected_slots[name], err_msg=str(name))
  assert restorer.save(4, reason='final')  # and saves by reference again
  assert os.path.isfile(f'{tuned_dir}/checkpoints/ckpt-4/{BASE_FILE}')
  chained = Checkpointer(directory=str(tmp_path / 'chained'), state=fresh.state(),
                         config=CheckpointConfig())
  fresh_variables = fresh.engine.variables
  chained.init_from(tuned_dir, fresh_variables,
                    frozen=[p for p, v in fresh_variables.items() if not v.trainable])
  assert chained.base.prefix == f'{base_dir}/checkpoints/ckpt-0/ckpt'  # not the tuned run

  snapshot = {n: open(f'{tuned_dir}/checkpoints/ckpt-4/{n}', 'rb').read()
              for n in os.listdir(f'{tuned_dir}/checkpoints/ckpt-4')}
  moved = str(tmp_path / 'elsewhere')
  os.rename(base_dir, moved)
  with pytest.raises(ConfigError) as error:
    restored()
  message = str(error.value)
  assert f'{base_dir}/checkpoints/ckpt-0/ckpt: missing' in message, message
  assert 'checkpoint.moved_base' in message
  restored(moved_base=f'{moved}/checkpoints/ckpt-0')
  os.makedirs(base_dir)
  other = make(mesh_2x4, lora=None)
  other.engine.variables['lm/emb/table'].assign_add(tf.ones_like(
      other.engine.variables['lm/emb/table']))
  saver = Checkpointer(directory=f'{base_dir}/checkpoints', state=other.state(),
                       config=CheckpointConfig())
  saver.prepare_directory()
  saver.save(0, reason='final')  # another checkpoint where the base was
  with pytest.raises(ConfigError, match='has changed: the same tensor names and shapes, '
                                        'other contents'):
    restored()
  assert snapshot == {n: open(f'{tuned_dir}/checkpoints/ckpt-4/{n}', 'rb').read()
                      for n in os.listdir(f'{tuned_dir}/checkpoints/ckpt-4')}
  os.makedirs(tmp_path / 'tree')  # both runs moved together: found by the relative path
  os.rename(tuned_dir, tmp_path / 'tree' / 'tuned')
  os.rename(moved, tmp_path / 'tree' / 'base')
  restored(run=str(tmp_path / 'tree' / 'tuned'))


# Llama's shape at a size a test can hold: RMSNorm, RoPE, grouped-query
# attention, SwiGLU, untied output; PEFT's default targets (q and v), rank 8.
LLAMA = dict(vocab_size=2048, model_dim=512, num_heads=8, num_kv_heads=2, ffn_dim=1376,
             num_layers=4, max_len=0, norm='rms', positions='rope', ffn='swiglu',
             output_bias=False)
LLAMA_LORA = LoraConfig(rank=8, alpha=16.0, targets=(r'.*/attn/w[qv]',))


def test_a_llama_shaped_lora_checkpoint_is_its_adapters_and_their_moments(tmp_path):
  """Bytes on disk of a LoRA checkpoint of a Llama-shaped model (13M
  weights, rank-8 adapters on q and v): every file of the checkpoint
  directory together within 1.1x of the adapters and their two Adam
  moments, counted from shapes and dtypes; the same state saved without a
  base (as every LoRA checkpoint was before) is over 10x that."""
  from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer  # pylint: disable=g-import-not-at-top
  model = tune(transformer_lm_params(**LLAMA), lora=LLAMA_LORA, trainable=None)
  trainer = make_trainer(
      model=model, mesh=build_mesh(MeshSpec(shape={'data': 1})), rules=LayoutRules([]),
      task=MarkovTask(vocab_size=2048, seq_len=16, seed=3),
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
      config=TrainConfig(num_steps=1, batch_size=2, eval_every=0, eval_batches=1))
  variables = trainer.engine.variables

  def saved(name: str, **init) -> tuple[int, int]:
    checkpointer = Checkpointer(directory=str(tmp_path / name), state=trainer.state(),
                                config=CheckpointConfig())
    if init:
      checkpointer.init_from(init['source'], variables,
                             frozen=[p for p, v in variables.items() if not v.trainable])
    checkpointer.prepare_directory()
    return checkpoint_bytes(os.path.dirname(checkpointer.save(1, reason='final')))
  whole = saved('whole')[1]
  data, total = saved('tuned', source=str(tmp_path / 'whole'))
  expected = trained_bytes(variables.values())
  print(f'LoRA checkpoint: {total} bytes ({data} of tensor data) for {expected} bytes of '
        f'adapters and moments: {total / expected:.3f}x; the whole state: {whole} bytes')
  assert total <= 1.1 * expected, (total, expected)
  assert whole > 10 * expected, (whole, expected)


QUICK = ['--gin_file=configs/experiments/quickstart.gin', TWO_DEVICES,
         '--gin_bindings=train.log_every = 1',
         '--gin_bindings=train.eval_every = 0', '--gin_bindings=train.eval_batches = 1',
         '--gin_bindings=data.seq_len = 32', '--gin_bindings=train.batch_size = 16']
ADAPT = ['--gin_bindings=lora.rank = 4', "--gin_bindings=lora.targets = [r'.*/attn/w[qv]']"]


def test_a_lora_run_from_a_base_run_resumes_exactly_and_keeps_the_base(tmp_path):
  """A base run (2 steps) starts LoRA runs (`checkpoint.init_from`): one
  straight through 6 steps, one preempted (SIGTERM) and resumed. The resumed
  run's losses equal the straight run's exactly; its final checkpoint holds
  the base run's weights bit for bit and changed adapters. With targets
  matching nothing, launch.train exits 2 naming them. The tuned checkpoint
  holds the frozen weights by reference to the base's; with the base moved,
  launch.eval exits 2 naming it, and reads it where `checkpoint.moved_base`
  says."""
  base = str(tmp_path / 'base')
  result = run_module('launch.train', *QUICK, '--gin_bindings=train.num_steps = 2',
                      f'--model_dir={base}')
  assert result.returncode == 0, result.stderr[-3000:]
  tune_from = [*QUICK, *ADAPT, '--gin_bindings=train.num_steps = 6',
               f"--gin_bindings=checkpoint.init_from = '{base}'",
               '--gin_bindings=checkpoint.every_steps = 0']
  straight, cut = str(tmp_path / 'straight'), str(tmp_path / 'cut')
  preempted = Launched('launch.train', *tune_from, f'--model_dir={cut}', label='preempted')
  with killed_if_left(preempted):
    done = run_modules([('launch.train', *tune_from, f'--model_dir={straight}'),
                        ('launch.train', *QUICK, "--gin_bindings=lora.rank = 4",
                         "--gin_bindings=lora.targets = ['.*/nothing']",
                         f'--model_dir={tmp_path}/bad')])
    output = preempted.stop_after(r'step 2/6')
  assert done[0].returncode == 0, done[0].stderr[-3000:]
  assert done[1].returncode == 2 and '.*/nothing' in done[1].stderr, done[1].stderr[-2000:]
  assert 'Saved checkpoint' in output, output[-2000:]
  resumed = run_module('launch.train', *tune_from, f'--model_dir={cut}')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  losses = {run: dict(read_events(run)['scalars']['train/loss']) for run in (straight, cut)}
  assert sorted(losses[cut]) == sorted(losses[straight]) == list(range(1, 7))
  assert losses[cut] == losses[straight]
  base_reader = tf.train.load_checkpoint(f'{base}/checkpoints/ckpt-2/ckpt')
  tuned = CheckpointView(f'{cut}/checkpoints/ckpt-6/ckpt')
  assert tuned.base_prefix == f'{base}/checkpoints/ckpt-2/ckpt'
  model_keys = [k for k in tuned.shapes
                if k.startswith('model/') and k.endswith('.ATTRIBUTES/VARIABLE_VALUE')]
  adapters = [k for k in model_keys if '_lora_' in k]
  assert adapters and len(model_keys) > len(adapters)
  for key in model_keys:
    if key in adapters:
      continue
    assert key not in tuned.own  # held by the base, not copied
    np.testing.assert_array_equal(tuned.get_tensor(key), base_reader.get_tensor(key),
                                  err_msg=key)
  assert any(tuned.get_tensor(k).any() for k in adapters if '_lora_b' in k)
  moved = str(tmp_path / 'moved')
  os.rename(base, moved)
  evals = run_modules([('launch.eval', f'--model_dir={cut}', f'--output_dir={tmp_path}/e1'),
                       ('launch.eval', f'--model_dir={cut}', f'--output_dir={tmp_path}/e2',
                        f"--gin_bindings=checkpoint.moved_base = '{moved}'")])
  assert evals[0].returncode == 2, evals[0].stderr[-3000:]
  assert (f'{base}/checkpoints/ckpt-2/ckpt: missing' in evals[0].stderr and
          'checkpoint.moved_base' in evals[0].stderr and 'Traceback' not in evals[0].stderr)
  assert evals[1].returncode == 0, evals[1].stderr[-3000:]


def test_merged_and_peft_exports_compute_the_lora_models_logits(tmp_path):
  """A Llama imported from Hugging Face, fine-tuned with LoRA for 3 steps
  (adapters on q, v and the gated FFN, from `checkpoint.init_from`): its
  logits equal those of (1) its Hugging Face export with the adapters
  merged, read by KerasHub; (2) its SavedModel (merged); (3) the base
  re-imported with its PEFT-format adapters (`--adapters_only`, then
  `launch.import_hf --peft_dir`), whose adapters are the run's bit for bit.
  Control: the base model's logits differ. The tuned run carries the base's
  tokenizer and import record, so its Hugging Face export loads in
  transformers with the chat template, and its config.json and
  generation_config.json stop at the end-of-turn token as well as EOS; the
  PEFT adapters name the imported directory as their base (the tuned
  checkpoint holds the frozen weights by reference to it), and with
  `train.trainable` beside LoRA --adapters_only exits naming the weights."""
  from plugins import hf, inference  # pylint: disable=g-import-not-at-top
  from tests import hf_fixtures  # pylint: disable=g-import-not-at-top
  from tests.test_hf_models import TOKENS, TOLERANCE, keras_hub_logits, relative_error  # pylint: disable=g-import-not-at-top
  base_hf, base, tuned = (str(tmp_path / name) for name in ('hf', 'base', 'tuned'))
  hf_fixtures.write_checkpoint(base_hf, 'llama', tokenizer='chat')
  hf.import_run(hf_dir=base_hf, model_dir=base)
  done = run_module(
      'launch.train', f'--gin_file={base}/config.gin', f'--model_dir={tuned}',
      '--gin_bindings=lora.rank = 4', '--gin_bindings=lora.alpha = 8.0',
      "--gin_bindings=lora.targets = [r'.*/attn/w[qv]', r'.*/ffn/w_(gate|up|down)']",
      f"--gin_bindings=checkpoint.init_from = '{base}'", '--gin_bindings=train.num_steps = 3',
      '--gin_bindings=train.batch_size = 4', '--gin_bindings=train.eval_every = 0',
      '--gin_bindings=optimizer.warmup_steps = 0', '--gin_bindings=optimizer.learning_rate = 0.01')
  assert done.returncode == 0, done.stderr[-3000:]
  done = run_module('launch.export', f'--model_dir={tuned}', f'--export_dir={tmp_path}/saved',
                    '--max_new_tokens=2')
  assert done.returncode == 0, done.stderr[-3000:]

  def logits(run):
    loaded = inference.load_decoder(files=[inference.run_config(model_dir=run)], model_dir=run)
    return loaded.lm.logits(TOKENS).numpy()
  ours = logits(tuned)
  assert relative_error(logits(base), ours) > 100 * TOLERANCE  # the adapters matter
  view = CheckpointView(inference.find_checkpoint(model_dir=tuned)[1])
  assert view.base_prefix == f'{base}/checkpoints/ckpt-0/ckpt'  # every read below goes there
  assert 'model/lm/emb/table/.ATTRIBUTES/VARIABLE_VALUE' not in view.own
  files = [inference.run_config(model_dir=tuned)]
  hf.export_run(export_dir=str(tmp_path / 'merged'), model_dir=tuned, files=files)
  assert relative_error(keras_hub_logits(str(tmp_path / 'merged')), ours) < TOLERANCE
  assert_ships_with_tokens(str(tmp_path / 'merged'), tuned=tuned, base=base)
  served = tf.saved_model.load(str(tmp_path / 'saved')).signatures['serving_default']
  padded = np.zeros((TOKENS.shape[0], 64), np.int32)  # serving_default's positions
  padded[:, :TOKENS.shape[1]] = TOKENS
  out = next(iter(served(tokens=tf.constant(padded)).values())).numpy()[:, :TOKENS.shape[1]]
  assert relative_error(out, ours) < TOLERANCE
  written = hf.export_run(export_dir=str(tmp_path / 'peft'), model_dir=tuned, files=files,
                          adapters_only=True)
  assert written['modules'] == ['down_proj', 'gate_proj', 'q_proj', 'up_proj', 'v_proj']
  with open(f'{tmp_path}/peft/adapter_config.json') as f:
    adapter_config = json.load(f)
  assert adapter_config['base_model_name_or_path'] == os.path.abspath(base_hf)
  assert 'layers_to_transform' not in adapter_config  # every layer is adapted
  with pytest.raises(ConfigError) as raised:
    hf.export_run(export_dir=str(tmp_path / 'peft2'), model_dir=tuned, files=files,
                  bindings=["train.trainable = ['.*/final_ln/.*']"], adapters_only=True)
  assert 'lm/final_ln/scale' in str(raised.value) and not os.path.exists(tmp_path / 'peft2')
  again = str(tmp_path / 'again')
  done = run_module('launch.import_hf', f'--hf_dir={base_hf}', f'--peft_dir={tmp_path}/peft',
                    f'--model_dir={again}')
  assert done.returncode == 0, done.stderr[-3000:]
  assert relative_error(logits(again), ours) < TOLERANCE
  saved = {run: tf.train.load_checkpoint(inference.find_checkpoint(model_dir=run)[1])
           for run in (tuned, again)}
  keys = [k for k in saved[again].get_variable_to_shape_map() if '_lora_' in k and
          k.startswith('model/')]
  assert len(keys) == 2 * 5 * 2  # A and B of 5 weights in each of 2 blocks
  for key in keys:
    np.testing.assert_array_equal(saved[again].get_tensor(key), saved[tuned].get_tensor(key))


def assert_ships_with_tokens(exported: str, *, tuned: str, base: str) -> None:
  """The export of a run tuned from an imported chat model, read by
  transformers: its tokenizer with the base's chat template, and EOS ids
  [</s>, <|eot|>] in config.json and generation_config.json."""
  from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # pylint: disable=g-import-not-at-top
  from tests import hf_fixtures  # pylint: disable=g-import-not-at-top
  assert os.path.isdir(f'{tuned}/tokenizer')  # carried by checkpoint.init_from
  with open(f'{tuned}/hf_import.json') as f:
    assert json.load(f)['init_from'] == os.path.abspath(base)
  tokenizer = AutoTokenizer.from_pretrained(exported)
  assert tokenizer.chat_template == hf_fixtures.CHAT_TEMPLATE
  assert tokenizer.apply_chat_template([{'role': 'user', 'content': 'count'}], tokenize=False,
                                       add_generation_prompt=True).endswith('assistant\n')
  stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids('<|eot|>')]
  assert stops == [2, 4]  # the fixture's ids (config.json's eos_token_id is 2)
  assert GenerationConfig.from_pretrained(exported).eos_token_id == stops
  config = AutoConfig.from_pretrained(exported)
  assert (config.eos_token_id, config.bos_token_id) == (stops, tokenizer.bos_token_id)
