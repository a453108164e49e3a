"""Rematerialisation: a function whose activations are recomputed in the backward pass.

    y = rematerialized(block_fn, x)       # what BaseLayer.__call__ runs for p.remat

See `rematerialized` for why this is not `tf.recompute_grad`.
"""

from __future__ import annotations

from layout_core.lazy import tf
from layout_core.step_context import current, entered


def floating(x) -> bool:
  """Whether `x` is a floating-point tensor (its activations are worth keeping or recomputing)."""
  return bool(getattr(getattr(x, 'dtype', None), 'is_floating', False))


def rematerialized(fn, *inputs):
  """fn(*inputs), its activations recomputed in the backward pass instead of
  kept. The recomputation runs in the forward pass's step context
  (`layout_core.step_context`), so it computes the same function: the same
  dropout masks, the same packed documents. Gradients reach `inputs`
  and the variables `fn` reads; a tensor `fn` only captures gets none, so
  pass such tensors as inputs. Inputs with no floating tensor (token ids)
  have no activations worth recomputing: fn runs as is.

  Not `tf.recompute_grad`: its recomputation depends only on the kept
  inputs, so inside a step function the executor ran it as early as the
  forward pass, or DTensor's compiler merged it with the forward (a control
  dependency on the incoming gradient, through `tf.identity`, was folded
  away), and nothing was saved: a width-256, 8-block LM's gradients function
  peaked at 2.14 GiB with it, 1.93 without remat. Here the recomputation's
  first input is tied to the incoming gradient by adding 0 x its sum (exact
  for finite gradients): 1.68 GiB."""
  if not any(floating(x) for x in inputs):
    return fn(*inputs)
  # The backward pass runs outside the forward's blocks: the recomputation
  # enters the forward's whole step context again (dropout masks, packed
  # segments, residual pin, batch split), marked as rematerialized.
  context = current().replace(remat=True)
  tied = next(i for i, x in enumerate(inputs) if floating(x))

  def run(*args):
    with entered(context):
      return fn(*args)

  @tf.custom_gradient
  def recomputed(*args):
    def gradient(*output_grads, variables=()):
      zero = tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in output_grads]) * 0.0
      again = list(args)
      again[tied] = args[tied] + tf.cast(zero, args[tied].dtype)
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(again)
        tape.watch(variables)
        outputs = run(*again)
      grads = tape.gradient(outputs, again + list(variables),
                            output_gradients=list(output_grads))
      return grads[:len(args)], grads[len(args):]
    return run(*args), gradient
  return recomputed(*inputs)
