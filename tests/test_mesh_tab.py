"""The Mesh tab (plugins/mesh_tab): real runs, a real TensorBoard, a real Chromium.

One module fixture makes every run with real `launch.sweep` / `launch.train`
subprocesses (two steps each: a two-trial sweep over the mesh shape,
data=2 x model=4 (then resumed for a third step) and data=4 x model=2, a
two-stage pipelined run on 2 clients x 4 devices with a shadowed and an
unused layout rule, and the quickstart with `train.fsdp = True`) and serves
them all with one `tensorboard`. Each test checks what the tab serves or draws against an
independent reference: where DTensor itself puts every shard (`dtensor.unpack`
of a DVariable with the same layout on the 8 test devices), the runs'
`layouts.txt`, `config.gin` and checkpoints on disk.
"""

import ast
import html.parser
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import gin
import numpy as np
import pytest

from plugins.gin_setup import gin_settings, parse_gin
from tests.conftest import REPO_ROOT, Launched, run_module

TINY = ['--gin_bindings=train.num_steps = 2', '--gin_bindings=train.eval_every = 0',
        '--gin_bindings=train.eval_batches = 1', '--gin_bindings=train.log_every = 1',
        '--gin_bindings=checkpoint.every_steps = 0']
SWEEP = ['--gin_file=configs/experiments/lm_2d.gin', *TINY, '--parallel=2',
         "--sweep=mesh.shape=[{'data': 2, 'model': 4}, {'data': 4, 'model': 2}]"]
# configs/layouts/megatron.gin, then a rule every variable of which an earlier
# rule takes (shadowed: w_in by rule 2, w_out by rule 4) and one that fits nothing.
RULES = ("layout_rules.rules = ["
         "(r'.*/attn/w[qkv]', ('unsharded', 'model', 'unsharded')), "
         "(r'.*/attn/wo', ('model', 'unsharded', 'unsharded')), "
         "(r'.*/ffn/w_in', ('unsharded', 'model')), (r'.*/ffn/b_in', ('model',)), "
         "(r'.*/ffn/w_out', ('model', 'unsharded')), "
         "(r'.*/emb/(pos_)?table', ('unsharded', 'model')), "
         "(r'.*/softmax/w', ('unsharded', 'model')), (r'.*/softmax/b', ('model',)), "
         "(r'.*/ffn/w_(in|out)', ('model', 'unsharded')), "
         "(r'nothing/.*', ('model',))]")
PIPELINE = ['--gin_file=configs/experiments/lm_pipeline.gin', *TINY, f'--gin_bindings={RULES}',
            '--gin_bindings=transformer_lm.num_layers = 2',
            '--gin_bindings=transformer_lm.cells = '
            '[@narrow/transformer_block(), @wide/transformer_block()]']
RESUME = ['--gin_file=configs/experiments/lm_2d.gin', *TINY, '--gin_bindings=train.num_steps = 3']
FSDP = ['--gin_file=configs/experiments/quickstart.gin', *TINY, '--gin_bindings=train.fsdp = True']
SHADOWING_RULE, UNUSED_RULE = 8, 9
SELECTED = 'lm/stack/block_000/ffn/w_in'
ARTIFACTS = os.environ.get('MESHGIN_TEST_ARTIFACTS', os.path.join(REPO_ROOT, 'test-artifacts'))


class Board:
  """The runs, and a real `tensorboard --logdir` over them on a free port.

  TensorBoard finds the Mesh tab through meshgin's installed entry point; it
  runs outside the source tree, where a stale `meshgin.egg-info` (without the
  entry point) on `python -m`'s sys.path would hide it."""

  def __init__(self, root):
    self.root = root
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      self.port = s.getsockname()[1]
    self.url = f'http://127.0.0.1:{self.port}'
    self.process = subprocess.Popen(
        [sys.executable, '-m', 'tensorboard.main', '--logdir', root, '--host', '127.0.0.1',
         '--port', str(self.port), '--reload_interval', '1'],
        cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

  def fetch(self, route, body=None):
    """(HTTP status, parsed JSON) of a GET, or a POST of `body`."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f'{self.url}{route}', data=data,
                                     headers={'Content-Type': 'application/json'})
    try:
      with urllib.request.urlopen(request, timeout=20) as response:
        return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
      return e.code, json.loads(e.read())

  def get(self, route):
    status, body = self.fetch(route)
    assert status == 200, f'{route}: HTTP {status}: {body}'
    return body

  def mesh(self, run):
    return self.get(f'/data/plugin/meshgin/mesh?run={urllib.request.quote(run)}')

  def wait_until(self, what, check, deadline=60):
    give_up = time.monotonic() + deadline
    while True:
      try:
        result = check()
        if result:
          return result
      except (OSError, KeyError, ValueError):
        pass  # not serving yet, or still loading
      assert self.process.poll() is None, 'tensorboard exited'
      assert time.monotonic() < give_up, f'TensorBoard did not show {what} in {deadline} s'
      time.sleep(0.5)

  def close(self):
    self.process.terminate()
    self.process.wait(timeout=30)


def finished(process: Launched, timeout: float) -> None:
  try:
    output = process.finish(timeout)  # AssertionError, with its output, if it runs over
  finally:
    if process.process.poll() is None:
      process.process.kill()
  assert process.process.returncode == 0, f'{process.label} failed:\n{output[-3000:]}'


@pytest.fixture(scope='module')
def board(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('mesh_tab'))
  tensorboard = Board(root)
  try:
    sweep = Launched('launch.sweep', *SWEEP, f'--model_dir={root}/sweep', label='launch.sweep')
    pipeline = Launched('launch.local_cluster', '--num_clients=2', '--devices_per_client=4',
                        '--', *PIPELINE, f'--model_dir={root}/pipeline',
                        label='pipelined run on 2 clients')
    fsdp = Launched('launch.train', *FSDP, f'--model_dir={root}/fsdp', label='fsdp quickstart')
    finished(sweep, 300)
    with open(os.path.join(root, 'sweep', 'sweep.json')) as f:
      tensorboard.trials = {ast.literal_eval(t['values']['mesh.shape'])['model']: t
                            for t in json.load(f)['trials']}
    resumed = Launched('launch.train', *RESUME, f'--model_dir={root}/{run_of(tensorboard, 4)}',
                       label='resumed trial')
    finished(pipeline, 300)
    finished(resumed, 300)
    finished(fsdp, 300)
    # A run from before mesh.json, and one whose mesh.json was cut short.
    for name, text in (('old_run', None), ('broken_run', '{"format": 1, "mesh": ')):
      os.makedirs(os.path.join(root, name))
      shutil.copy(os.path.join(root, 'pipeline', 'layouts.txt'), os.path.join(root, name))
      if text is not None:
        with open(os.path.join(root, name, 'mesh.json'), 'w') as f:
          f.write(text)
    listing = tensorboard.wait_until('the Mesh plugin', lambda: tensorboard.get(
        '/data/plugins_listing').get('meshgin'))
    assert listing['enabled'] and listing['tab_name'] == 'Mesh', listing
    yield tensorboard
  finally:
    tensorboard.close()


def run_of(board, model_axis_size: int) -> str:
  return 'sweep/' + board.trials[model_axis_size]['name']


def layouts_txt(run_dir) -> list[dict]:
  """The rows of a run's layouts.txt (the markdown table the run wrote)."""
  with open(os.path.join(run_dir, 'layouts.txt')) as f:
    lines = [line for line in f if line.startswith('| ')]
  def cells(line):  # markdown cells: '|' inside one (a rule's alternation) is escaped
    return [c.strip().replace('\\|', '|')
            for c in re.split(r'(?<!\\)\|', line.strip().strip('|'))]
  header = cells(lines[0])
  return [dict(zip(header, cells(line)))
          for line in lines[1:]]


def mesh_shape(board, run) -> dict:
  """The mesh a run asked for, axes in order: its sweep value, or its gin file
  (config.gin prints dicts sorted by key)."""
  for trial in board.trials.values():
    if run == 'sweep/' + trial['name']:
      return ast.literal_eval(trial['values']['mesh.shape'])
  assert run == 'pipeline', run
  parse_gin(files=['configs/experiments/lm_pipeline.gin'], bindings=[])
  return gin.query_parameter('meshgin.mesh.shape')


def stage_devices(board) -> dict[int, list[int]]:
  """Stage -> the ids of its devices, in sub-mesh order, from the stage table
  the pipelined run wrote (`pipeline/stages`: each client's devices of each
  stage, read off the sub-meshes it built); client k's CPU:i is id 4k + i."""
  from tests.conftest import read_events
  [table] = read_events(os.path.join(board.root, 'pipeline'))['text']['pipeline/stages']
  stages = {}
  for stage, devices in re.findall(r'^\| (\d+) \| [^|]+ \| ([^|]+) \|', table, re.M):
    stages[int(stage)] = [4 * int(client) + int(i) for client, names in re.findall(
        r'client (\d+): ([^;]+)', devices) for i in re.findall(r'CPU:(\d+)', names)]
  assert sorted(stages) == [0, 1], table
  return stages


def dtensor_mesh(shape: dict):
  """DTensor's own mesh of `shape` on the test process's first devices."""
  from tensorflow.experimental import dtensor
  return dtensor.create_mesh(list(shape.items()),
                             devices=[f'CPU:{i}' for i in range(int(np.prod(list(shape.values()))))])


def coordinates(mesh) -> dict[int, dict[str, int]]:
  """Device id -> its coordinate per axis, as DTensor numbers the mesh."""
  ids = np.asarray(mesh.global_device_ids())
  return {int(ids[p]): dict(zip(mesh.dim_names, p)) for p in np.ndindex(ids.shape)}


def dtensor_shards(shape, spec, mesh) -> dict[str, np.ndarray]:
  """Where DTensor puts a DVariable of `shape` holding 0, 1, 2, ... laid out by
  `spec` on `mesh`: device name -> the shard it holds."""
  import tensorflow as tf
  from tensorflow.experimental import dtensor
  value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
  replicated = dtensor.copy_to_mesh(tf.constant(value), dtensor.Layout.replicated(mesh, len(shape)))
  variable = dtensor.DVariable(dtensor.relayout(replicated, dtensor.Layout(list(spec), mesh)))
  shards = dtensor.unpack(variable.read_value())
  return {name.rsplit('/device:', 1)[-1]: shard.numpy()
          for name, shard in zip(mesh.local_devices(), shards)}


def index_of(shard: np.ndarray, shape) -> list[list[int]]:
  """[start, stop) per dimension of a shard of arange(n).reshape(shape)."""
  first = np.unravel_index(int(shard.flat[0]), shape)
  return [[int(start), int(start) + size] for start, size in zip(first, shard.shape)]


# -- what the routes serve ---------------------------------------------------------
@pytest.mark.parametrize('which', ['2x4', '4x2', 'pipeline'])
def test_mesh_devices_and_their_bytes_match_the_config_and_layouts_txt(board, devices8, which):
  run = {'2x4': run_of(board, 4), '4x2': run_of(board, 2), 'pipeline': 'pipeline'}[which]
  directory = os.path.join(board.root, run)
  doc = board.mesh(run)
  shape = mesh_shape(board, run)
  assert doc['mesh']['axes'] == [list(item) for item in shape.items()]
  assert doc['mesh']['num_clients'] == (2 if which == 'pipeline' else 1)
  where = coordinates(dtensor_mesh(shape))
  if which == 'pipeline':  # a device's place: its stage, and where it sits in that stage
    where = {}
    for stage, ids in stage_devices(board).items():
      sub = coordinates(dtensor_mesh({a: n for a, n in shape.items() if a != 'stage'}))
      where.update({i: {'stage': stage, **sub[position]} for position, i in enumerate(ids)})
  assert [d['id'] for d in doc['devices']] == sorted(where)
  rows = layouts_txt(directory)
  for device in doc['devices']:
    coords = where[device['id']]
    assert device['coords'] == [coords[axis] for axis in shape], device
    assert device['client'] == (device['id'] // 4 if which == 'pipeline' else 0)
    stage = coords.get('stage')  # each stage: 2 devices of each client
    assert device['stage'] == stage
    # layouts.txt: every variable on the whole mesh, or on stage k's sub-mesh.
    expected = sum(int(r['bytes/device'].replace(',', '')) for r in rows
                   if r.get('mesh', '') in ('', f'stage{stage}'))
    assert device['bytes']['parameters'] == expected, device
    assert device['bytes']['optimizer'] == 2 * expected  # Adam: m and v, laid out alike
  totals = {d['id']: d['bytes']['parameters'] + d['bytes']['optimizer'] for d in doc['devices']}
  assert totals[doc['fullest_device']] == max(totals.values())
  assert doc['mesh']['stage_axis'] == ('stage' if which == 'pipeline' else None)


def test_every_slice_is_where_dtensor_puts_it(board, devices8):
  from tensorflow.experimental import dtensor
  runs = [(run_of(board, 4), None), (run_of(board, 2), None), ('pipeline', 0),
          ('pipeline', 1)]
  for run, stage in runs:
    directory = os.path.join(board.root, run)
    shape = mesh_shape(board, run)
    doc = board.mesh(run)
    mesh = dtensor_mesh(shape)
    if stage is not None:  # the stage's sub-mesh: its devices, the other axes
      mesh = dtensor.create_mesh(
          [(a, n) for a, n in shape.items() if a != 'stage'], mesh_name=f'reference{stage}',
          devices=[f'CPU:{i}' for i in stage_devices(board)[stage]])
    checked = 0
    for row in layouts_txt(directory):
      if stage is not None and row['mesh'] != f'stage{stage}':
        continue
      variable = next(v for v in doc['variables'] if v['path'] == row['path'])
      shape_of = [int(n) for n in row['shape'].split('x')]
      spec = [axis.strip() for axis in row['sharding'].split(',')]
      holders = {}
      for piece in variable['slices']:
        for device_id in piece['devices']:
          assert device_id not in holders, (run, row['path'], device_id)
          holders[f'CPU:{device_id}'] = piece['index']
      shards = dtensor_shards(shape_of, spec, mesh)
      assert set(holders) == set(shards), (run, row['path'])
      for device, shard in shards.items():
        assert holders[device] == index_of(shard, shape_of), (run, row['path'], device)
      checked += 1
    assert checked >= 5, (run, stage)


def test_rules_say_what_they_matched_which_are_unused_and_which_shadowed(board):
  directory = os.path.join(board.root, 'pipeline')
  rules = board.mesh('pipeline')['rules']
  rows = layouts_txt(directory)
  decided = [int(r['rule'].split(':')[0]) for r in rows if not r['rule'].startswith('default')]
  assert [r['matched'] for r in rules] == [decided.count(i) for i in range(len(rules))]
  fits = [r['path'] for r in rows if re.fullmatch(r'.*/ffn/w_(in|out)', r['path'])]
  shadowing, unused = rules[SHADOWING_RULE], rules[UNUSED_RULE]
  assert (shadowing['unused'], shadowing['shadowed'], shadowing['fits']) == (True, True, len(fits))
  assert shadowing['shadowed_by'] == [2, 4]
  assert (unused['unused'], unused['shadowed'], unused['fits']) == (True, False, 0)
  assert not any(r['unused'] for r in rules[:SHADOWING_RULE])
  # launch.inspect reports the same, from the plan alone.
  inspect = run_module('launch.inspect', *PIPELINE, timeout=120)
  assert inspect.returncode == 0, inspect.stderr[-2000:]
  assert re.search(rf"0  rule 8: .*<- shadowed: the {len(fits)} variable\(s\) it fits were "
                   r'taken by rule 2, rule 4', inspect.stdout), inspect.stdout[-2000:]
  assert re.search(r"0  rule 9: nothing/\.\* .*<- matched nothing", inspect.stdout)


def test_two_trials_compared_variable_by_variable_and_device_by_device(board):
  a, b = run_of(board, 4), run_of(board, 2)
  result = board.get(f'/data/plugin/meshgin/compare?a={urllib.request.quote(a)}'
                     f'&b={urllib.request.quote(b)}')
  rows_a = {r['path']: r for r in layouts_txt(os.path.join(board.root, a))}
  rows_b = {r['path']: r for r in layouts_txt(os.path.join(board.root, b))}
  expected = {p for p in rows_a
              if (rows_a[p]['sharding'], rows_a[p]['bytes/device'])
              != (rows_b[p]['sharding'], rows_b[p]['bytes/device'])}
  assert expected and len(expected) < len(rows_a)  # sharded ones change, replicated do not
  assert {v['path'] for v in result['variables'] if v['changed']} == expected
  assert result['num_changed'] == len(expected)
  for rows, side in ((rows_a, 'a'), (rows_b, 'b')):
    total = sum(int(r['bytes/device'].replace(',', '')) for r in rows.values())
    assert [d[side]['parameters'] for d in result['devices']] == [total] * 8


def test_missing_or_broken_mesh_json_is_explained(board):
  status, body = board.fetch('/data/plugin/meshgin/mesh?run=old_run')
  assert status == 404
  assert body['error'].startswith("no mesh.json in run 'old_run' (written by meshgin runs since")
  status, body = board.fetch('/data/plugin/meshgin/mesh?run=broken_run')
  assert status == 404 and "mesh.json in run 'broken_run' is not valid JSON" in body['error']
  listed = {r['run']: r for r in board.get('/data/plugin/meshgin/runs')['runs']}
  assert {'sweep/' + t['name'] for t in board.trials.values()} <= set(listed)
  assert listed['pipeline']['mesh'] and not listed['old_run']['mesh']
  dom = chromium_dom(board, run='old_run')
  assert 'data-state="error"' in dom
  assert "no mesh.json in run 'old_run' (written by meshgin runs since" in dom


# -- TensorBoard's own dashboards --------------------------------------------------
def test_saves_and_restores_of_one_step_both_show_and_train_opens_first(board):
  run = run_of(board, 4)  # saved at 2, resumed (restored at 2), saved at 3
  checkpoints = os.path.join(board.root, run, 'checkpoints')

  def lines(tag):
    return {entry['step']: entry['text'] for entry in board.get(
        f'/data/plugin/text/text?run={run}&tag={urllib.request.quote(tag)}')}

  saves = board.wait_until('both saves', lambda: len(lines('checkpoint/saves')) == 2
                           and lines('checkpoint/saves'))
  restores = lines('checkpoint/restores')
  assert sorted(saves) == [2, 3] and sorted(restores) == [2]
  assert 'ckpt-2' in saves[2] and 'ckpt-3' in saves[3] and 'ckpt-2' in restores[2]
  assert 'restored' in restores[2] and 'saved' in saves[2]
  # The size scalar: 2 significant digits (TensorBoard labels ticks with 3-4, so
  # no longer six identical labels), within rounding of the checkpoint on disk.
  sizes = board.get(f'/data/plugin/scalars/scalars?run={run}&tag=usage/checkpoint_size_mib')
  assert sorted(step for _, step, _ in sizes) == [2, 3], sizes  # one per save
  for _, step, mib in sizes:
    directory = os.path.join(checkpoints, f'ckpt-{step}')
    on_disk = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    assert mib == pytest.approx(on_disk / 2**20, rel=0.06)
    assert float(f'{mib:.2g}') == pytest.approx(mib, rel=1e-6), mib
  # Both scalar dashboards open the first two tag groups (tf-scalar-dashboard's
  # _shouldOpen(index) <= 2 after its search group; Time Series expands two),
  # in TensorBoard's tag order: train and eval must be those two.
  tags = board.get('/data/plugin/scalars/tags')[run]
  groups = list(dict.fromkeys(tag.split('/')[0] for tag in sorted(tags)))
  assert groups[:2] == ['eval', 'train'], groups
  assert 'checkpoint' not in groups and 'usage' in groups


def test_hparams_trial_ids_tell_the_trials_apart_within_the_column(board):
  body = {'experimentName': '', 'startIndex': 0, 'sliceSize': 10,
          'colParams': [{'hparam': 'mesh.shape', 'includeInResult': True}],
          'allowedStatuses': ['STATUS_UNKNOWN', 'STATUS_SUCCESS', 'STATUS_FAILURE',
                              'STATUS_RUNNING']}

  def session_groups():
    listed = board.fetch('/data/plugin/hparams/session_groups', body)[1]['sessionGroups']
    return listed if len(listed) == 2 else None

  groups = board.wait_until('both trials', session_groups)
  shown = {g['sessions'][0]['name']: g['name'] for g in groups}  # run -> trial id
  assert set(shown) == {run_of(board, 4), run_of(board, 2)}
  # The Trial ID column is 10em wide (about 16 characters): they differ within it.
  assert len({trial_id[:12] for trial_id in shown.values()}) == 2, shown
  for model, trial in board.trials.items():
    assert f'model:{model}' in shown['sweep/' + trial['name']], shown


def test_operative_config_leaves_out_the_lm_knobs_a_named_task_never_used_and_keeps_axis_order():
  from plugins.plan import make_plan
  parse_gin(files=['configs/experiments/quickstart.gin'],
            bindings=['data.task = @markov_task()', 'markov_task.vocab_size = 32'])
  named = gin_settings(make_plan().operative_config)
  assert named['data.task'] == '@markov_task()' and named['markov_task.vocab_size'] == '32'
  assert not [key for key in named if key.startswith('data.') and key != 'data.task']
  parse_gin(files=['configs/experiments/quickstart.gin'],
            bindings=["mesh.shape = {'model': 2, 'data': 4}"])
  built_in = gin_settings(make_plan().operative_config)
  assert built_in['data.vocab_size'] == '64' and built_in['data.task'] == 'None'
  # Axis order is the mesh: gin's pprint would sort it to {'data': 4, 'model': 2}.
  assert built_in['mesh.shape'] == "{'model': 2, 'data': 4}"


# -- the page, drawn by a real Chromium --------------------------------------------
def chromium(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
  binary = shutil.which('chromium') or shutil.which('chromium-browser')
  assert binary, ('Chromium is needed to check the Mesh tab: apt-get install -y chromium '
                  "(the README's test command installs it)")
  os.makedirs(ARTIFACTS, exist_ok=True)
  profile = os.path.join(ARTIFACTS, '.chromium-profile')
  result = subprocess.run(
      [binary, '--headless', '--no-sandbox', '--disable-gpu', '--no-first-run',
       '--hide-scrollbars', f'--user-data-dir={profile}', '--window-size=1400,1000',
       '--virtual-time-budget=15000', *args], capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, result.stderr[-2000:]
  return result


def chromium_dom(board, **query) -> str:
  """The plugin page's DOM after its scripts ran."""
  url = (f'{board.url}/data/plugin_entry.html?name=meshgin&'
         + urllib.parse.urlencode(query))
  return chromium('--dump-dom', url).stdout


class DeviceCells(html.parser.HTMLParser):
  """The grid's device cells (<g class="device" data-...>) of a dumped DOM."""

  def __init__(self, dom):
    super().__init__()
    self.cells = {}
    self.feed(dom)

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if tag == 'g' and attrs.get('class') == 'device':
      self.cells[int(attrs['data-device'])] = attrs


def slice_attribute(index) -> str:
  return ', '.join(f'{start}:{stop}' for start, stop in index)


def test_chromium_draws_one_cell_per_device_and_marks_the_selected_slices(board, devices8):
  run = run_of(board, 4)
  dom = chromium_dom(board, run=run, variable=SELECTED)
  assert 'data-state="ready"' in dom, dom[-2000:]
  cells = DeviceCells(dom).cells
  assert sorted(cells) == list(range(8))
  mesh = dtensor_mesh(mesh_shape(board, run))
  shards = dtensor_shards([64, 256], ['unsharded', 'model'], mesh)  # layouts.txt's w_in
  for device_id, cell in cells.items():
    assert cell['data-holds'] == '1'
    assert cell['data-slice'] == slice_attribute(index_of(shards[f'CPU:{device_id}'],
                                                          [64, 256])), cell
    assert cell['data-replicas'] == '2'  # data=2: each slice twice
  # Pipelined on 2 clients: the softmax lives on the last stage's sub-mesh only.
  dom = chromium_dom(board, run='pipeline', variable='lm/softmax/w')
  cells = DeviceCells(dom).cells
  assert {i for i, c in cells.items() if c['data-holds'] == '1'} == set(stage_devices(board)[1])
  assert {c['data-stage'] for c in cells.values()} == {'0', '1'}
  assert {c['data-client'] for c in cells.values()} == {'0', '1'}
  # TensorBoard's own page with the tab open, as a screenshot (README: docs/mesh_tab.png).
  path = os.path.join(ARTIFACTS, 'mesh_tab.png')
  if os.path.exists(path):
    os.remove(path)
  chromium(f'--screenshot={path}', f'{board.url}/?mesh_run=pipeline&'
           f'mesh_variable=lm/stack/block_001/ffn/w_in#meshgin')
  with open(path, 'rb') as f:
    png = f.read()
  assert png[:8] == b'\x89PNG\r\n\x1a\n' and struct.unpack('>II', png[16:24]) == (1400, 1000)
  assert len(png) > 50_000  # drawn, not a blank page


def test_an_fsdp_run_shows_where_each_slice_is_stored_and_the_layout_at_use(board, devices8):
  """The quickstart with `train.fsdp = True`: every variable stored split
  over 'data' (1/8 of its bytes on each device, the slices where DTensor puts
  that layout) and gathered to its rule's layout, replicated, at use; the
  page's legend and variable table say both."""
  doc = board.mesh('fsdp')
  rows = {r['path']: r for r in layouts_txt(os.path.join(board.root, 'fsdp'))}
  total = sum(v['bytes_total'] for v in doc['variables'])
  assert total == 447_744 and len(doc['variables']) == len(rows) == 30
  assert [d['bytes']['parameters'] for d in doc['devices']] == [total // 8] * 8
  mesh = dtensor_mesh({'data': 8})
  for v in doc['variables']:
    row, shape = rows[v['path']], v['shape']
    assert 'data' in v['spec'] and row['sharding'] == ', '.join(v['spec']), v['path']
    assert v['use_spec'] == ['unsharded'] * len(shape), v['path']
    assert row['sharding at use'] == ', '.join(v['use_spec']), v['path']
    assert v['bytes_per_device'] == v['bytes_total'] // 8, v['path']
    holders = {f'CPU:{i}': p['index'] for p in v['slices'] for i in p['devices']}
    assert holders == {device: index_of(shard, shape) for device, shard in
                       dtensor_shards(shape, v['spec'], mesh).items()}, v['path']
  path = 'lm/stack/block_000/attn/wq'  # 64x4x16: rows 8k..8k+7 on device k
  dom = chromium_dom(board, run='fsdp', variable=path)
  assert 'data-state="ready"' in dom, dom[-2000:]
  assert (f'{path} stored (data, unsharded, unsharded), gathered at use to '
          '(unsharded, unsharded, unsharded) (16.0 KiB/device)') in dom
  assert '<th class="">sharding at use</th>' in dom
  cells = DeviceCells(dom).cells
  assert [(cells[k]['data-slice'], cells[k]['data-replicas']) for k in range(8)] == [
      (f'{8 * k}:{8 * k + 8}, 0:4, 0:16', '1') for k in range(8)]


def test_ci_runs_the_readme_test_command_which_brings_chromium_slurm_and_jemalloc():
  with open(os.path.join(REPO_ROOT, 'README.md')) as f:
    readme = f.read()
  command = re.search(r'\*\*2\. Test\*\*.*?```sh\n(.*?)\n```', readme, re.S).group(1)
  with open(os.path.join(REPO_ROOT, '.ci', 'run')) as f:
    assert f.read().rstrip('\n').splitlines()[-1] == command
  install = command.split(' && python3 -m venv')[0]
  assert install.startswith('(command -v chromium >/dev/null && command -v slurmctld')
  assert 'apt-get install -y -qq chromium slurm-wlm munge libjemalloc2' in install
  assert 'ldconfig -p | grep libjemalloc >/dev/null ||' in install  # installed when it is missing
