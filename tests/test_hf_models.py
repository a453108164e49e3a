"""Imported runs compute what KerasHub's own conversion of the same Hugging
Face directory computes, on one device, on 8 and on a 2x4 Megatron mesh;
import -> export -> import is bit for bit; every launcher takes the run.

    python -m pytest tests/test_hf_models.py -x -q

The reference is KerasHub 0.32 (`keras_hub.models.Backbone.from_preset` of
the directory: its own config and weight conversion, its own layers); its
greedy decoding here runs the whole sequence again for every token, with
no cache, so it shares nothing with meshgin's cached decoder. Tolerances
are relative to the largest reference logit (measured: see TOLERANCE).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from layout_core.lazy import tf
from plugins import gin_setup, hf, inference
from plugins.plan import make_plan
from tests import hf_fixtures
from tests.conftest import read_events, run_module, run_modules

FAMILIES = tuple(hf_fixtures.CONFIGS)
# max |meshgin - KerasHub| / max |KerasHub| over the logits, float32 both (each
# test prints what it measured; about ten times that leaves room for another
# CPU's order of summation).
TOLERANCE = 1e-5
NEW_TOKENS = 6
TOKENS = np.random.default_rng(7).integers(3, hf_fixtures.VOCAB, size=(8, 12)).astype(np.int32)


@pytest.fixture(scope='module')
def hf_dirs(tmp_path_factory) -> dict[str, str]:
  root = tmp_path_factory.mktemp('hf')
  dirs = {}
  for family in FAMILIES:
    dirs[family] = str(root / family)
    hf_fixtures.write_checkpoint(dirs[family], family)
  return dirs


def keras_hub_logits(directory: str, ids: np.ndarray = TOKENS) -> np.ndarray:
  """The logits of `ids` by KerasHub's own conversion of a Hugging Face directory."""
  import keras_hub  # pylint: disable=g-import-not-at-top
  backbone = keras_hub.models.Backbone.from_preset(directory)
  hidden = backbone({'token_ids': ids, 'padding_mask': np.ones_like(ids)})
  return np.asarray(backbone.token_embedding(hidden, reverse=True))


@pytest.fixture(scope='module')
def keras_hub_reference(hf_dirs) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """name -> (logits of TOKENS, greedy continuation of TOKENS[:2, :5]) by KerasHub."""
  import keras_hub  # pylint: disable=g-import-not-at-top
  reference = {}
  for name, directory in hf_dirs.items():
    backbone = keras_hub.models.Backbone.from_preset(directory)

    def logits(ids):
      hidden = backbone({'token_ids': ids, 'padding_mask': np.ones_like(ids)})
      return np.asarray(backbone.token_embedding(hidden, reverse=True))
    ids = TOKENS[:2, :5]
    for _ in range(NEW_TOKENS):
      ids = np.concatenate([ids, logits(ids)[:, -1:].argmax(-1).astype(np.int32)], axis=1)
    reference[name] = (logits(TOKENS), ids[:, 5:])
  return reference


def import_to(hf_dir: str, model_dir: str, *, files=(), bindings=()) -> str:
  hf.import_run(hf_dir=hf_dir, model_dir=model_dir, files=files, bindings=bindings)
  return model_dir


@pytest.fixture(scope='module')
def runs(hf_dirs, tmp_path_factory) -> dict[str, str]:
  """family -> its run, imported on one device."""
  root = tmp_path_factory.mktemp('runs')
  return {family: import_to(hf_dirs[family], str(root / family)) for family in FAMILIES}


def decoder(model_dir: str):
  return inference.load_decoder(files=[inference.run_config(model_dir=model_dir)],
                                model_dir=model_dir)


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
  return float(np.abs(ours - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize('family', FAMILIES)
def test_logits_and_greedy_decoding_equal_keras_hub(family, runs, keras_hub_reference):
  logits, continuation = keras_hub_reference[family]
  loaded = decoder(runs[family])
  ours = loaded.lm.logits(TOKENS).numpy()
  error = relative_error(ours, logits)
  print(f'{family}: relative logit error {error:.2e}')
  assert error < TOLERANCE
  assert not np.allclose(ours[:, 1:], ours[:, :1], atol=1e-3)  # control: positions matter
  prompts = TOKENS[:2, :5]
  new = loaded.lm.generate(prompts, np.array([5, 5], np.int32),
                           max_new_tokens=NEW_TOKENS).numpy()
  np.testing.assert_array_equal(new, continuation)


@pytest.mark.parametrize('name, files, shape, more', [
    ('llama', (), {'data': 8}, []),
    ('llama', ('configs/layouts/megatron_llama.gin',), {'data': 2, 'model': 4}, []),
    ('qwen2', ('configs/layouts/megatron_qwen2.gin',), {'data': 2, 'model': 4},
     ['train.fsdp = True']),
    ('gpt2', ('configs/layouts/megatron_gpt2.gin',), {'data': 2, 'model': 4}, []),
    ('mixtral', ('configs/layouts/moe_expert_fsdp.gin',), {'expert': 4, 'data': 2}, []),
    ('qwen2_moe', ('configs/layouts/moe_expert_megatron.gin',),
     {'expert': 2, 'data': 2, 'model': 2}, []),
    ('qwen2_moe', ('configs/layouts/moe_expert.gin',), {'expert': 4},
     ["train.batch_axis = 'expert'"]),
], ids=['llama-data8', 'llama-megatron', 'qwen2-megatron-fsdp', 'gpt2-megatron',
        'mixtral-expert4xdata2-fsdp',
        'qwen2_moe-expert2xdata2xmodel2', 'qwen2_moe-expert4-gshard'])
def test_an_import_on_a_mesh_computes_the_same_logits(name, files, shape, more, hf_dirs,
                                                      keras_hub_reference, tmp_path):
  # Strict: every rule lays out a variable; but the tied families' models
  # (the fixtures' Qwen2 and GPT-2) have no softmax/w for its rule to find.
  strict = name == 'llama'
  run = import_to(hf_dirs[name], str(tmp_path / 'run'), files=files,
                  bindings=[f'mesh.shape = {shape!r}', f'layout_rules.strict = {strict}', *more])
  loaded = decoder(run)
  assert loaded.plan.mesh_spec.shape == shape
  if 'model' in shape:  # control: the weights really are split over 'model'
    wq = loaded.trained.variables['lm/stack/block_000/attn/wq']
    assert 'model' in tf.experimental.dtensor.fetch_layout(wq).sharding_specs
  if 'expert' in shape:  # ... and the experts over 'expert'
    experts = loaded.trained.variables['lm/stack/block_001/moe/w_gate']
    assert tf.experimental.dtensor.fetch_layout(experts).sharding_specs[0] == 'expert'
  logits, continuation = keras_hub_reference[name]
  error = relative_error(loaded.lm.logits(TOKENS).numpy(), logits)
  print(f'{name} on {shape}: relative logit error {error:.2e}')
  assert error < TOLERANCE
  new = loaded.lm.generate(TOKENS[:2, :5], np.array([5, 5], np.int32),
                           max_new_tokens=NEW_TOKENS).numpy()
  np.testing.assert_array_equal(new, continuation)
  # The way back reads the checkpoint the mesh wrote: the same tensors.
  hf.export_run(export_dir=str(tmp_path / 'hf'), model_dir=run,
                files=[inference.run_config(model_dir=run)])
  assert_same_tensors(str(tmp_path / 'hf'), hf_dirs[name], name)


def test_a_pipelined_import_resumes_in_its_pipeline_and_decodes(hf_dirs, keras_hub_reference,
                                                                tmp_path):
  """Imported with an SPMD pipeline configured: written with the plain
  model's keys, which the pipelined trainer's state reads, optimizer included."""
  from layout_core.checkpoint.manager import Checkpointer  # pylint: disable=g-import-not-at-top
  from plugins.training import build_trainer  # pylint: disable=g-import-not-at-top
  run = import_to(hf_dirs['gpt2'], str(tmp_path / 'run'), bindings=[
      "mesh.shape = {'stage': 2, 'data': 4}", 'pipeline.num_stages = 2',
      'pipeline.num_micro_batches = 2', "pipeline.engine = 'spmd'"])
  with gin_setup.parsed_config(files=[inference.run_config(model_dir=run)], bindings=[]):
    plan = make_plan()
  assert plan.pipeline is not None
  trainer = build_trainer(plan)
  checkpointer = Checkpointer(directory=os.path.join(run, 'checkpoints'),
                              state=trainer.state(), config=plan.checkpoint)
  assert checkpointer.check_latest_fits() == 0
  logits, _ = keras_hub_reference['gpt2']
  assert relative_error(decoder(run).lm.logits(TOKENS).numpy(), logits) < TOLERANCE


def assert_same_tensors(exported: str, original: str, family: str) -> None:
  """Every weight of the original Hugging Face directory is in the export,
  bit for bit (GPT-2's are written under GPT2LMHeadModel's `transformer.`)."""
  from layout_core.convert import hf_files, hf_names  # pylint: disable=g-import-not-at-top
  before, after = hf_files.SafetensorsReader(original), hf_files.SafetensorsReader(exported)
  names = {name.removeprefix('transformer.'): name for name in after.shapes}
  weights = [n for n in before.shapes if not hf_names.is_ignored(n, family)]
  assert sorted(weights) == sorted(names)
  for name in weights:
    assert np.array_equal(before.read(name), after.read(names[name])), name


def checkpoint_values(model_dir: str) -> dict[str, np.ndarray]:
  step, prefix = inference.find_checkpoint(model_dir=model_dir)
  assert step == 0
  reader = tf.train.load_checkpoint(prefix)
  return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
          if not key.startswith('_CHECKPOINTABLE')}


@pytest.mark.parametrize('family', FAMILIES)
def test_import_export_import_is_the_same_checkpoint_bit_for_bit(family, runs, hf_dirs,
                                                                  keras_hub_reference, tmp_path):
  exported = str(tmp_path / 'hf')
  written = hf.export_run(export_dir=exported, model_dir=runs[family],
                          files=[inference.run_config(model_dir=runs[family])],
                          max_shard_bytes=50_000)
  assert written['tied'] == (family in ('qwen2', 'gpt2'))
  with open(os.path.join(exported, 'config.json')) as f:
    assert json.load(f)['eos_token_id'] == 2   # kept from the imported config.json
  assert_same_tensors(exported, hf_dirs[family], family)
  # KerasHub reads the export (its config.json is meshgin's): the same logits.
  assert relative_error(keras_hub_logits(exported), keras_hub_reference[family][0]) < TOLERANCE
  again = import_to(exported, str(tmp_path / 'again'))
  first, second = checkpoint_values(runs[family]), checkpoint_values(again)
  assert sorted(first) == sorted(second)
  for key in first:
    assert first[key].dtype == second[key].dtype and np.array_equal(first[key], second[key]), key
  # The fixtures ship no generation_config.json: the export writes one (the
  # config's BOS and EOS; the fixture's tokenizer has no chat template).
  assert sorted(os.listdir(os.path.join(again, 'tokenizer'))) == sorted(
      os.listdir(os.path.join(runs[family], 'tokenizer')) + ['generation_config.json'])
  from transformers import GenerationConfig  # pylint: disable=g-import-not-at-top
  generation = GenerationConfig.from_pretrained(exported)
  assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)


def test_a_qwen2_moe_with_dense_blocks_goes_out_and_in_bit_for_bit(tmp_path):
  """decoder_sparse_step 2: the first block dense (mlp.gate_proj ...), the
  second routed; import -> export -> import writes the same tensors and the
  same checkpoint (KerasHub 0.32 cannot convert such a checkpoint: no
  reference for the logits here)."""
  original = str(tmp_path / 'hf')
  hf_fixtures.write_checkpoint(original, 'qwen2_moe',
                               cfg=hf_fixtures.config('qwen2_moe', decoder_sparse_step=2))
  run = import_to(original, str(tmp_path / 'run'))
  assert 'transformer_lm.moe_every = 2' in open(os.path.join(run, 'config.gin')).read()
  exported = str(tmp_path / 'out')
  hf.export_run(export_dir=exported, model_dir=run, files=[inference.run_config(model_dir=run)])
  assert_same_tensors(exported, original, 'qwen2_moe')
  with open(os.path.join(exported, 'config.json')) as f:
    assert json.load(f)['decoder_sparse_step'] == 2
  again = import_to(exported, str(tmp_path / 'again'))
  first, second = checkpoint_values(run), checkpoint_values(again)
  assert sorted(first) == sorted(second)
  for key in first:
    assert np.array_equal(first[key], second[key]), key


def test_init_from_reads_an_imported_run(runs, tmp_path):
  from plugins.training import build_trainer  # pylint: disable=g-import-not-at-top
  from layout_core.checkpoint.manager import Checkpointer, CheckpointConfig  # pylint: disable=g-import-not-at-top
  run = runs['llama']
  with gin_setup.parsed_config(files=[inference.run_config(model_dir=run)],
                               bindings=['train.seed = 5']):
    plan = make_plan()
  trainer = build_trainer(plan)
  variables = trainer.engine.variables
  before = variables['lm/stack/block_001/ffn/w_up'].numpy()
  checkpointer = Checkpointer(directory=str(tmp_path / 'unused'), state=trainer.state(),
                              config=CheckpointConfig())
  assert checkpointer.init_from(run, variables) == len(variables)
  after = variables['lm/stack/block_001/ffn/w_up'].numpy()
  expected = checkpoint_values(run)['model/stack/block_001/ffn/w_up/.ATTRIBUTES/VARIABLE_VALUE']
  assert not np.array_equal(before, expected) and np.array_equal(after, expected)


def test_the_launchers_take_an_imported_run(hf_dirs, keras_hub_reference, tmp_path):
  """launch.import_hf, then decode (text through the copied tokenizer.json),
  eval, export --format=hf and two steps of training, each a real process."""
  run = str(tmp_path / 'gpt2')
  done = run_module('launch.import_hf', f'--hf_dir={hf_dirs["gpt2"]}', f'--model_dir={run}')
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'Imported a gpt2 model' in done.stdout
  assert sorted(os.listdir(run)) == ['checkpoints', 'config.gin', 'hf_import.json', 'tokenizer']
  done = run_module('launch.decode', f'--model_dir={run}', '--prompt=the quick brown',
                    f'--max_new_tokens={NEW_TOKENS}', f'--output={tmp_path}/out.jsonl')
  assert done.returncode == 0, done.stderr[-3000:]
  with open(tmp_path / 'out.jsonl') as f:
    record = json.loads(f.readline())
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  tokenizer = Tokenizer.from_file(os.path.join(hf_dirs['gpt2'], 'tokenizer.json'))
  assert record['ids'] == tokenizer.encode('the quick brown').ids
  assert record['text'] == tokenizer.decode(record['continuation'], skip_special_tokens=False)
  done = run_module('launch.eval', f'--model_dir={run}', '--gin_bindings=train.eval_batches = 1')
  assert done.returncode == 0 and 'Evaluated' in done.stdout, done.stderr[-3000:]
  done = run_module('launch.export', f'--model_dir={run}', '--format=hf',
                    f'--export_dir={tmp_path}/exported')
  assert done.returncode == 0, done.stderr[-3000:]
  assert os.path.isfile(tmp_path / 'exported' / 'model.safetensors')
  # The import wrote the weights alone: no optimizer state.
  keys = [k for k, _ in tf.train.list_variables(inference.find_checkpoint(model_dir=run)[1])]
  assert any(k.startswith('model/') for k in keys)
  assert not any(k.startswith('optimizer/') for k in keys)
  # launch.train reads only the files it is given: the run's own config.gin here.
  # Resuming the weights-only step 0 (the optimizer fresh) trains as a new run
  # started from the same weights by checkpoint.init_from, step for step.
  steps = ['--gin_bindings=train.num_steps = 2', '--gin_bindings=train.batch_size = 4',
           '--gin_bindings=train.eval_every = 2', '--gin_bindings=train.eval_batches = 1',
           '--gin_bindings=train.log_every = 1']
  started = str(tmp_path / 'started')
  done = run_modules([
      ('launch.train', f'--gin_file={run}/config.gin', f'--model_dir={run}', *steps),
      ('launch.train', f'--gin_file={run}/config.gin', f'--model_dir={started}', *steps,
       f"--gin_bindings=checkpoint.init_from = '{run}'")])
  for result in done:
    assert result.returncode == 0, result.stderr[-3000:]
  assert 'holds the weights only' in done[0].stderr
  assert inference.find_checkpoint(model_dir=run)[0] == 2
  losses = [read_events(path)['scalars']['train/loss'] for path in (run, started)]
  assert len(losses[0]) == 2 and losses[0] == losses[1]
  # Trained, the tied model is still written tied: one matrix, the trained table.
  written = hf.export_run(export_dir=str(tmp_path / 'trained'), model_dir=run,
                          files=[inference.run_config(model_dir=run)])
  assert written['step'] == 2 and written['tied']
  assert written['config']['tie_word_embeddings'] is True


def test_bindings_that_change_the_architecture_are_refused_with_nothing_written(
    hf_dirs, tmp_path):
  from layout_core.errors import ConfigError  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match=r'transformer_lm.num_layers is 3 in the given config, '
                                        r'but the checkpoint is 2'):
    import_to(hf_dirs['mistral'], str(tmp_path / 'run'),
              bindings=['transformer_lm.num_layers = 3'])
  assert os.listdir(tmp_path) == []


def test_overwrite_replaces_a_run_only_once_the_new_one_is_whole(hf_dirs, tmp_path):
  run = tmp_path / 'run'
  os.makedirs(run)
  (run / 'old.txt').write_text('old')
  hf.import_run(hf_dir=hf_dirs['gpt2'], model_dir=str(run), overwrite=True)
  assert sorted(os.listdir(run)) == ['checkpoints', 'config.gin', 'hf_import.json', 'tokenizer']
  assert os.listdir(tmp_path) == ['run']   # no partial or set-aside directory left
