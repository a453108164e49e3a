"""Features crossed: every cell of the composition matrix (`tests/composition.py`)
trains as its reference does, or is refused before training naming both features.

A cell trains `STEPS` steps of a small LM (dropout on, so masks must follow the
rows through every engine) or of a Keras model, and is compared with its
reference, trained once per reference, on the losses and gradient norms of
every step: a feature that trains another function shows in the first
step's loss and norm, a wrong update in the next step's loss.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import pytest

from layout_core.errors import ConfigError
from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.layout.rules import LayoutRules
from layout_core.model import keras as keras_models
from layout_core.model.lm import moe_feed_forward_params, transformer_lm_params
from layout_core.optim import OptimizerConfig
from layout_core.pipeline import PipelineConfig
from layout_core.run import make_trainer
from layout_core.tasks import Task
from layout_core.model.lora import LoraConfig
from layout_core.model.tuning import tune
from layout_core.tasks.corpus import LMCorpusTask
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig
from tests import composition
from tests.numerics import assert_close
from tests.conftest import REPO_ROOT, read_events, run_modules, train_trace
from tests.test_layout_scope import MEGATRON

sys.path.insert(0, os.path.join(REPO_ROOT, 'tests', 'fixtures'))
from my_project import models, tasks  # noqa: E402  pylint: disable=g-import-not-at-top

BATCH, STEPS = 8, 3
# transformer_lm's options per 'arch': Llama-family blocks with Qwen2's q/k/v
# biases and two kv heads, which the model axis (2) of both meshes splits; the
# 2-client cell's 2x4 mesh (model=4) keeps them whole.
ARCHS = {'classic': {},
         'llama': dict(norm='rms', positions='rope', ffn='swiglu', num_kv_heads=2,
                       qkv_bias=True, output_bias=False)}
MEGATRON_QWEN2 = [  # configs/layouts/megatron_qwen2.gin's rules
    (r'.*/attn/wq', ('unsharded', 'model', 'unsharded')),
    (r'.*/attn/w[kv]', ('unsharded', 'model?', 'unsharded')),
    (r'.*/attn/bq', ('model', 'unsharded')),
    (r'.*/attn/b[kv]', ('model?', 'unsharded')),
    (r'.*/attn/wo', ('model', 'unsharded', 'unsharded')),
    (r'.*/ffn/w_(gate|up)', ('unsharded', 'model')),
    (r'.*/ffn/w_down', ('model', 'unsharded')),
    (r'.*/emb/table', ('unsharded', 'model')),
    (r'.*/softmax/w', ('unsharded', 'model')),
]


class PackedMarkovTask(MarkovTask):
  """Markov rows cut into documents of 2-7 tokens, as packed corpora are:
  per token its segment (1, 2, ... per row) and its position in its
  document; a target in another document than its input is not scored."""
  needs_segments = True
  settings_name = 'lm_corpus'  # its launched twin's task: messages name lm_corpus.pack

  def features(self, *, split, step, batch_size):
    tokens = self.batch(step=step, batch_size=batch_size, split=split)
    rng = np.random.default_rng([self.seed, step, len(split)])
    segments = np.zeros_like(tokens)
    positions = np.zeros_like(tokens)
    for row in range(batch_size):
      start, segment = 0, 1
      while start < tokens.shape[1]:
        length = int(rng.integers(2, 8))
        segments[row, start:start + length] = segment
        positions[row, start:start + length] = np.arange(len(range(start, min(
            start + length, tokens.shape[1]))))
        start, segment = start + length, segment + 1
    return {'tokens': tokens, 'segments': segments, 'positions': positions}

  def iterate(self, *, start_step, batch_size, split='train'):
    return Task.iterate(self, start_step=start_step, batch_size=batch_size, split=split)

  # Packed corpora's segments and masked loss (`LMCorpusTask`'s own).
  sequence_inputs = LMCorpusTask.sequence_inputs
  loss_and_metrics = LMCorpusTask.loss_and_metrics


@pytest.fixture(scope='module')
def stage_mesh(devices8):
  return build_mesh(MeshSpec(shape={'stage': 2, 'data': 2, 'model': 2}))


def make(cell: dict, meshes: dict):
  """The trainer of one cell (tests/composition.py's settings)."""
  keras = cell['engine'] == 'keras'
  if keras:
    model, task = keras_models.KerasModel(build_fn=models.token_classifier), tasks.FirstTokenTask()
  else:
    model = transformer_lm_params(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64,
                                  num_layers=2, max_len=16, dropout_rate=0.1,
                                  tie_embeddings=cell['tied'], **ARCHS[cell['arch']],
                                  moe=moe_feed_forward_params(**composition.MOE)
                                  if cell['moe'] else None, moe_every=2)
    task = MarkovTask(vocab_size=32, seq_len=16, seed=3)
  if cell['packed']:
    task = PackedMarkovTask(vocab_size=32, seq_len=16, seed=3)
  pipeline = None
  if cell['engine'] in ('spmd', 'gpipe'):
    pipeline = PipelineConfig(num_stages=2, num_micro_batches=2,
                              engine='spmd' if cell['engine'] == 'spmd' else 'submesh')
  if cell['lora'] or cell['frozen'] != 'float32':
    model = tune(model, lora=LoraConfig(**composition.lora_settings(cell)) if cell['lora']
                 else None,
                 trainable=None, frozen_dtype=cell['frozen'])
  rules = [] if keras else MEGATRON_QWEN2 if cell['arch'] == 'llama' else MEGATRON
  if cell['moe']:
    rules = [composition.MOE_RULE] + list(rules)
  return make_trainer(
      model=model, mesh=meshes['stage' if pipeline else '2d'],
      rules=LayoutRules(list(rules)), task=task, pipeline=pipeline,
      optimizer=OptimizerConfig(name=cell['optimizer'], learning_rate=1e-2, warmup_steps=0,
                                shard_state=cell['shard_state']),
      config=TrainConfig(num_steps=STEPS, batch_size=BATCH, log_every=1, eval_every=0,
                         eval_batches=1, compute_dtype=cell['dtype'], remat=cell['remat'],
                         grad_accum_steps=cell['accum'], fsdp=cell['fsdp']))


@pytest.fixture(scope='module')
def traces(mesh_2x2, stage_mesh):
  meshes = {'2d': mesh_2x2, 'stage': stage_mesh}

  @functools.lru_cache(maxsize=None)
  def of(key: tuple, steps: int) -> dict:
    return train_trace(make(dict(key), meshes), steps=steps, batch_size=BATCH,
                       evaluate=steps > STEPS)
  return lambda cell, steps=STEPS: of(tuple(cell.items()), steps)


def assert_same(reference: dict, other: dict, tolerance: str, where: str) -> None:
  rel = composition.TOLERANCES[tolerance]
  for key in ('loss', 'grad_norm'):
    assert_close(other[key], reference[key], rel=rel, what=f'{tolerance} {key}: {where}')
  if reference['eval'] is not None:
    assert_close(other['eval'], reference['eval'], rel=rel, what=f'{tolerance} eval: {where}')


CELLS = [c for c in composition.all_pairs() if c != composition.reference(c)]


@pytest.mark.parametrize('cell', CELLS, ids=composition.name)
def test_a_cell_trains_as_its_reference(cell, traces):
  reference = composition.reference(cell)
  assert_same(traces(reference), traces(cell), composition.tolerance(cell),
              f'{composition.name(cell)} against {composition.name(reference)}')


@pytest.mark.parametrize('pair', list(composition.REFUSED),
                         ids=lambda p: f'{p[0]}={p[1]}+{p[2]}={p[3]}')
def test_a_refused_pair_is_refused_before_training_naming_both(pair, mesh_2x2, stage_mesh):
  a, x, b, y = pair
  cell = {**composition.reference({n: s[0] for n, s in composition.FACTORS.items()}),
          a: x, b: y}
  with pytest.raises(ConfigError) as refused:
    make(cell, {'2d': mesh_2x2, 'stage': stage_mesh})
  for word in composition.REFUSED[pair]:
    assert word in str(refused.value), (pair, str(refused.value))


@pytest.mark.parametrize('remat', ['block', 'full'])
def test_remat_on_packed_documents_trains_the_function_without_it(remat, traces):
  """The recomputation in the backward pass sees the forward's packed
  segments (and dropout masks, residual pin): over 20 steps the losses equal
  the run that keeps its activations. Before the step context, attention
  recomputed with the plain causal mask, letting tokens see the previous
  document, and the losses drifted from step 2.

  Positive control: the packed run's losses differ from the same rows read
  as one document each, so the segments do reach the recomputed attention."""
  base = {n: s[0] for n, s in composition.FACTORS.items()}
  kept = traces({**base, 'packed': True}, steps=20)
  recomputed = traces({**base, 'packed': True, 'remat': remat}, steps=20)
  assert_close(recomputed['loss'], kept['loss'], rel=composition.TOLERANCES['exact'],
               what='exact loss')
  assert_close(recomputed['eval'], kept['eval'], rel=composition.TOLERANCES['exact'],
               what='exact eval')
  assert traces(base)['loss'][0] != pytest.approx(kept['loss'][0], rel=1e-3)


# The base runs of the 2-client cells: a small Llama-family LM on llama_2d's
# 2x4 mesh, the user's Keras model; 4 steps, every loss logged.
CLIENT_BASE = {
    'plain': ['--gin_file=configs/experiments/llama_2d.gin',
              '--gin_bindings=transformer_lm.num_layers = 1',
              '--gin_bindings=transformer_lm.max_len = 16', '--gin_bindings=data.seq_len = 16',
              '--gin_bindings=train.batch_size = 8'],
    'keras': ['--gin_search_paths=tests/fixtures', '--gin_file=my_project/keras.gin'],
}
CLIENT_STEPS = ['--gin_bindings=train.num_steps = 4', '--gin_bindings=train.eval_every = 0',
                '--gin_bindings=train.log_every = 1', '--gin_bindings=train.eval_batches = 1',
                '--gin_bindings=checkpoint.every_steps = 0']


def test_two_clients_train_as_one_process_running_the_reference(tmp_path):
  """Each 2-client cell (2 processes x 4 devices, launch.local_cluster, the
  features on) logs the losses of its reference run in one process of 8
  devices (the features off), within the cell's tolerance; the processes
  exit 0."""
  calls = []
  for i, cell in enumerate(composition.TWO_CLIENT_CELLS):
    base = CLIENT_BASE[cell['engine']] + CLIENT_STEPS
    calls.append(('launch.train', *base, *composition.gin_bindings(composition.reference(cell)),
                  f'--model_dir={tmp_path}/{i}/one'))
    calls.append(('launch.local_cluster', '--num_clients=2', '--devices_per_client=4', '--',
                  *base, *composition.gin_bindings(cell), f'--model_dir={tmp_path}/{i}/two'))
  done = run_modules(calls)
  for call, result in zip(calls, done):
    assert result.returncode == 0, (call, result.stderr[-3000:])
  for i, cell in enumerate(composition.TWO_CLIENT_CELLS):
    one, two = (dict(read_events(f'{tmp_path}/{i}/{run}')['scalars']['train/loss'])
                for run in ('one', 'two'))
    assert sorted(one) == sorted(two) == [1, 2, 3, 4], (one, two)
    tolerance = composition.TOLERANCES[composition.tolerance(cell)]
    assert_close([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rel=tolerance,
                 what=f'two clients: {composition.name(cell)}')


def test_the_docs_table_is_the_tests_own_list():
  with open(os.path.join(REPO_ROOT, 'docs', 'composition.md'), encoding='utf-8') as f:
    page = f.read()
  assert composition.table() in page, 'regenerate: python -m tests.composition'
