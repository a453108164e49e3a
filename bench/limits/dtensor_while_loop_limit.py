"""Limit check: `tf.while_loop` over DTensors inside `tf.function` (TF 2.21).

Three behaviours met while writing `layout_core/infer/decode.py`, each tried
with its obvious variations on 8 virtual CPU devices, every variation in a
fresh process (some end it with a segmentation fault), its values checked
against NumPy or plain TF ('ok' means right):

1. A second compiled function holding a while loop, after a first one ran:
   "Cannot add function '..._body' because a different function with the
   same name already exists"? Minimal loops: the same function retraced at
   a new shape, a different function, a new folded small input, another
   input layout; loops named alike or apart; replicated or sharded inputs;
   meshes of 8 and 1 devices, plain TF; bodies with relayouts, captured or
   split DVariables, a gather, an all-reduce, several sums, a two-layer
   attention over caches. Then meshgin's own loop: `CachedLM.generate`
   traced into a function, retraced or a second decoder, with 1 or 2
   layers, with and without its cache, repeated (its outcome varied).
2. A while loop that returns one loop variable unchanged while it updates a
   sharded cache: a segmentation fault? The variable returned as is,
   relaid out to its own layout (as decode.py relays every loop variable),
   recomputed, or recomputed and relaid out (decode's workaround); bool,
   int or float, replicated or sharded, with and without the cache, on
   meshes of 8 devices (2x4 and 8) and 1.
3. Python slicing (`x[:, None]`, `x[:, -1]`) of a sharded DTensor inside a
   function, against `tf.expand_dims` / `tf.squeeze` / a one-hot sum.

    python bench/limits/dtensor_while_loop_limit.py [--out bench/results/dtensor_while_loop.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.common import RESULTS, write_json  # noqa: E402

TIMEOUT_S = 240  # one variation's process: a first DTensor compile takes seconds
STEPS = 3  # iterations of every loop
DECODER_RUNS = 4  # the decoder's second function failed in some runs, not all
SLICING_RUNS = 3  # x[:, None] crashed in some runs and failed to compile in others

# -------------------------------------------------------------- in the child


def _setup(mesh_shape: str):
  """TensorFlow and, for a mesh shape ('2x4', '8', '1'), a DTensor mesh of
  that many virtual CPU devices; 'plain': no DTensor."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.experimental import dtensor  # pylint: disable=import-outside-toplevel
  if mesh_shape == 'plain':
    return np, tf, dtensor, None
  sizes = [int(s) for s in mesh_shape.split('x')]
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * int(np.prod(sizes)))
  names = ['data', 'model'][:len(sizes)]
  mesh = dtensor.create_mesh(list(zip(names, sizes)), device_type='CPU')
  return np, tf, dtensor, mesh


def _placer(tf, dtensor, mesh):
  """(place, fetch): place(array, spec) is the array on the mesh laid out as
  spec (a tuple of axis names or '-'), or a plain tensor without a mesh;
  fetch(tensor) its global value as a NumPy array."""
  def place(array, spec):
    value = tf.constant(array)
    if mesh is None:
      return value
    spec = [dtensor.UNSHARDED if s == '-' else s for s in spec]
    replicated = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh, value.shape.rank))
    return dtensor.relayout(replicated, dtensor.Layout(spec, mesh))

  def fetch(tensor):
    if mesh is None:
      return tensor.numpy()
    whole = dtensor.relayout(tensor, dtensor.Layout.replicated(mesh, tensor.shape.rank))
    return dtensor.unpack(whole)[0].numpy()
  return place, fetch


def _first_line(e: Exception) -> str:
  """An error's type and first line, without the source location MLIR puts
  first, cut short (a DTensor error's first line can hold a whole tensor).
  A layout error that prints memory as its sharding spec keeps only its
  start, so that runs compare."""
  if isinstance(e, UnicodeDecodeError):  # TensorFlow's message held bytes that are not text
    return 'UnicodeDecodeError: the error message is garbled bytes'
  line = re.sub(r'^\S+:\d+:\d+: ', '', str(e).strip().splitlines()[0])
  garbled = 'sharding spec ('
  if 'ComputeLayoutForward' in line and garbled in line:
    line = line[:line.index(garbled) + len(garbled)] + '<garbled bytes>'
  return f'{type(e).__name__}: {line[:300]}'


def second_loop(*, mesh: str, layout: str, second: str, names: str, body: str = 'add',
                sums: int = 1, reduce_retracing: bool = False) -> dict:
  """Claim 1: a function whose while loop adds `scale` * x to a sum `bound`
  times is called; then `second`: the same call again ('same call', the
  control), the same function at twice the width ('retrace'), a second
  function of the same code ('other function'), the same function with
  another bound or scale (small inputs DTensor folds into its compile key:
  'new bound', 'new scale'), or with x laid out otherwise ('other layout':
  split over 'data'). `names`: the loops' `name=` ('default', 'same',
  'distinct': a new name per trace, as decode.py does). `body`: what each
  step adds: 'add' (x), 'variable' (x @ w, w an identity matrix in a
  captured DVariable), 'row sums' (x's row sums, broadcast: over a split
  second dimension an all-reduce); or 'relayout' (x, the sum then relaid out
  to `layout`, as decode.py's `_lay`)."""
  np, tf, dtensor, m = _setup(mesh)
  place, fetch = _placer(tf, dtensor, m)
  traced = iter(range(100))
  specs = {'replicated': ('-', '-'), 'data': ('data', '-'), 'model': ('-', 'model')}
  weights = {}

  def loop_name():
    return {'default': 'while', 'same': 'acc', 'distinct': f'acc_{next(traced)}'}[names]

  def weight(width):  # one per width, made outside any function
    if width not in weights:
      eye = np.eye(width, dtype=np.float32)
      split = ('-', 'model') if body == 'split variable' else ('-', '-')
      weights[width] = (tf.Variable(eye) if m is None else
                        dtensor.DVariable(place(eye, split)))
    return weights[width]

  def summed(x, bound, scale):
    w = weight(x.shape[1]) if body in ('variable', 'split variable', 'gather') else None

    def step(i, *accs):
      if body == 'row sums':
        added = tf.reduce_sum(x, axis=1, keepdims=True) + tf.zeros_like(x)
      elif body == 'gather':  # rows of w picked by x's argmax: x again
        added = tf.gather(w, tf.argmax(x, axis=1)) * tf.reduce_max(x, axis=1, keepdims=True)
      else:
        added = x @ w if w is not None else x
      accs = [acc + added * scale for acc in accs]
      if body == 'relayout' and m is not None:
        spec = [dtensor.UNSHARDED if a == '-' else a for a in specs[layout]]
        accs = [dtensor.relayout(acc, dtensor.Layout(spec, m)) for acc in accs]
      return (i + 1, *accs)
    return tf.while_loop(lambda i, *accs: i < bound, step,
                         (tf.constant(0),) + (tf.zeros_like(x),) * sums, name=loop_name())[-1]

  def compiled():
    return tf.function(summed, autograph=False, reduce_retracing=reduce_retracing)

  first = compiled()
  calls = [('first call', first, 4, STEPS, 1, layout),
           ('second call', compiled() if second == 'other function' else first,
            8 if second == 'retrace' else 4, STEPS + 1 if second == 'new bound' else STEPS,
            2 if second == 'new scale' else 1, 'data' if second == 'other layout' else layout)]
  result = {}
  for label, fn, width, bound, scale, spec in calls:
    array = np.arange(8 * width, dtype=np.float32).reshape(8, width)
    if body in ('variable', 'split variable', 'gather'):
      weight(width)
    try:
      got = fetch(fn(place(array, specs[spec]), place(np.int32(bound), ()),
                     place(np.float32(scale), ())))
      added = (array.sum(1, keepdims=True) + 0 * array if body == 'row sums' else
               np.eye(width)[array.argmax(1)] * array.max(1, keepdims=True) if body == 'gather'
               else array)
      result[label] = 'ok' if np.array_equal(got, bound * scale * added) else 'wrong values'
    except Exception as e:  # pylint: disable=broad-except
      result[label] = _first_line(e)
  return result


def unchanged_variable(*, mesh: str, flag: str, flag_layout: str, carry_cache: bool,
                       reads_flag: bool, returned: str) -> dict:
  """Claim 2: a loop carrying (step, out [B, N], a [B] `flag`, and with
  `carry_cache` a [B, L, H, K] cache split over 'data' and 'model' that gets
  a column added each step) that returns `flag`: `returned` 'as is',
  'relaid out' (to its own layout, as decode.py's `_lay` does to every loop
  variable), 'recomputed' (a new tensor: `flag == flag` and `flag`, or
  `abs(flag)`), 'recomputed, relaid out' (decode.py's workaround), or
  'times one, relaid out' (`flag * 1`, which a graph pass may fold back). `reads_flag`: as decode.py's loop reads its `done`, the
  condition stops when every flag is set and the body writes -1 into `out`
  for flagged rows, else the step."""
  np, tf, dtensor, m = _setup(mesh)
  place, fetch = _placer(tf, dtensor, m)
  batch, length, heads, dim = 8, STEPS + 1, 4, 2
  dtype = {'bool': np.bool_, 'int32': np.int32, 'float32': np.float32}[flag]
  flag_value = (np.arange(batch) % 2).astype(dtype)
  cache_value = np.zeros([batch, length, heads, dim], np.float32)
  flag_spec = 'data' if flag_layout == 'sharded' else '-'

  def lay(x, *spec):
    if m is None:
      return x
    spec = [a if a in m.dim_names else dtensor.UNSHARDED for a in spec]
    return dtensor.relayout(x, dtensor.Layout(spec, m))

  @tf.function(autograph=False)
  def run(out, cache, flag_in):
    def more(step, out, cache, flag_var):
      del out, cache
      going = step < STEPS
      if reads_flag:
        going = tf.logical_and(going, tf.logical_not(tf.reduce_all(tf.cast(flag_var, tf.bool))))
      return going

    def body(step, out, cache, flag_var):
      if carry_cache:
        column = tf.cast(tf.equal(tf.range(length), step), tf.float32)
        cache = lay(cache + tf.reshape(column, [1, length, 1, 1]), 'data', '-', 'model', '-')
      token = tf.fill([batch], step)
      if reads_flag:
        token = tf.where(tf.cast(flag_var, tf.bool), -tf.ones_like(token), token)
      written = tf.equal(tf.expand_dims(tf.range(STEPS), 0), step)
      out = lay(tf.where(written, tf.expand_dims(token, 1), out), 'data', '-')
      if returned.startswith('recomputed'):
        flag_var = (tf.logical_and(tf.equal(flag_var, flag_var), flag_var) if flag == 'bool'
                    else tf.abs(flag_var))
      elif returned.startswith('times one'):
        flag_var = flag_var * tf.ones_like(flag_var)
      if returned.endswith('relaid out'):
        flag_var = lay(flag_var, flag_spec)
      return step + 1, out, cache, flag_var
    return tf.while_loop(more, body, (tf.constant(0), out, cache, flag_in))[1:]

  try:
    outputs = [fetch(t) for t in run(place(np.zeros([batch, STEPS], np.int32), ('data', '-')),
                                     place(cache_value, ('data', '-', 'model' if m is not None
                                                         and 'model' in m.dim_names else '-',
                                                         '-')),
                                     place(flag_value, (flag_spec,)))]
  except Exception as e:  # pylint: disable=broad-except
    return {'outcome': _first_line(e)}
  want_out = np.tile(np.arange(STEPS, dtype=np.int32), [batch, 1])
  if reads_flag:
    want_out[flag_value.astype(bool)] = -1
  want_cache = cache_value + carry_cache * (np.arange(length) < STEPS)[None, :, None, None]
  right = (np.array_equal(outputs[0], want_out) and np.array_equal(outputs[1], want_cache)
           and np.array_equal(outputs[2], flag_value))
  return {'outcome': 'ok' if right else 'wrong values'}


def slicing(*, mesh: str, layout: str, how: str) -> dict:
  """Claim 3: x [8, 4] laid out as `layout`, cut in a function: `how` is
  one of 'x[:, None]', 'expand_dims', 'x[:, -1]', 'squeeze', 'one-hot'
  (x[:, -1] as a one-hot sum, decode's `_select`)."""
  np, tf, dtensor, m = _setup(mesh)
  place, fetch = _placer(tf, dtensor, m)
  array = np.arange(32, dtype=np.float32).reshape(8, 4)
  cuts = {
      'x[:, None]': (lambda x: x[:, None], array[:, None]),
      'expand_dims': (lambda x: tf.expand_dims(x, 1), array[:, None]),
      'x[:, -1]': (lambda x: x[:, -1], array[:, -1]),
      'x[:, -1:] + squeeze': (lambda x: tf.squeeze(x[:, -1:], 1), array[:, -1]),
      'one-hot sum': (lambda x: tf.reduce_sum(x * tf.one_hot(3, 4), axis=1), array[:, -1]),
  }
  cut, want = cuts[how]
  spec = {'data': ('data', '-'), 'model': ('-', 'model'), 'data, model': ('data', 'model'),
          'replicated': ('-', '-')}[layout]
  try:
    got = fetch(tf.function(cut, autograph=False)(place(array, spec)))
  except Exception as e:  # pylint: disable=broad-except
    return {'outcome': _first_line(e)}
  return {'outcome': 'ok' if np.array_equal(got, want) else 'wrong values'}


def attention_loop(*, layers: int, second: str, mesh: str = '2x4') -> dict:
  """Claim 1, a minimal decoder: a loop carrying (step, token [B], per layer
  a cache [B, L, D]) that embeds the token, and per layer writes it into
  the cache at column `step` and attends over the cache, then picks the
  argmax of a projection as the next token; every carried tensor relaid out
  over 'data'. Then `second`: 'same call', 'retrace' (a longer cache) or
  'other function'. Values against the same function without DTensor."""
  np, tf, dtensor, m = _setup(mesh)
  place, fetch = _placer(tf, dtensor, m)
  batch, dim, vocab = 8, 4, 16
  rng = np.random.default_rng(0)
  table_value = rng.standard_normal([vocab, dim]).astype(np.float32)
  out_value = rng.standard_normal([dim, vocab]).astype(np.float32)
  table, out_w = (dtensor.DVariable(place(v, ('-', '-'))) for v in (table_value, out_value))

  def lay(x):
    return dtensor.relayout(x, dtensor.Layout(['data'] + [dtensor.UNSHARDED] * (x.shape.rank - 1),
                                              m))

  def decode(tokens, caches, table, out_w, lay):
    length = caches[0].shape[1]

    def body(step, tokens, *caches):
      x = tf.gather(table, tokens)                                         # [B, D]
      written = tf.reshape(tf.one_hot(step, length), [1, length, 1]) > 0  # [1, L, 1]
      updated = []
      for cache in caches:
        cache = lay(tf.where(written, tf.expand_dims(x, 1), cache))
        scores = tf.nn.softmax(tf.einsum('bd,bld->bl', x, cache))
        x = x + tf.einsum('bl,bld->bd', scores, cache)
        updated.append(cache)
      return (step + 1, lay(tf.argmax(x @ out_w, axis=1, output_type=tf.int32)), *updated)
    return tf.while_loop(lambda step, *rest: step < STEPS, body,
                         (tf.constant(0), tokens, *caches))[1]

  def compiled():
    return tf.function(lambda t, *c: decode(t, c, table, out_w, lay), autograph=False)

  reference = tf.function(lambda t, *c: decode(t, c, tf.constant(table_value),
                                               tf.constant(out_value), lambda x: x),
                          autograph=False)
  first = compiled()
  other = compiled() if second == 'other function' else first
  result = {}
  for label, fn, length in (('first call', first, 4), ('second call', other,
                                                  8 if second == 'retrace' else 4)):
    tokens = rng.integers(0, vocab, [batch]).astype(np.int32)
    caches = [np.zeros([batch, length, dim], np.float32)] * layers
    try:
      got = fetch(fn(place(tokens, ('data',)), *[place(c, ('data', '-', '-')) for c in caches]))
      want = reference(tokens, *caches).numpy()
      result[label] = 'ok' if np.array_equal(got, want) else 'wrong values'
    except Exception as e:  # pylint: disable=broad-except
      result[label] = _first_line(e)
  return result


def decoder(*, second: str, cached: bool = True, layers: int = 2,
            split_heads: bool = True) -> dict:
  """Claim 1 on meshgin's own loop: `CachedLM.generate` (layout_core.infer.decode)
  traced into a caller's function on the 2x4 mesh (then it runs as one
  `tf.while_loop`), a `layers`-block LM, rows over 'data', heads over
  'model' (`split_heads`; else every weight replicated), with its cache
  (`cached`) or recomputing; then `second`: 'same call', 'retrace' (prompts
  twice as wide), or 'other decoder' (a second CachedLM and function over
  the same weights). Greedy tokens compared with the same model on plain
  variables without DTensor (`generate_by_recomputing`)."""
  np, tf, dtensor, m = _setup('2x4')
  place, fetch = _placer(tf, dtensor, m)
  from layout_core.infer.decode import CachedLM  # pylint: disable=import-outside-toplevel
  from layout_core.model.lm import transformer_lm_params  # pylint: disable=import-outside-toplevel
  params = transformer_lm_params(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64,
                                 num_layers=layers, max_len=24)
  rng = np.random.default_rng(0)
  values = {spec.path: (0.5 * rng.standard_normal(spec.shape)).astype(np.float32)
            for spec in params.cls.variable_specs(params)}
  heads = {'wq': ('-', 'model', '-'), 'wk': ('-', 'model', '-'), 'wv': ('-', 'model', '-'),
           'wo': ('model', '-', '-')}

  def on_mesh(path, value):
    spec = heads.get(path.rsplit('/', 1)[1], ('-',) * value.ndim) if split_heads else (
        ('-',) * value.ndim)
    return dtensor.DVariable(place(value, spec))
  weights = {path: on_mesh(path, value) for path, value in values.items()}
  plain = CachedLM(params, {path: tf.Variable(v) for path, v in values.items()})

  def traced(lm):
    run = lm.generate if cached else lm.generate_by_recomputing
    return tf.function(lambda p, n: run(p, n, max_new_tokens=4))

  first_lm = CachedLM(params, weights)
  first = traced(first_lm)
  other = traced(CachedLM(params, weights)) if second == 'other decoder' else first
  result = {}
  for label, fn, width in (('first call', first, 6), ('second call', other,
                                                  12 if second == 'retrace' else 6)):
    prompts = rng.integers(0, 32, [4, width]).astype(np.int32)
    lengths = np.array([width, width - 1, 2, 1], np.int32)
    inputs = place(prompts, ('data', '-')), place(lengths, ('data',))
    graph = fn.get_concrete_function(*inputs).graph
    result[f'{label} loops'] = sorted(f"{op.name}: {op.get_attr('body').name}"
                                      for op in graph.get_operations()
                                      if op.type in ('While', 'StatelessWhile'))
    try:
      got = fetch(fn(*inputs))
      want = plain.generate_by_recomputing(prompts, lengths, max_new_tokens=4).numpy()
      result[label] = 'ok' if np.array_equal(got, want) else 'wrong values'
    except Exception as e:  # pylint: disable=broad-except
      result[label] = _first_line(e)
  return result


CLAIMS = {'second_loop': second_loop, 'attention_loop': attention_loop, 'decoder': decoder,
          'unchanged_variable': unchanged_variable, 'slicing': slicing}

# -------------------------------------------------------------- the parent


def variations() -> list[tuple[str, dict, int]]:
  """(claim, settings, runs) for every variation tried: `runs` fresh
  processes where an outcome was seen to change from run to run."""
  rows = []
  for second in ('same call', 'retrace', 'other function', 'new bound', 'new scale',
                 'other layout'):
    for names in ('default', 'same', 'distinct'):
      rows.append(('second_loop', dict(mesh='2x4', layout='replicated', second=second,
                                       names=names)))
  for mesh, layout in (('2x4', 'data'), ('2x4', 'model'), ('8', 'data'), ('1', 'replicated'),
                       ('plain', 'replicated')):
    for second in ('retrace', 'other function', 'new bound'):
      rows.append(('second_loop', dict(mesh=mesh, layout=layout, second=second,
                                       names='default')))
  rows.append(('second_loop', dict(mesh='2x4', layout='replicated', second='retrace',
                                   names='default', reduce_retracing=True)))
  for body, layout, sums in (('relayout', 'data', 1), ('variable', 'data', 1),
                             ('split variable', 'data', 1), ('gather', 'data', 1),
                             ('row sums', 'model', 1), ('add', 'data', 4)):
    for second in ('retrace', 'other function'):
      rows.append(('second_loop', dict(mesh='2x4', layout=layout, second=second,
                                       names='distinct', body=body, sums=sums)))
  for layers in (1, 2):
    for second in ('retrace', 'other function'):
      rows.append(('attention_loop', dict(layers=layers, second=second)))
  for second in ('same call', 'retrace', 'other decoder'):
    rows.append(('decoder', dict(second=second), DECODER_RUNS))
  for variation in (dict(layers=1), dict(cached=False), dict(split_heads=False)):
    rows.append(('decoder', dict(second='retrace', **variation), DECODER_RUNS))
  for flag in ('bool', 'int32', 'float32'):
    for flag_layout in ('sharded', 'replicated'):
      for returned in ('as is', 'relaid out', 'recomputed', 'recomputed, relaid out') + (
          ('times one, relaid out',) if flag != 'bool' else ()):
        rows.append(('unchanged_variable', dict(mesh='2x4', flag=flag, flag_layout=flag_layout,
                                                carry_cache=True, reads_flag=True,
                                                returned=returned)))
  for carry_cache, reads_flag in ((True, False), (False, True), (False, False)):
    for returned in ('as is', 'relaid out'):
      rows.append(('unchanged_variable', dict(mesh='2x4', flag='bool', flag_layout='sharded',
                                              carry_cache=carry_cache, reads_flag=reads_flag,
                                              returned=returned)))
  for mesh in ('8', '1'):
    for returned in ('as is', 'relaid out', 'recomputed, relaid out'):
      rows.append(('unchanged_variable', dict(mesh=mesh, flag='bool', flag_layout='sharded',
                                              carry_cache=False, reads_flag=False,
                                              returned=returned)))
  for layout in ('data', 'model', 'data, model'):
    for how in ('x[:, None]', 'expand_dims', 'x[:, -1]', 'x[:, -1:] + squeeze', 'one-hot sum'):
      rows.append(('slicing', dict(mesh='2x4', layout=layout, how=how),
                   SLICING_RUNS if how == 'x[:, None]' else 1))
  return [row if len(row) == 3 else (*row, 1) for row in rows]


def run_variations(claim: str, settings: dict, runs: int) -> dict:
  """The variation in `runs` fresh processes: its outcome (the outcomes seen,
  with how often where they differ) and each run's result."""
  results = [run_variation(claim, settings) for _ in range(runs)]
  seen = collections.Counter(r['outcome'] for r in results)
  if len(seen) == 1 and runs == 1:
    return results[0]
  outcome = '; '.join(f'{o} ({n} of {runs} runs)' if len(seen) > 1 else f'{o} ({runs} runs)'
                      for o, n in seen.most_common())
  return {'outcome': outcome, 'runs': results}


def run_variation(claim: str, settings: dict) -> dict:
  """One variation in a fresh process: its result, or how the process ended."""
  environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  try:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), '--child',
                           json.dumps([claim, settings])], env=environ, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    return {'outcome': f'timed out after {TIMEOUT_S} s'}
  if 'RESULT ' in done.stdout:
    result = json.loads(done.stdout.split('RESULT ', 1)[1])
    if 'outcome' not in result:  # two calls: the first that did not go right
      result['outcome'] = next((f'{call}: {result[call]}' for call in ('first call',
                                                                       'second call')
                                if result[call] != 'ok'), 'ok')
    return result
  if done.returncode < 0:
    name = signal.Signals(-done.returncode).name
    return {'outcome': f'crash ({name})'}
  tail = (done.stderr.strip().splitlines() or ['no output'])[-1]
  return {'outcome': f'exit {done.returncode}: {tail[:200]}'}


def _child(spec: str) -> None:
  claim, settings = json.loads(spec)
  print('RESULT ' + json.dumps(CLAIMS[claim](**settings)), flush=True)


def _describe(settings: dict) -> str:
  return ', '.join(f'{k}={v}' for k, v in settings.items())


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'dtensor_while_loop.json'))
  parser.add_argument('--child', help=argparse.SUPPRESS)
  parser.add_argument('--only', default='', help='run only this claim (not written)')
  args = parser.parse_args()
  if args.child:
    _child(args.child)
    return
  rows = []
  for claim, settings, runs in variations():
    if args.only and claim != args.only:
      continue
    result = run_variations(claim, settings, runs)
    rows.append({'claim': claim, **settings, **result})
    print(f"{claim:18s} {_describe(settings):90s} {result['outcome'][:160]}", flush=True)
  if not args.only:
    write_json(rows, args.out)


if __name__ == '__main__':
  main()
