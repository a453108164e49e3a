"""Decoding speed side by side, in turns: meshgin's cached decoder against
decoding by recomputing, a hand-written plain-TF cached loop, keras_hub's
CausalLM.generate, and an exported SavedModel's `generate` against
`launch.decode`'s path.

One setting for all: an lm_small-sized Transformer LM (4 blocks, width 256,
8 heads, ffn 1024, 256 byte ids, max_len 256; 3.3M parameters), a batch of
8 prompts of 32 tokens, 224 new tokens each, greedy, no stop id (every row
makes all 224). Figures are new tokens per second (8 x 224 / the call's
time). Contenders, each a child process that builds, compiles and warms up,
then waits; the parent asks each in turn for one timed round of a few calls
(`--rounds` times), so load drift hits all alike; each figure is the best
round's:

* `meshgin cached`, `meshgin recomputing`: `CachedLM.generate` and
  `generate_by_recomputing` over plain tf.Variables on one device (random
  weights, the same in every child that takes them).
* `plain TF cached loop`: the same model and weights written by hand here:
  plain tf.Variables (the cache too, written one position a step), one
  `tf.function`, a `tf.while_loop`; its tokens are compared with meshgin's.
* `keras_hub GPT2CausalLM`: `GPT2CausalLM.generate` (greedy sampler, TF
  backend) of a GPT-2 backbone of the same size, where keras_hub imports
  (`pip install keras-hub`; put it on PYTHONPATH); otherwise recorded as
  not installed.
* `SavedModel generate`, `launch.decode path`: a checkpoint of the same
  model (1 training step of `configs/models/lm_small.gin`, written by
  `launch.train`) exported by `launch.export` and loaded with
  `tf.saved_model.load`, against what `launch.decode` runs: the run's
  config, `plugins.inference.load_trained` on a one-device mesh and
  `CachedLM` over its DVariables.

    python bench/decode.py [--rounds 3] [--seconds 3] [--out bench/results/decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import RESULTS, write_json  # noqa: E402

SIZE = dict(vocab_size=256, model_dim=256, num_heads=8, ffn_dim=1024, num_layers=4, max_len=256)
BATCH, PROMPT, NEW = 8, 32, 224
RUN_BINDINGS = ['data.vocab_size = 256', 'data.seq_len = 256', 'train.batch_size = 8',
                'train.num_steps = 1', 'train.eval_every = 0', "mesh.shape = {'data': 1}"]
RUN_FILES = ['configs/runs/train.gin', 'configs/models/lm_small.gin']


# ---------------------------------------------------------------- child side


def prompts():
  import numpy as np  # pylint: disable=import-outside-toplevel
  ids = np.random.default_rng(1).integers(0, SIZE['vocab_size'], [BATCH, PROMPT])
  return ids.astype(np.int32), np.full([BATCH], PROMPT, np.int32)


def random_weights() -> dict:
  """path -> float32 array: lm_small's variables, spread so greedy picks are far from ties."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from layout_core.model.lm import transformer_lm_params  # pylint: disable=import-outside-toplevel
  params = transformer_lm_params(**SIZE)
  rng, values = np.random.default_rng(0), {}
  for spec in params.cls.variable_specs(params):
    name, shape = spec.path.rsplit('/', 1)[1], tuple(spec.shape)
    noise = rng.standard_normal(shape)
    if name == 'scale':
      value = 1 + 0.1 * noise
    elif len(shape) == 1:
      value = 0.1 * noise
    elif name.endswith('table'):
      value = noise
    else:
      value = noise / np.sqrt(np.prod(shape[:2]) if name == 'wo' else shape[0])
    values[spec.path] = value.astype(np.float32)
  return params, values


def meshgin_contender(spec: dict):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from layout_core.infer.decode import CachedLM  # pylint: disable=import-outside-toplevel
  from layout_core.layout.variables import to_numpy  # pylint: disable=import-outside-toplevel
  params, values = random_weights()
  lm = CachedLM(params, {path: tf.Variable(value) for path, value in values.items()})
  run = lm.generate if spec['cached'] else lm.generate_by_recomputing
  ids, lengths = prompts()
  return lambda: to_numpy(run(ids, lengths, max_new_tokens=NEW)), {'device': 'one, no DTensor'}


def plain_decoder(values: dict):
  """The LM's greedy decoding written by hand in plain TF: (generate() -> [B, NEW] tokens)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  w = {path.removeprefix('lm/'): tf.Variable(value) for path, value in values.items()}
  layers, heads = SIZE['num_layers'], SIZE['num_heads']
  head_dim, length = SIZE['model_dim'] // heads, PROMPT + NEW - 1
  caches = [(tf.Variable(tf.zeros([BATCH, length, heads, head_dim])),
             tf.Variable(tf.zeros([BATCH, length, heads, head_dim]))) for _ in range(layers)]
  slots = tf.range(length)

  def norm(x, name):
    mean, variance = tf.nn.moments(x, [-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-6) * w[f'{name}/scale'] + w[f'{name}/bias']

  def forward(tokens, start):
    """tokens [B, T] at positions start..start+T-1: logits at the last [B, V]."""
    width = tokens.shape[1]
    positions = start + tf.range(width)
    x = tf.gather(w['emb/table'], tokens) + tf.gather(w['emb/pos_table'], positions)[None]
    visible = tf.cast(slots[None, :] <= positions[:, None], tf.float32)   # [T, L]
    for i, (keys, values_) in enumerate(caches):
      block = f'stack/block_{i:03d}'
      h = norm(x, f'{block}/ln_attn')
      q, k, v = (tf.einsum('btd,dhk->bthk', h, w[f'{block}/attn/{n}']) for n in ('wq', 'wk', 'wv'))
      written = [keys[:, start:start + width].assign(k), values_[:, start:start + width].assign(v)]
      with tf.control_dependencies(written):
        scores = tf.einsum('bthk,buhk->bhtu', q, keys.read_value()) * head_dim ** -0.5
        probs = tf.nn.softmax(scores + (1.0 - visible) * -1e9)
        context = tf.einsum('bhtu,buhk->bthk', probs, values_.read_value())
      x += tf.einsum('bthk,hkd->btd', context, w[f'{block}/attn/wo'])
      h = norm(x, f'{block}/ln_ffn')
      x += (tf.nn.relu(h @ w[f'{block}/ffn/w_in'] + w[f'{block}/ffn/b_in'])
            @ w[f'{block}/ffn/w_out'] + w[f'{block}/ffn/b_out'])
    return norm(x[:, -1], 'final_ln') @ w['softmax/w'] + w['softmax/b']

  @tf.function(autograph=False)
  def generate(prompt_ids):
    first = tf.argmax(forward(prompt_ids, 0), -1, output_type=tf.int32)
    out = tf.TensorArray(tf.int32, size=NEW).write(0, first)

    def body(step, last, out):
      token = tf.argmax(forward(last[:, None], PROMPT + step - 1), -1, output_type=tf.int32)
      return step + 1, token, out.write(step, token)
    return tf.transpose(tf.while_loop(lambda step, *_: step < NEW, body,
                                      (tf.constant(1), first, out))[2].stack())
  return generate


def plain_contender(spec: dict):
  del spec
  _, values = random_weights()
  generate = plain_decoder(values)
  ids, _ = prompts()
  return lambda: generate(ids).numpy(), {'device': 'one, plain TF'}


def keras_hub_contender(spec: dict):
  del spec
  os.environ['KERAS_BACKEND'] = 'tensorflow'
  import numpy as np  # pylint: disable=import-outside-toplevel
  import keras_hub  # pylint: disable=import-outside-toplevel
  backbone = keras_hub.models.GPT2Backbone(
      vocabulary_size=SIZE['vocab_size'], num_layers=SIZE['num_layers'],
      num_heads=SIZE['num_heads'], hidden_dim=SIZE['model_dim'],
      intermediate_dim=SIZE['ffn_dim'], max_sequence_length=SIZE['max_len'], dropout=0.0)
  model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
  model.compile(sampler='greedy')
  ids, _ = prompts()
  tokens = np.zeros([BATCH, PROMPT + NEW], np.int32)
  tokens[:, :PROMPT] = ids
  mask = np.zeros([BATCH, PROMPT + NEW], bool)
  mask[:, :PROMPT] = True
  inputs = {'token_ids': tokens, 'padding_mask': mask}
  return (lambda: model.generate(inputs, stop_token_ids=None)['token_ids'][:, PROMPT:]), {
      'keras_hub': keras_hub.__version__, 'parameters': int(backbone.count_params()),
      'jit_compile': bool(model.jit_compile), 'device': 'one, Keras 3 on TF'}


def saved_model_contender(spec: dict):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  generate = tf.saved_model.load(spec['export_dir']).signatures['generate']
  ids, lengths = prompts()
  return (lambda: generate(prompts=tf.constant(ids), lengths=tf.constant(lengths))['tokens']
          .numpy()), {'device': 'one, SavedModel'}


def decode_path_contender(spec: dict):
  """What launch.decode runs: the run's config, load_trained, CachedLM on its DVariables."""
  # pylint: disable=import-outside-toplevel
  from layout_core.infer.decode import CachedLM
  from layout_core.layout.variables import to_numpy
  from plugins import gin_setup, inference, plan as plan_lib
  model_dir = spec['model_dir']
  with gin_setup.parsed_config(files=[inference.run_config(model_dir=model_dir)], bindings=[]):
    plan = plan_lib.make_plan()
    trained = inference.load_trained(plan, model_dir=model_dir, pipelined=False)
    lm = CachedLM(plan.params, trained.variables, batch_axis=plan.train.batch_axis)
  ids, lengths = prompts()
  return (lambda: to_numpy(lm.generate(ids, lengths, max_new_tokens=NEW))), {
      'device': plan.mesh_spec.describe()}


CONTENDERS = {'meshgin': meshgin_contender, 'plain': plain_contender,
              'keras_hub': keras_hub_contender, 'saved_model': saved_model_contender,
              'decode_path': decode_path_contender}


def child(spec: dict) -> None:
  try:
    call, info = CONTENDERS[spec['kind']](spec)
  except ImportError as e:
    print('READY ' + json.dumps({'unavailable': f'{type(e).__name__}: {e}'}), flush=True)
    return
  start = time.perf_counter()
  call()  # compiles
  info['first_call_s'] = time.perf_counter() - start
  start = time.perf_counter()
  tokens = call()
  info['warm_call_s'] = time.perf_counter() - start
  info['tokens_head'] = [int(t) for t in tokens[0][:16]]
  info['tokens'] = [[int(t) for t in row] for row in tokens]
  print('READY ' + json.dumps(info), flush=True)
  for line in sys.stdin:
    calls = int(line)
    start = time.perf_counter()
    for _ in range(calls):
      call()
    print(f'TIME {(time.perf_counter() - start) / calls}', flush=True)


# ---------------------------------------------------------------- parent side


class Child:
  """A contender's process: builds and warms up, then times calls on request."""

  def __init__(self, name: str, spec: dict):
    self.name, self.spec = name, spec
    paths = [REPO] + [p for p in [os.environ.get('PYTHONPATH')] if p]  # keras_hub's, if given
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=os.pathsep.join(paths))
    self.process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), '--child', json.dumps(spec)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd=REPO)
    try:
      self.info = json.loads(self._expect('READY'))
    except RuntimeError as e:
      self.info = {'error': str(e)}

  @property
  def ready(self) -> bool:
    return 'error' not in self.info and 'unavailable' not in self.info

  def _expect(self, word: str) -> str:
    for line in self.process.stdout:
      if line.startswith(word + ' '):
        return line[len(word) + 1:]
    code = self.process.wait()
    raise RuntimeError(f'exited {code}: {self.process.stderr.read()[-2000:]}')

  def run(self, calls: int) -> float:
    self.process.stdin.write(f'{calls}\n')
    self.process.stdin.flush()
    return float(self._expect('TIME'))

  def close(self) -> None:
    if self.process.poll() is None:
      self.process.stdin.close()
      self.process.wait(timeout=60)


def export_checkpoint(scratch: str) -> dict:
  """A 1-step lm_small run and its SavedModel: {'model_dir', 'export_dir'}, or {'error'}."""
  model_dir, export_dir = os.path.join(scratch, 'run'), os.path.join(scratch, 'export', '1')
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=REPO)
  os.makedirs(os.path.dirname(export_dir))  # launch.export makes the last directory only
  steps = [['launch.train', *[f'--gin_file={f}' for f in RUN_FILES], f'--model_dir={model_dir}',
            *[f'--gin_bindings={b}' for b in RUN_BINDINGS]],
           ['launch.export', f'--model_dir={model_dir}', f'--export_dir={export_dir}',
            f'--seq_len={SIZE["max_len"]}', f'--prompt_len={PROMPT}', f'--max_new_tokens={NEW}']]
  for argv in steps:
    done = subprocess.run([sys.executable, '-m', *argv], cwd=REPO, env=env, capture_output=True,
                          text=True)
    if done.returncode:
      return {'model_dir': model_dir if argv[0] == 'launch.export' else None,
              'error': f'{argv[0]} exited {done.returncode}: {done.stderr[-1500:]}'}
  return {'model_dir': model_dir, 'export_dir': export_dir}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--seconds', type=float, default=3.0,
                      help='about this long per contender per round (at least one call)')
  parser.add_argument('--child', help=argparse.SUPPRESS)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'decode.json'))
  args = parser.parse_args()
  if args.child:
    child(json.loads(args.child))
    return
  with tempfile.TemporaryDirectory(prefix='meshgin-bench-decode-') as scratch:
    exported = export_checkpoint(scratch)
    specs = {'meshgin cached': {'kind': 'meshgin', 'cached': True},
             'meshgin recomputing': {'kind': 'meshgin', 'cached': False},
             'plain TF cached loop': {'kind': 'plain'},
             'keras_hub GPT2CausalLM': {'kind': 'keras_hub'}}
    if exported.get('export_dir'):
      specs['SavedModel generate'] = {'kind': 'saved_model', 'export_dir': exported['export_dir']}
    if exported.get('model_dir'):
      specs['launch.decode path'] = {'kind': 'decode_path', 'model_dir': exported['model_dir']}
    children = {}
    for name, spec in specs.items():
      start = time.perf_counter()
      children[name] = Child(name, spec)
      state = 'ready' if children[name].ready else f"not run: {children[name].info}"[:300]
      print(f'  built {name} in {time.perf_counter() - start:.0f} s: {state}', flush=True)
    ready = {name: c for name, c in children.items() if c.ready}
    calls = {name: max(1, round(args.seconds / c.info['warm_call_s'])) for name, c in ready.items()}
    times = {name: [] for name in ready}
    try:
      for _ in range(args.rounds):
        for name, child_ in ready.items():
          times[name].append(child_.run(calls[name]))
    finally:
      for child_ in children.values():
        child_.close()
  results = {'setting': {**SIZE, 'batch': BATCH, 'prompt': PROMPT, 'new_tokens': NEW,
                         'greedy': True}, 'rounds': args.rounds, 'contenders': {}}
  if 'error' in exported:
    results['export_error'] = exported['error']
  same_as = {'meshgin recomputing': 'meshgin cached', 'plain TF cached loop': 'meshgin cached',
             'SavedModel generate': 'launch.decode path'}  # the same weights: the same tokens
  for name, child_ in children.items():
    info = {k: v for k, v in child_.info.items() if k != 'tokens'}
    if name in ready:
      best = min(times[name])
      info.update(tokens_per_sec=BATCH * NEW / best, seconds_per_call=best,
                  rounds_s=times[name], calls_per_round=calls[name])
      other = ready.get(same_as.get(name))
      if other is not None:
        same = [a == b for x, y in zip(child_.info['tokens'], other.info['tokens'])
                for a, b in zip(x, y)]
        info[f'same_tokens_as {same_as[name]}'] = sum(same) / len(same)
    results['contenders'][name] = info
  rates = {name: info['tokens_per_sec'] for name, info in results['contenders'].items()
           if 'tokens_per_sec' in info}
  pairs = {'cached / recomputing': ('meshgin cached', 'meshgin recomputing'),
           'cached / plain TF cached loop': ('meshgin cached', 'plain TF cached loop'),
           'cached / keras_hub': ('meshgin cached', 'keras_hub GPT2CausalLM'),
           'SavedModel / launch.decode path': ('SavedModel generate', 'launch.decode path')}
  results['ratios'] = {k: rates[a] / rates[b] for k, (a, b) in pairs.items()
                       if a in rates and b in rates}
  for name, info in results['contenders'].items():
    figure = (f"{info['tokens_per_sec']:8.0f} tokens/s ({info['seconds_per_call']:.2f} s a call)"
              if 'tokens_per_sec' in info else f"not run: {info}"[:200])
    print(f'  {name:26s} {figure}', flush=True)
  for name, ratio in results['ratios'].items():
    print(f'  {name}: {ratio:.2f}x', flush=True)
  write_json(results, args.out)


if __name__ == '__main__':
  main()
