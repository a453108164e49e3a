"""Both pipeline engines on 2 clients x 2 devices against 1 process x 4.

For each engine (sub-mesh GPipe on lm_pipeline.gin with dropout and
gradient accumulation, reading a token corpus in 8 streams; the SPMD stage
axis on lm_pipeline_spmd.gin in bfloat16, dropout on), one module fixture
trains, with real `launch.train` processes (2-cell models, 2 micro-batches:
a fraction of the configs' compile):

* the reference: 1 process, NUM_STEPS (10) steps, uninterrupted;
* the same steps as a relay of three runs, each resuming the last one's
  checkpoint: 2 clients until SIGTERM reaches client 1 alone (after step 2
  is saved; both clients stop at one step s and save it), then 1 process
  (2 -> 1) for LEG (2) steps, then 2 clients again (1 -> 2) to the last step.

Every step's loss of the relay equals the reference's (1e-5), and its final
parameters equal the reference's (1e-6): the pipelines across clients, the
stop, and both checkpoint moves at once. The two engines' runs go side by
side, a phase at a time.

Each engine's mesh is the smallest that still shows what crosses the
clients (a launched run compiles its steps once per device): the sub-mesh
engine's stages are data=2 x model=1, 'data' across the clients in each
stage (so each client reads only its rows); the SPMD engine's stage axis
is the clients, each stage data=1 x model=2 (Megatron within a client).
"""

import json
import os
import re
import signal

import numpy as np
import pytest
import tensorflow as tf

from layout_core.tasks.corpus import write_documents
from tests.conftest import SPMD_ON_FOUR, Launched, killed_if_left, read_events, run_modules
from tests.numerics import assert_close
from tests.test_multi_client import (Client, assert_same_state, ckpt, copy_checkpoint,
                                     free_cluster, wait_until)

NUM_STEPS = 10
SAVE_EVERY = 2  # the first save, after which client 1 gets its SIGTERM
LEG = 2         # steps of the one-process run between the 2-client runs
COMMON = ['--gin_bindings=pipeline.num_micro_batches = 2', '--gin_bindings=train.log_every = 1',
          '--gin_bindings=train.eval_every = 0', '--gin_bindings=train.eval_batches = 1',
          f'--gin_bindings=checkpoint.every_steps = {SAVE_EVERY}',
          '--gin_bindings=checkpoint.keep = 10',
          # The relay's one-process leg ends early (its own train.num_steps): a
          # schedule that does not depend on the step count.
          "--gin_bindings=optimizer.decay = 'constant'",
          f'--gin_bindings=train.num_steps = {NUM_STEPS}']
ENGINES = ('submesh', 'spmd')


def engine_args(corpus) -> dict[str, list[str]]:
  return {
      'submesh': ['--gin_file=configs/experiments/lm_pipeline.gin',
                  "--gin_bindings=mesh.shape = {'stage': 2, 'data': 2, 'model': 1}",
                  '--gin_bindings=transformer_block.dropout_rate = 0.1', *COMMON,
                  '--gin_bindings=transformer_lm.num_layers = 2',  # a cell of each width
                  '--gin_bindings=transformer_lm.cells = '
                  '[@narrow/transformer_block(), @wide/transformer_block()]',
                  '--gin_bindings=data.task = @lm_corpus()',
                  f"--gin_bindings=lm_corpus.train_files = '{corpus}/train-*'",
                  f"--gin_bindings=lm_corpus.eval_files = '{corpus}/eval-*'",
                  '--gin_bindings=lm_corpus.vocab_size = 64', '--gin_bindings=lm_corpus.pack = False',
                  '--gin_bindings=lm_corpus.seq_len = 32',
                  # Accumulation: each client's rows of 2 x 2 micro-batches.
                  '--gin_bindings=train.grad_accum_steps = 2'],
      'spmd': ['--gin_file=configs/experiments/lm_pipeline_spmd.gin',
               SPMD_ON_FOUR, *COMMON,
               '--gin_bindings=transformer_lm.num_layers = 2',  # a cell per stage
               '--gin_bindings=pipeline.circular_repeats = 1',
               "--gin_bindings=train.compute_dtype = 'bfloat16'",
               '--gin_bindings=train.profile_steps = (1, 2)'],
  }


def write_corpus(root) -> str:
  """Documents whose tokens follow from the previous, over 8 train files."""
  rng = np.random.default_rng(0)
  documents = [[3 + (start + 5 * t) % 61 for t in range(rng.integers(8, 80))]
               for start in rng.integers(3, 64, 600)]
  write_documents(str(root / 'train-{shard}.tfrecord'), documents, num_shards=8)
  write_documents(str(root / 'eval-{shard}.tfrecord'), documents[:40])
  return str(root)
TWO_CLIENTS = ('launch.local_cluster', '--num_clients=2', '--devices_per_client=2', '--')


def losses(model_dir) -> dict[int, float]:
  return dict(read_events(model_dir)['scalars']['train/loss'])


@pytest.fixture(scope='module')
def relay(tmp_path_factory):
  """{engine: {'reference', 'first', 'second', 'third': model_dir, 'stopped': s,
  'outputs': {client: output of the first run}, 'third_output': the last run's}}."""
  root = tmp_path_factory.mktemp('pipeline_clients')
  args_of = engine_args(write_corpus(tmp_path_factory.mktemp('corpus')))
  dirs = {engine: {name: str(root / engine / name)
                   for name in ('reference', 'first', 'second', 'third')}
          for engine in ENGINES}
  # Phase 1: the references, and the first 2-client runs stopped by a SIGTERM to client 1.
  references = [Launched('launch.train', *args, f'--model_dir={dirs[e]["reference"]}',
                         label=f'{e} reference') for e, args in args_of.items()]
  clients = {}
  for engine, args in args_of.items():
    cluster = free_cluster()
    clients[engine] = [Client(k, cluster, *args, f'--model_dir={dirs[engine]["first"]}')
                       for k in (0, 1)]
  everything = [*references, *(c for pair in clients.values() for c in pair)]
  with killed_if_left(*everything):
    # Each engine's client 1 gets its SIGTERM as soon as its client 0 saved its
    # first checkpoint: the engines run at different speeds, and the faster one
    # waiting for the slower one's save would be stopped too late to relay
    # (stop + LEG >= NUM_STEPS).
    waiting = dict(clients)

    def signalled_each():
      for engine, pair in list(waiting.items()):
        if re.search(rf'Saved checkpoint .*ckpt-{SAVE_EVERY}/ckpt', pair[0].output):
          pair[1].kill(signal.SIGTERM)
          del waiting[engine]
        else:
          assert pair[0].process.poll() is None, (
              f'{engine} client 0 ended without saving step {SAVE_EVERY}:\n'
              f'{pair[0].output[-3000:]}')
      return not waiting
    wait_until(signalled_each, timeout=400,
               what="each engine's client 0 saving its first checkpoint")
    for run in everything:
      run.finish(timeout=400)
  for run in everything:
    assert run.process.returncode == 0, f'{run.label}:\n{run.output[-3000:]}'
  result = {}
  for engine, pair in clients.items():
    stops = [int(re.search(r'Preempted by .* at step (\d+): saved', c.output).group(1))
             for c in pair]
    assert stops[0] == stops[1], stops
    assert stops[0] + LEG < NUM_STEPS, f'{engine}: stopped at step {stops[0]}, too late to relay'
    result[engine] = dict(dirs[engine], stopped=stops[0],
                          outputs={k: c.output for k, c in enumerate(pair)})
  # Phase 2: 2 -> 1, LEG steps in one process.
  calls = []
  for engine, args in args_of.items():
    copy_checkpoint(dirs[engine]['first'], result[engine]['stopped'], dirs[engine]['second'])
    calls.append(('launch.train', *args, f'--model_dir={dirs[engine]["second"]}',
                  f'--gin_bindings=train.num_steps = {result[engine]["stopped"] + LEG}'))
  for done in run_modules(calls, timeout=400):
    assert done.returncode == 0, done.stderr[-3000:]
  # Phase 3: 1 -> 2, to the last step on 2 clients.
  calls = []
  for engine, args in args_of.items():
    copy_checkpoint(dirs[engine]['second'], result[engine]['stopped'] + LEG, dirs[engine]['third'])
    calls.append((*TWO_CLIENTS, *args, f'--model_dir={dirs[engine]["third"]}'))
  for engine, done in zip(ENGINES, run_modules(calls, timeout=400)):
    assert done.returncode == 0, done.stdout[-3000:]
    assert 'exit status per client: [0, 0]' in done.stdout
    result[engine]['third_output'] = done.stdout
  return result


@pytest.mark.parametrize('engine', ENGINES)
def test_two_clients_stop_move_and_end_as_one_process(relay, engine):
  runs = relay[engine]
  stopped = runs['stopped']
  assert stopped >= SAVE_EVERY
  for output in runs['outputs'].values():  # SIGTERM reached client 1 only; both stopped
    assert f'at step {stopped}: saved' in output
  assert 'SIGTERM at step' in runs['outputs'][1]
  assert 'a signal to another client at step' in runs['outputs'][0]
  reference = losses(runs['reference'])
  relayed = {**losses(runs['first']), **losses(runs['second']), **losses(runs['third'])}
  assert sorted(relayed) == sorted(reference) == list(range(1, NUM_STEPS + 1))
  # measured: 0 / 0 / 0 (default / no oneDNN / 1 thread)
  assert_close([relayed[s] for s in reference], list(reference.values()), rel=1e-05,
               what=f'losses: {engine}')
  for client in (0, 1):
    assert re.search(rf'\[client {client}\].*Resumed from .*ckpt-{stopped + LEG}/ckpt at step '
                     rf'{stopped + LEG}', runs['third_output'])
  final = ckpt(runs['third'], NUM_STEPS)
  assert_same_state(final, ckpt(runs['reference'], NUM_STEPS))  # keys, and values to 1e-6
  assert len([k for k in tf.train.load_checkpoint(final).get_variable_to_shape_map()
              if k.endswith('VARIABLE_VALUE')]) > 50


def test_each_client_holds_its_share_of_every_sub_mesh_stage_and_reads_only_its_rows(relay):
  """Sub-mesh engine: stage k is each client's k-th device (a stage per
  client cannot take DTensor's cross-mesh copy), as the run's
  log and mesh.json (the Mesh tab's data, from the real layouts) say; each
  client opens only the streams of the rows its devices hold."""
  runs = relay['submesh']
  for client, output in runs['outputs'].items():
    assert re.search(r'\| 1 \| data=2 x model=1 \| client 0: device:CPU:1; '
                     r'client 1: device:CPU:1 \|', output), output[-4000:]
    # Its rows: half of each of the 2 x 2 micro-batches of 8 (2 accumulation
    # steps of 2 micro-batches; 'data' spans the clients in every stage);
    # batch rows 4k..4k+3 come from stream k of 8.
    rows = [part * 8 + client * 4 + r for part in range(4) for r in range(4)]
    streams = sorted({r // 4 for r in rows})
    line = re.search(r'Training data: streams (\[[\d, ]+\]) of 8, \d+ file\(s\): (.*)',
                     output)
    assert line and json.loads(line.group(1)) == streams, output[-4000:]
    assert [os.path.basename(p) for p in line.group(2).split(', ')] == [
        f'train-{k}.tfrecord' for k in streams]
  with open(os.path.join(runs['first'], 'mesh.json')) as f:
    mesh = json.load(f)
  assert mesh['mesh']['num_clients'] == 2
  assert [(d['id'], d['client'], d['stage']) for d in mesh['devices']] == [
      (i, i // 2, i % 2) for i in range(4)]
  softmax = next(v for v in mesh['variables'] if v['path'].endswith('softmax/w'))
  assert sorted(i for s in softmax['slices'] for i in s['devices']) == [1, 3]  # stage 1's
  spmd = json.load(open(os.path.join(relay['spmd']['first'], 'mesh.json')))
  assert [(d['client'], d['stage']) for d in spmd['devices']] == [(i // 2, i // 2)
                                                                   for i in range(4)]


def test_spmd_run_on_two_clients_records_its_stages_and_profiles(relay):
  model_dir = relay['spmd']['first']
  events = read_events(model_dir)
  [(_, bubble)] = events['scalars']['pipeline/bubble_fraction']
  assert bubble == pytest.approx(1 / 3)  # (S-1)/(R*M+S-1), S=2, R=1, M=2
  assert 'stacked_cells/ffn/w_in' in events['text']['layouts/variables'][0]
  assert re.search(r'\| 1 \| block_001 \|', events['text']['pipeline/stages'][0])
  traces = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(model_dir, 'plugins'))
            for f in files if f.endswith('.xplane.pb')]
  assert traces and os.path.getsize(traces[0]) > 0
