"""A loss or metric kept as the sums it is made of, so that the parts of a
batch add exactly and the mean is taken once.

    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    loss = masked_mean(losses, mask)          # Mean(total=sum of losses, count=trained tokens)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
    return loss, {'accuracy': masked_mean(correct, mask), 'tokens_trained': Total(loss.count)}

A task's `loss_and_metrics` may return, for the loss and for each metric:

  * a `Mean(total, count)`: a mean over some of the batch's positions (the
    trained tokens of a response-only mask, say), whose parts hold different
    counts. The parts of a batch (micro-steps, pipeline micro-batches, eval
    batches) add their totals and their counts, and the engine divides once:
    the batch's loss is (sum of every trained token's loss) / (number of
    trained tokens), whatever the split, as torchtitan, MaxText and
    `transformers` >= 4.46 compute it. A mean of the parts' means would weight
    a part with one trained token as much as one with a thousand;
  * a `Total(value)`: a number of the whole batch that parts add, reported as
    is (`tokens_trained`);
  * a plain scalar tensor: a mean over equal parts of the batch (every row,
    every position), such as a classifier's loss; the parts of a batch are of
    equal size, so each weighs 1/k of k parts, known before they are added.

The engines (`layout_core.train.micro_steps`, the pipelines) add parts with
`add_parts` and finish with `finish`; a part differentiates its total
(`total_of`), and the summed gradients are divided once by the batch's count
(`gradient_divisor`).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from layout_core.lazy import tf


class Mean(NamedTuple):
  """`total / count`, kept as its two sums (count: how many things `total` adds)."""
  total: Any
  count: Any


class Total(NamedTuple):
  """A number parts of a batch add and that is reported as it is (a count)."""
  value: Any


def masked_mean(values, mask) -> Mean:
  """The mean of `values` where `mask`, as its sum and its count."""
  mask = tf.cast(mask, values.dtype)
  return Mean(tf.reduce_sum(values * mask), tf.reduce_sum(mask))


def _add_n(values):
  return values[0] if len(values) == 1 else tf.add_n(list(values))


def add_parts(parts, add=_add_n):
  """The sums of a list of parts, each (loss, {metric: value}) of one
  structure, added in the parts' order: a Mean's totals and counts, a
  Total's values, and a plain value as the mean of the (equal) parts. Each
  in one AddN (the graph around a sum changes how Grappler rewrites a step
  function). `add`: how a list of numbers is added (`sum` for host floats)."""
  def field(values):
    first = values[0]
    if isinstance(first, Total):
      return Total(add([v.value for v in values]))
    if isinstance(first, Mean):
      return Mean(add([v.total for v in values]), add([v.count for v in values]))
    return add([v / len(values) for v in values])

  losses = [loss for loss, _ in parts]
  names = list(parts[0][1])
  return field(losses), {name: field([metrics[name] for _, metrics in parts])
                         for name in names}


def denominator(count):
  """`count`, at least 1: a batch with nothing to train has a loss and
  gradients of 0, not NaN."""
  if isinstance(count, (int, float)):
    return max(count, 1)
  return tf.maximum(count, 1.0)


def total_of(loss, parts: int = 1):
  """What one of `parts` parts of a batch differentiates, so that the parts'
  gradients add up to the batch's: a Mean's total (the sum is divided once,
  by the count known only after it: `gradient_divisor`); a plain mean's
  share, loss / parts (its weight is known before)."""
  if isinstance(loss, Mean):
    return loss.total
  return loss if parts == 1 else loss / parts


def gradient_divisor(loss, *, mean: bool = True):
  """What the parts' summed gradients are still divided by to be the
  gradients of their sums `loss`'s value: a Mean's count, or None: a plain
  mean's parts came weighted already, and with `mean` False an outer sum
  adds more parts before the one division."""
  return loss.count if isinstance(loss, Mean) and mean else None


def value_of(value):
  """The number a (sums of a) loss or metric stands for: a Mean's total over
  its count (a count of 0 gives 0, not NaN), a Total's value."""
  if isinstance(value, Total):
    return value.value
  if isinstance(value, Mean):
    return value.total / denominator(value.count)
  return value


def finish(result) -> tuple[Any, dict[str, Any]]:
  """(loss, {metric: value}) of sums, as the numbers they stand for."""
  loss, metrics = result
  return value_of(loss), {name: value_of(value) for name, value in metrics.items()}


def numpy_sums(result: tuple[Any, Mapping[str, Any]], to_numpy) -> tuple[Any, dict]:
  """(loss, metrics) of tensors as the same structure of host floats, a plain
  mean as a Mean of count 1 (the batches it is added with are of its size)."""
  def host(value):
    if isinstance(value, Total):
      return Total(float(to_numpy(value.value)))
    if isinstance(value, Mean):
      return Mean(float(to_numpy(value.total)), float(to_numpy(value.count)))
    return Mean(float(to_numpy(value)), 1.0)
  loss, metrics = result
  return host(loss), {name: host(value) for name, value in metrics.items()}
