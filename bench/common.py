"""What the limit benchmarks share: a measurement in a fresh Python process
(environment variables TensorFlow reads at import or compile time differ per
process) and the JSON they write."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Sequence

from layout_core.suggest.calibration import processor_name, vector_extensions

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')


def run_child(code: str, *args: str, env: Mapping[str, str | None] = ()) -> Any:
  """Runs `python -c code args...` with `env` changes (None: unset) and
  returns the JSON it printed after 'RESULT '."""
  environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  for name, value in dict(env).items():
    if value is None:
      environ.pop(name, None)
    else:
      environ[name] = value
  done = subprocess.run([sys.executable, '-c', code, *args], env=environ,
                        capture_output=True, text=True, check=True)
  return json.loads(done.stdout.split('RESULT ', 1)[1])


def children_in_turns(code: str, contenders: Mapping[str, Sequence[str]], *, rounds: int,
                      keys: Sequence[str], describe: Callable[[dict], str]
                      ) -> tuple[dict[str, list[dict]], dict[str, dict[str, float]]]:
  """`run_child(code, *args)` for each contender (name -> args), the
  contenders in turns round after round so that load drift hits all alike;
  prints `describe(result)` per run. Returns every result per contender and
  each contender's best (least) value of each of `keys`."""
  results = {name: [] for name in contenders}
  for number in range(rounds):
    for name, args in contenders.items():
      result = run_child(code, *args)
      results[name].append(result)
      print(f'round {number + 1} {name:17s} {describe(result)}', flush=True)
  best = {name: {key: min(r[key] for r in runs) for key in keys}
          for name, runs in results.items()}
  return results, best


def provenance() -> dict:
  """When, at which commit and on which machine a figure was measured."""
  import datetime  # pylint: disable=import-outside-toplevel
  import platform  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  git = lambda *args: subprocess.run(['git', *args], cwd=repo, capture_output=True,  # noqa: E731
                                     text=True).stdout.strip()
  dirty = bool(git('status', '--porcelain', '--untracked-files=no'))
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return {'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
          'commit': git('rev-parse', 'HEAD') + (' (with uncommitted changes)' if dirty else ''),
          'machine': {'host': platform.node(), 'cores': cores,
                      'processor': processor_name() or platform.machine(),
                      # Two CPUs both named 'AMD EPYC' ran bfloat16 two orders of
                      # magnitude apart: the flags tell them apart.
                      'vector_extensions': vector_extensions(),
                      'load_average_at_start': os.getloadavg()}}


def _command() -> str:
  """This process's script, relative to the repository, and its arguments."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = os.path.relpath(os.path.abspath(sys.argv[0]), repo) if sys.argv[0] else ''
  if script.startswith('..'):
    script = sys.argv[0]
  return ' '.join(['python'] + [shlex.quote(a) for a in [script, *sys.argv[1:]] if a])


def read_trace(logdir: str):
  """The XSpace (TensorFlow's profiler trace) written under `logdir` by
  `tf.profiler.experimental.start(logdir)` ... `stop()`."""
  import glob  # pylint: disable=import-outside-toplevel
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
  space = xplane_pb2.XSpace()
  with open(glob.glob(os.path.join(logdir, '**', '*.xplane.pb'), recursive=True)[0], 'rb') as f:
    space.ParseFromString(f.read())
  return space


def read_tensors(logdir: str) -> dict:
  """{tag: [(step, value as a numpy array)]} of the TensorBoard event files
  directly in `logdir` (summaries written by tf.summary are tensors)."""
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  return {tag: [(e.step, tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]
          for tag in acc.Tags()['tensors']}


def write_json(results: Any, path: str) -> None:
  """Writes `results` as JSON (a list: as {'rows': results}), with what it
  lacks of 'date', 'commit', 'machine' (`provenance`) and 'command' (the
  script and its arguments as run) first, so every figure in
  docs/performance.md (bench/report.py) says when, where and how it was
  measured."""
  if isinstance(results, list):  # rows of a table: kept under 'rows'
    results = {'rows': results}
  if isinstance(results, dict):  # what the script gave wins; the keys keep this order
    results = {**provenance(), 'command': _command(), **results}
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(results, f, indent=1)
  print(f'wrote {path}')


def plain_lm_step(*, vocab: int, dim: int, heads: int, ffn: int, layers: int, seq: int,
                  jit: bool = False, mesh=None):
  """A Transformer LM's forward, backward, clipping and Adam update written in
  plain TF (no meshgin, one tf.function): the contender a user would write by
  hand. Returns (step, variables); `step(tokens)` takes [batch, seq + 1]
  token ids and returns the loss.

  Plain variables on one device; with a DTensor `mesh`, the same program with
  every variable a replicated DVariable on it (pass `tokens` laid out on it:
  `pack_rows`), so DTensor is the only difference."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.experimental import dtensor  # pylint: disable=import-outside-toplevel
  if mesh is None:
    variable = tf.Variable
  else:
    def variable(value):
      value = tf.convert_to_tensor(value)
      return dtensor.DVariable(dtensor.copy_to_mesh(
          value, dtensor.Layout.replicated(mesh, rank=value.shape.rank)))
  head = dim // heads
  normal = lambda *shape: variable(tf.random.normal(shape, stddev=0.02))  # noqa: E731
  ones, zeros = (lambda n: variable(tf.ones([n]))), (lambda n: variable(tf.zeros([n])))
  params = {'emb': normal(vocab, dim), 'pos': normal(seq, dim), 'ln_g': ones(dim),
            'ln_b': zeros(dim), 'out_w': normal(dim, vocab), 'out_b': zeros(vocab)}
  for i in range(layers):
    params.update({f'{i}/{n}': normal(dim, heads, head) for n in ('wq', 'wk', 'wv')})
    params.update({f'{i}/wo': normal(heads, head, dim), f'{i}/w_in': normal(dim, ffn),
                   f'{i}/b_in': zeros(ffn), f'{i}/w_out': normal(ffn, dim),
                   f'{i}/b_out': zeros(dim), f'{i}/ln1_g': ones(dim), f'{i}/ln1_b': zeros(dim),
                   f'{i}/ln2_g': ones(dim), f'{i}/ln2_b': zeros(dim)})
  variables = list(params.values())
  m = [variable(tf.zeros(v.shape)) for v in variables]
  v2 = [variable(tf.zeros(v.shape)) for v in variables]
  step_var = variable(0.0)

  def norm(x, g, b):
    mean, var = tf.nn.moments(x, [-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-6) * g + b

  def loss_fn(tokens):
    p = params
    x = tf.gather(p['emb'], tokens[:, :-1]) + p['pos'][:seq]
    mask = tf.linalg.band_part(tf.ones([seq, seq]), -1, 0)
    for i in range(layers):
      h = norm(x, p[f'{i}/ln1_g'], p[f'{i}/ln1_b'])
      q, k, v = (tf.einsum('btd,dhk->bthk', h, p[f'{i}/{n}']) for n in ('wq', 'wk', 'wv'))
      logits = tf.einsum('bthk,buhk->bhtu', q, k) * head ** -0.5 + (1.0 - mask) * -1e9
      context = tf.einsum('bhtu,buhk->bthk', tf.nn.softmax(logits), v)
      x += tf.einsum('bthk,hkd->btd', context, p[f'{i}/wo'])
      h = norm(x, p[f'{i}/ln2_g'], p[f'{i}/ln2_b'])
      x += tf.nn.relu(h @ p[f'{i}/w_in'] + p[f'{i}/b_in']) @ p[f'{i}/w_out'] + p[f'{i}/b_out']
    logits = norm(x, p['ln_g'], p['ln_b']) @ p['out_w'] + p['out_b']
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tokens[:, 1:], logits=logits))

  @tf.function(jit_compile=jit)
  def step(tokens):
    with tf.GradientTape() as tape:
      loss = loss_fn(tokens)
    grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
    grads, _ = tf.clip_by_global_norm(grads, 1.0)
    step_var.assign_add(1.0)
    correction = tf.sqrt(1.0 - 0.99 ** step_var) / (1.0 - 0.9 ** step_var)
    for var, g, m_, v_ in zip(variables, grads, m, v2):
      m_.assign(0.9 * m_ + 0.1 * g)
      v_.assign(0.99 * v_ + 0.01 * tf.square(g))
      var.assign_sub(3e-3 * correction * m_ / (tf.sqrt(v_) + 1e-8))
    return loss

  return step, variables


def pack_rows(array, mesh):
  """A host array on `mesh`, split over its first axis along the rows."""
  from tensorflow.experimental import dtensor  # pylint: disable=import-outside-toplevel
  parts = mesh.num_local_devices()
  rows = len(array) // parts
  layout = dtensor.Layout([mesh.dim_names[0]] + [dtensor.UNSHARDED] * (array.ndim - 1), mesh)
  return dtensor.pack([array[i * rows:(i + 1) * rows] for i in range(parts)], layout)


def timed_alternately(fns: dict, repeats: int) -> dict:
  """Median seconds of each function, timed in turns so drift hits all alike."""
  for fn in fns.values():
    fn()  # trace
    fn()
  samples = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn()
      samples[name].append(time.perf_counter() - start)
  return {name: statistics.median(values) for name, values in samples.items()}


MEGATRON = '@megatron'  # in a benchmark's bindings: the shipped Megatron rules' binding


def with_megatron(bindings) -> list[str]:
  """`bindings` with each MEGATRON replaced by the shipped rules' binding
  (`plugins.suggest.planner.megatron_binding`)."""
  from plugins.suggest.planner import megatron_binding  # pylint: disable=import-outside-toplevel
  return [megatron_binding() if b == MEGATRON else b for b in bindings]
