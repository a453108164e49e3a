"""One objective, whatever the split (layout_core/tasks/objective.py): on
response-only instruction data whose rows train 8 to 31 tokens, gradient
accumulation (4 micro-steps) and both pipeline engines (4 micro-batches)
train what the unsplit step trains: the same losses and the same parameters
after 3 steps. The reference is the unsplit run (one mean over the batch's
trained tokens); `tokens_trained` is checked against a numpy count.

Positive control: the mean of the four quarters' own means, what the engines
computed before, is far from the batch's mean on this data (the test's
loss tolerance is 500 times smaller than that gap), so a split that averaged
means would fail here."""

import json

import numpy as np
import pytest

from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model.lm import transformer_lm_params
from layout_core.optim import OptimizerConfig
from layout_core.pipeline import PipelineConfig
from layout_core.run import make_trainer
from layout_core.tasks.instruct import InstructionTask
from layout_core.tasks.objective import finish
from layout_core.train.config import TrainConfig
from tests.numerics import assert_close
from tests.test_layout_scope import MEGATRON

BATCH, SEQ_LEN, STEPS = 8, 72, 3
# Responses of very unequal lengths: 1, 2 and 30 bytes (+ '<|end|>', 7 more).
RESPONSES = ['4', 'no', 'a thirty byte answer, exactly']


def examples():
  """Per batch (read in file order): the first quarter trains 62 tokens (its
  long answers cut at seq_len), the last 16."""
  kinds = [2, 2, 2, 1, 0, 1, 0, 0]
  return [{'prompt': f'question {i}?', 'response': RESPONSES[kinds[i % BATCH]]}
          for i in range(BATCH * STEPS)]


@pytest.fixture(scope='module')
def task(tmp_path_factory):
  path = tmp_path_factory.mktemp('objective') / 'train.jsonl'
  path.write_text(''.join(json.dumps(e) + '\n' for e in examples()))
  return InstructionTask(train_files=str(path), eval_files=str(path), tokenizer='bytes',
                         vocab_size=256, seq_len=SEQ_LEN, pack=False, shuffle_window=1,
                         num_streams=1)


@pytest.fixture(scope='module')
def batches(task):
  reader = task.reader(split='train', batch_size=BATCH)
  return [next(reader) for _ in range(STEPS)]


def trained_tokens(batch) -> int:
  """Targets t (token t + 1) of a response token inside an example: by hand."""
  inside = (batch['segments'][:, 1:] > 0) & (batch['segments'][:, :-1] ==
                                              batch['segments'][:, 1:])
  return int(np.sum(inside & (batch['loss_mask'][:, 1:] > 0)))


def train(mesh, task, batches, *, rules=MEGATRON, pipeline=None, grad_accum_steps=1):
  """(per-step losses, step-0 tokens_trained, trainer) after STEPS steps on `batches`."""
  model = transformer_lm_params(vocab_size=256, model_dim=32, num_heads=4, ffn_dim=64,
                                num_layers=2, max_len=SEQ_LEN, dropout_rate=0.0)
  trainer = make_trainer(
      model=model, mesh=mesh, rules=LayoutRules(list(rules)), task=task,
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
      config=TrainConfig(num_steps=STEPS, batch_size=BATCH, log_every=1, eval_every=0,
                         eval_batches=1, grad_accum_steps=grad_accum_steps),
      pipeline=pipeline)
  losses, tokens = [], None
  for batch in batches:
    loss, _, _, metrics = trainer.train_step(batch)
    losses.append(float(to_numpy(loss)))
    tokens = tokens if tokens is not None else float(to_numpy(metrics['tokens_trained']))
  return losses, tokens, trainer


@pytest.fixture(scope='module')
def stage_mesh(devices8):
  return build_mesh(MeshSpec(shape={'stage': 2, 'data': 2, 'model': 2}))


@pytest.fixture(scope='module')
def unsplit(mesh_2x2, task, batches):
  return train(mesh_2x2, task, batches)


def weights(trainer):
  """path -> value, the SPMD pipeline's stacked cells as the unstacked paths."""
  result, engine = {}, trainer.engine
  for path, variable in engine.variables.items():
    if '/stacked_cells/' not in path:
      result[path] = to_numpy(variable)
      continue
    relative, stack = path.split('/stacked_cells/', 1)[1], engine.program.stack
    for layer, slot in enumerate(stack.slots):
      result[stack.cell_variable_path(layer, relative)] = to_numpy(variable)[slot.stage,
                                                                              slot.row]
  return result


def test_the_batch_holds_very_unequal_trained_counts_and_a_mean_of_means_differs(
    unsplit, batches):
  """The data the other tests need (control): quarters of the first batch
  train very different numbers of tokens, and the mean of their means is far
  from the batch's mean."""
  _, tokens, trainer = unsplit
  counts = [trained_tokens({k: v[i:i + 2] for k, v in batches[0].items()})
            for i in range(0, BATCH, 2)]
  assert max(counts) >= 3 * min(counts), counts
  assert tokens == trained_tokens(batches[0]) == sum(counts)
  quarters = [float(to_numpy(finish(trainer.engine.evaluate(trainer.engine.pack(
      {k: np.concatenate([v[i:i + 2]] * 4) for k, v in batches[0].items()})))[0]))
              for i in range(0, BATCH, 2)]
  whole = float(to_numpy(finish(trainer.engine.evaluate(trainer.engine.pack(batches[0])))[0]))
  weighted = sum(q * c for q, c in zip(quarters, counts)) / sum(counts)
  assert_close(weighted, whole, rel=1e-5, what='token-weighted quarters')
  assert abs(np.mean(quarters) - whole) > 1e-3 * whole, (quarters, whole)


@pytest.mark.parametrize('split', ['accumulation', 'submesh', 'spmd'])
def test_a_split_batch_trains_what_the_whole_batch_trains(split, unsplit, mesh_2x2, stage_mesh,
                                                          task, batches):
  """4 micro-steps, or a 2-stage pipeline of 4 micro-batches (each engine),
  against the unsplit step: every step's loss and, after 3 Adam steps, every
  parameter; `tokens_trained` is the batch's count, not a part's."""
  if split == 'accumulation':
    losses, tokens, trainer = train(mesh_2x2, task, batches, grad_accum_steps=4)
  else:
    losses, tokens, trainer = train(
        stage_mesh, task, batches,
        pipeline=PipelineConfig(num_stages=2, num_micro_batches=4, engine=split))
  reference_losses, _, reference = unsplit
  assert tokens == trained_tokens(batches[0])
  # measured: 1.7e-07 (accumulation, submesh, spmd alike)
  assert_close(losses, reference_losses, rel=2e-6, what=f'{split} losses')
  expected, after = weights(reference), weights(trainer)
  assert set(after) == set(expected)
  for path, value in after.items():
    # measured: 3.0e-04 (accumulation), 2.5e-04 (submesh), 7.6e-04 (spmd): Adam divides
    # each gradient by its own size, so rows that see almost no gradient (bytes that
    # never occur) move by the rounding's sign
    assert_close(value, expected[path], rel=3e-3, what=f'{split} weights: {path}')
