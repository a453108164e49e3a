"""Direct preference optimisation: the loss of a pair of answers from the
summed log-probabilities of each under the policy and the reference.

    objective = DPOConfig(beta=0.1, loss='sigmoid')
    logps = answer_logps(logits, batch)        # [B]: each row's answer, summed
    loss, metrics = preference_loss(logps, batch['reference_logps'],
                                    tokens=answer_tokens(batch), objective=objective)

Rows come in pairs: row 2i holds pair i's chosen answer, row 2i + 1 its
rejected one, each after the same prompt (`layout_core.tasks.preference`).
With pi and ref the summed log-probabilities of an answer's tokens under
the policy and the reference model,

    rewards/chosen   = beta * (pi(chosen) - ref(chosen))
    rewards/rejected = beta * (pi(rejected) - ref(rejected))
    z                = rewards/chosen - rewards/rejected      (rewards/margins)

and the loss of a pair is, by `loss`:

  * 'sigmoid' (DPO, Rafailov et al. 2023): -(1 - eps) log s(z) - eps log s(-z),
    eps = `label_smoothing` (conservative DPO: labels flipped with probability eps);
  * 'ipo' (Azar et al. 2023): (h - 1 / (2 beta))^2 with h the log-ratio
    difference of the answers' log-probabilities *per token* (TRL's IPO);
  * 'hinge' (SLiC): max(0, 1 - z).

The batch's loss is the mean over its pairs, kept as its sums
(`layout_core.tasks.objective.Mean`): the parts of a split batch (micro-steps)
add pairs and the mean is taken once, so any split gives the same step. The
metrics are named as TRL's `DPOTrainer` names them, each a mean over pairs:
rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies (the
share of pairs whose chosen reward is the larger), logps/chosen,
logps/rejected.
"""

from __future__ import annotations

import dataclasses

from layout_core.errors import ConfigError
from layout_core.fields import check_types
from layout_core.lazy import tf
from layout_core.tasks.corpus import target_mask
from layout_core.tasks.objective import Mean, Total

LOSSES = ('sigmoid', 'ipo', 'hinge')


@dataclasses.dataclass(frozen=True)
class DPOConfig:
  """The preference objective (module doc).

  Attributes:
    beta: How far from the reference the policy may move (> 0): the scale of
      the rewards; smaller lets it move further.
    loss: 'sigmoid' (DPO), 'ipo' or 'hinge'.
    label_smoothing: In [0, 0.5): the assumed share of pairs whose labels are
      wrong (conservative DPO); 'sigmoid' only.
    precompute_reference: False: the reference model (the model with its
      LoRA adapters off) runs in every step beside the policy. True: every
      pair's reference log-probabilities are computed once before the first
      step, from the starting weights, and kept beside the run
      (`layout_core.train.reference_logps`): no LoRA needed (every weight
      may train), no reference forward pass in the steps.
  """
  beta: float = 0.1
  loss: str = 'sigmoid'
  label_smoothing: float = 0.0
  precompute_reference: bool = False

  def __post_init__(self):
    check_types(self, name='dpo')
    if self.loss not in LOSSES:
      raise ConfigError(f'dpo.loss = {self.loss!r}', where='dpo.loss',
                        fix=f'use one of {LOSSES}')
    if not self.beta > 0:
      raise ConfigError(f'dpo.beta = {self.beta} is not positive', where='dpo.beta',
                        fix='use a beta > 0, e.g. 0.1')
    if not 0.0 <= self.label_smoothing < 0.5:
      raise ConfigError(f'dpo.label_smoothing = {self.label_smoothing} is not in [0, 0.5)',
                        where='dpo.label_smoothing', fix='use 0 (DPO) up to 0.5')
    if self.label_smoothing and self.loss != 'sigmoid':
      raise ConfigError(f'dpo.label_smoothing applies to the sigmoid loss, not '
                        f'{self.loss!r}', where='dpo.label_smoothing',
                        fix="set dpo.loss = 'sigmoid' or dpo.label_smoothing = 0")


def answer_mask(batch) -> 'tf.Tensor':
  """[B, T] True at the targets that are answer tokens: in their input's
  example (not padding) with the loss mask on."""
  return tf.logical_and(target_mask(batch['segments']), batch['loss_mask'][:, 1:] > 0)


def answer_logps(logits, batch) -> 'tf.Tensor':
  """[B] the summed log-probability of each row's answer tokens under `logits`
  [B, T, V] (float32)."""
  labels = tf.cast(batch['tokens'][:, 1:], tf.int32)
  logps = -tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
  return tf.reduce_sum(logps * tf.cast(answer_mask(batch), logps.dtype), axis=1)


def answer_tokens(batch) -> 'tf.Tensor':
  """[B] float32: how many answer tokens each row holds."""
  return tf.reduce_sum(tf.cast(answer_mask(batch), tf.float32), axis=1)


def _pairs(values, side: int) -> 'tf.Tensor':
  """[B / 2]: values[2i + side] for each pair i, as a contraction with a 0/1
  matrix (a strided slice or reshape of a batch-split vector is not what
  DTensor handles well; a contraction over the split axis it sums exactly)."""
  rows = values.shape[0]
  select = tf.one_hot(tf.range(side, rows, 2), rows, dtype=values.dtype)  # [B/2, B]
  return tf.einsum('pb,b->p', select, values)


def check_pairs(rows: int) -> None:
  """A part of a batch must hold whole pairs."""
  if rows % 2:
    raise ConfigError(f'a part of the batch holds {rows} rows, an odd number, so a pair of '
                      'answers would be split', where='train.batch_size',
                      fix='make train.batch_size / train.grad_accum_steps even')


def preference_loss(policy, reference, *, tokens, objective: DPOConfig):
  """(loss, metrics) as sums over the pairs of a batch (module doc) from
  the [B] summed answer log-probabilities under the policy and the reference,
  and the [B] answer tokens of each row."""
  check_pairs(policy.shape[0])
  chosen, rejected = _pairs(policy, 0), _pairs(policy, 1)
  reference_chosen, reference_rejected = _pairs(reference, 0), _pairs(reference, 1)
  beta = objective.beta
  chosen_rewards = beta * (chosen - reference_chosen)
  rejected_rewards = beta * (rejected - reference_rejected)
  margins = chosen_rewards - rejected_rewards
  if objective.loss == 'sigmoid':
    eps = objective.label_smoothing
    losses = -(1.0 - eps) * tf.math.log_sigmoid(margins) - eps * tf.math.log_sigmoid(-margins)
  elif objective.loss == 'ipo':
    per_token = (policy - reference) / tf.maximum(tokens, 1.0)
    difference = _pairs(per_token, 0) - _pairs(per_token, 1)
    losses = tf.square(difference - 1.0 / (2.0 * beta))
  else:
    losses = tf.nn.relu(1.0 - margins)
  # Half the rows, counted from the data, not from the shape: a constant has
  # no mesh, and a pipeline's last stage must return its sums on its own.
  pairs = tf.reduce_sum(tf.cast(tokens >= 0.0, tf.float32)) / 2.0

  def mean(values):
    return Mean(tf.reduce_sum(values), pairs)

  metrics = {
      'rewards/chosen': mean(chosen_rewards),
      'rewards/rejected': mean(rejected_rewards),
      'rewards/margins': mean(margins),
      'rewards/accuracies': mean(tf.cast(chosen_rewards > rejected_rewards, tf.float32)),
      'logps/chosen': mean(chosen),
      'logps/rejected': mean(rejected),
      'pairs': Total(pairs),
      'tokens_trained': Total(tf.reduce_sum(tokens)),
  }
  return mean(losses), metrics
