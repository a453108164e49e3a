"""launch.inspect --suggest: candidates that launch.train plans the same, a cost
model checked against independent counts, the exit-2 paths, and --measure."""

import dataclasses
import json
import math
import os
import re

import pytest

from layout_core.model import moe
from layout_core.model.base import leaf_layers, num_parameters
from layout_core.model.layers import TransformerBlock
from layout_core.suggest import space
from layout_core.suggest.calibration import (Collective, Rates, load_margins, load_rates,
                                             machine_facts)
from layout_core.suggest.cost import ModelProfile, predict_step
from layout_core.train import memory
from plugins import gin_setup, plan as plan_lib
from plugins.suggest.planner import Suggester, predict_plan
from tests.conftest import REPO_ROOT, run_module, run_modules

SMALL = ['configs/runs/train.gin', 'configs/models/lm_small.gin']


def base_plan(files=SMALL, bindings=()):
  with gin_setup.parsed_config(files=list(files), bindings=list(bindings), search_paths=[]):
    return plan_lib.make_plan()


@pytest.fixture(scope='module')
def small_search():
  """lm_small on 8 devices in 2 GiB, no margins: every family ranked."""
  suggester = Suggester.from_plan(base_plan(), num_devices=8, memory_gb=2, margins=({}, 0.0))
  return suggester, suggester.run()


def test_every_suggestion_plans_through_gin_exactly_as_the_search_planned_it(small_search):
  """The bindings printed for each candidate, on the user's config, give
  launch.train's plan (make_plan via gin) the memory and predicted time
  the search computed by replacing the plan's parts."""
  suggester, result = small_search
  assert len(result.ranked) >= 20  # data, FSDP, ZeRO-1, model axes, both pipelines
  kinds = {(e.candidate.layout.engine, e.candidate.layout.state) for e in result.ranked}
  assert {('', 'replicated'), ('', 'fsdp'), ('', 'zero1'), ('submesh', 'replicated'),
          ('spmd', 'replicated')} <= kinds
  for e in result.ranked:
    plan = base_plan(bindings=suggester.bindings(e.candidate))
    estimate = memory.estimate_memory(
        records=plan.records, params=plan.params,
        input_shapes=[s for s, _ in plan.task.input_specs(
            plan.train.batch_size // plan.train.grad_accum_steps)],
        config=plan.train, optimizer=plan.optimizer, mesh_axes=plan.mesh_spec.shape,
        pipeline=plan.pipeline, stage_axis=plan.pipeline_config.stage_axis)
    assert estimate.process_peak(1) == e.need, e.candidate.describe()
    assert dict(plan.mesh_spec.shape) == e.candidate.layout.mesh_shape
    cost = predict_step(ModelProfile.of(plan.params, input_shapes=[(32, 64)]),
                        records=plan.records, mesh_axes=plan.mesh_spec.shape,
                        config=plan.train, optimizer=plan.optimizer, rates=suggester.rates,
                        pipeline=plan.pipeline, remat_of=memory.remat_leaves(plan.params,
                                                                             plan.train),
                        fsdp_axis=estimate.fsdp_axis, state_axis=estimate.state_axis)
    assert cost.seconds == pytest.approx(e.seconds, rel=1e-9), e.candidate.describe()


def test_each_layout_keeps_the_fastest_settings_that_fit(small_search):
  """Brute force over every settings combination of the top layouts: none
  that fits is predicted faster than the one kept, and the kept one fits."""
  suggester, result = small_search
  for kept in result.ranked[:3]:
    layout = kept.candidate.layout
    assert suggester.budget.fits(kept.need, layout)
    for ladder in suggester.ladders(layout):
      for settings in ladder:
        e = suggester.evaluate(space.Candidate(layout, settings))
        if suggester.budget.fits(e.need, layout):
          assert e.seconds >= kept.seconds - 1e-12, (settings, kept.candidate)


def flat_rates(**changes) -> Rates:
  """Rates that turn the cost model into a counter: 1 FLOP/s, free rest."""
  free = Collective(0.0, float('inf'))
  base = dict(device_type='CPU', matmul={'float32': [(1.0, 1.0)]},
              elementwise={'float32': float('inf')},
              collectives={'all_reduce': {2: free}, 'all_gather': {2: free}},
              cross_host=free, block_device_s={'plain': 0.0, 'submesh': 0.0, 'spmd': 0.0},
              step_s=0.0, tensor_s={2: 0.0}, spmd_tick_s=0.0, fsdp_variable_s=0.0,
              zero_variable_s=0.0, devices_share_cores=False)
  return Rates(**{**base, **changes})


def predict(plan, rates, state_axis=None, **train):
  config = dataclasses.replace(plan.train, **train)
  profile = ModelProfile.of(plan.params, input_shapes=[(plan.train.batch_size, 64)])
  return predict_step(profile, records=plan.records, mesh_axes=plan.mesh_spec.shape,
                      config=config, optimizer=plan.optimizer, rates=rates,
                      pipeline=plan.pipeline, remat_of=memory.remat_leaves(plan.params, config),
                      state_axis=state_axis)


def test_compute_counts_the_plans_training_flops_split_over_devices():
  """At 1 FLOP/s the predicted seconds are FLOPs: 3x the forward matmuls
  (model_flops_per_step, written independently), over the data axis, plus a
  forward for recomputed layers."""
  one = base_plan(bindings=["mesh.shape = {'data': 1}"])
  eight = base_plan()
  reference = memory.model_flops_per_step(meta=one.meta, num_parameters=one.num_parameters,
                                          tokens_per_step=0)
  assert predict(one, flat_rates()).terms['matmul'] == pytest.approx(reference)
  assert predict(eight, flat_rates()).terms['matmul'] == pytest.approx(reference / 8)
  assert predict(one, flat_rates(), remat='full').terms['matmul'] == pytest.approx(
      reference * 4 / 3)
  assert predict(one, flat_rates(), grad_accum_steps=4).terms['matmul'] == pytest.approx(
      reference)


def test_collectives_count_bytes_and_calls_by_hand():
  """At 1 byte/s a data all-reduce costs the gradient bytes of one device;
  at 1 s per call a Megatron 2 x 4 step makes 4 tensor all-reduces per
  block (2 forward, 2 backward), 2 each for the split embedding and softmax."""
  per_byte = Collective(0.0, 1.0)
  rates = flat_rates(matmul={'float32': [(1.0, float('inf'))]},
                     collectives={'all_reduce': {2: per_byte}, 'all_gather': {2: per_byte}})
  plan = base_plan()
  assert predict(plan, rates).terms['data all-reduce'] == sum(r.bytes_per_device
                                                              for r in plan.records)
  calls = flat_rates(matmul={'float32': [(1.0, float('inf'))]}, tensor_s={2: 1.0})
  megatron = base_plan(files=SMALL + ['configs/layouts/megatron.gin'],
                       bindings=["mesh.shape = {'data': 2, 'model': 4}"])
  assert predict(megatron, calls).terms['tensor all-reduce'] == 4 * 4 + 2 + 2


def test_what_zero1_and_circular_repeats_change_counts_by_hand():
  """ZeRO-1 sums the gradients as a reduce-scatter, half an all-reduce's
  bytes. With 2 circular repeats (lm_small's 4 blocks on 2 stages, 4
  micro-batches: 9 ticks of 1 cell) the SPMD engine sums a whole block's
  gradient on its own each tick, one call per block variable; the rest of
  the model's once."""
  per_byte = Collective(0.0, 1.0)
  rates = flat_rates(matmul={'float32': [(1.0, float('inf'))]},
                     collectives={'all_reduce': {2: per_byte}, 'all_gather': {2: per_byte}})
  plan = base_plan()
  model_bytes = 4 * plan.num_parameters  # float32, whole on every device of data=8
  assert predict(plan, rates).terms['data all-reduce'] == model_bytes
  assert predict(plan, rates, state_axis='data').terms['data all-reduce'] == model_bytes / 2
  circular = base_plan(bindings=["mesh.shape = {'stage': 2, 'data': 4}",
                                 'pipeline.num_stages = 2', "pipeline.engine = 'spmd'",
                                 'pipeline.num_micro_batches = 4', 'pipeline.circular_repeats = 2'])
  block = next(p for _, p in leaf_layers(circular.params) if p.cls is TransformerBlock)
  block_bytes = 4 * num_parameters(block)
  terms = predict(circular, rates).terms
  assert terms['SPMD per-tick sums'] == pytest.approx(9 * block_bytes)
  assert terms['data all-reduce'] == pytest.approx(model_bytes - 4 * block_bytes)
  per_call = flat_rates(matmul={'float32': [(1.0, float('inf'))]},
                        collectives={'all_reduce': {2: Collective(1.0, float('inf'))},
                                     'all_gather': {2: Collective(1.0, float('inf'))}})
  assert predict(circular, per_call).terms['SPMD per-tick sums'] == 9 * len(
      block.cls.variable_specs(block))


def test_fsdp_gathers_again_only_the_weights_remat_recomputes():
  """At 1 s per FSDP variable gather: with no remat each split weight is
  gathered once per step; remat = 'block' gathers again, in the backward,
  only the weights of the blocks it recomputes (not the embedding, the
  final norm or the softmax); 'full' recomputes every layer."""
  from plugins.suggest.planner import predict_plan  # pylint: disable=import-outside-toplevel
  plan = base_plan(bindings=['train.fsdp = True'])
  split = [r for r in plan.records if r.use_spec is not None]
  in_blocks = [r for r in split if re.search(r'/block_\d+/', r.path)]
  assert len(split) == len(plan.records) and 0 < len(in_blocks) < len(split)
  rates = flat_rates(fsdp_variable_s=1.0)

  def gathers(remat):
    return predict_plan(plan, rates=rates, train=dataclasses.replace(plan.train, remat=remat)
                        ).terms['FSDP fixed']
  assert gathers('none') == len(split)
  assert gathers('block') == len(split) + len(in_blocks)
  assert gathers('full') == 2 * len(split)


def test_an_axis_spans_hosts_where_its_device_blocks_do_not_tile_a_host():
  """Devices in mesh order, a contiguous block per host: model=4 on 12
  devices over 2 hosts groups devices 4-7, across hosts 0 and 1, so the
  suggester offers no such axis and the cost model would price it at the
  cross-host rate."""
  from layout_core.suggest.facts import _spanning_axes  # pylint: disable=import-outside-toplevel
  assert _spanning_axes({'data': 3, 'model': 4}, hosts=2) == {'data', 'model'}
  assert _spanning_axes({'data': 3, 'model': 2}, hosts=2) == {'data', 'model'}  # 2-3
  assert _spanning_axes({'data': 2, 'model': 3}, hosts=2) == {'data'}
  assert _spanning_axes({'data': 4, 'model': 4}, hosts=2) == {'data'}
  assert _spanning_axes({'data': 2, 'model': 4}, hosts=1) == set()
  quickstart = base_plan(files=['configs/experiments/quickstart.gin'])
  models = {layout.model for layout in Suggester.from_plan(
      quickstart, num_devices=12, hosts=2, memory_gb=4, margins=({}, 0.0)).layouts()}
  assert models == {1, 2}  # 4 heads: 1, 2 and 4 divide them; 4 does not tile 6 devices


def test_the_calibration_gives_back_every_run_it_was_fitted_to():
  """bench/calibrate.py fits each rate as the residual of the suggester's
  own prediction (`predict_plan`): predicting each measured run from the
  shipped file gives its measured step time back, within the fit's error,
  which is small: no rate fitted by hand-written equations that leave out
  a term the cost model then adds (the SPMD per-tick sums were counted
  twice, a 2x prediction of the run they were fitted on)."""
  from bench import calibrate  # pylint: disable=import-outside-toplevel
  with open(os.path.join(REPO_ROOT, 'bench/results/calibration.json')) as f:
    data = json.load(f)
  runs = {run.label: run for run in calibrate.runs_for(data.get('wide_dtype', 'bfloat16'))}
  assert [r['label'] for r in data['runs']] == list(runs)
  assert data['fit_error'] <= 0.05
  for recorded in data['runs']:
    run = runs[recorded['label']]
    assert recorded['bindings'] == list(run.bindings)
    predicted = calibrate.predict(run, data)
    error = predicted / recorded['measured_s'] - 1
    assert abs(error) <= data['fit_error'] + 1e-9, (run.label, predicted, recorded)


def test_the_calibration_fits_its_larger_runs_in_either_dtype():
  """The larger model's runs train in the dtype whose one-device step was
  faster (float32 with AVX2 alone, where bfloat16 took 13x as long). Every
  collective scale moves their prediction in either dtype: FSDP's scaled
  only its narrow (bfloat16) gathers once, and a float32 calibration's fit
  was a singular solve."""
  from bench import calibrate  # pylint: disable=import-outside-toplevel
  with open(os.path.join(REPO_ROOT, 'bench/results/calibration.json')) as f:
    data = json.load(f)
  seconds = {r['label']: r['measured_s'] for r in data.pop('runs')}
  for dtype in ('float32', 'bfloat16'):  # the other's seconds: a solve, not a fit
    fitted = calibrate.fit(dict(data, wide_dtype=dtype), seconds)
    wide = {r['label']: r for r in fitted['runs']}
    assert f"train.compute_dtype = '{dtype}'" in wide['fsdp']['bindings']
    if dtype == data['wide_dtype']:
      for label in ('data', 'fsdp', 'zero1'):  # each fitted by its own scale
        assert abs(wide[label]['error']) <= 0.05, wide[label]
  assert calibrate.faster_dtype({'data=1, float32': 2.3, 'data=1, bfloat16': 20.0}) == 'float32'
  assert calibrate.faster_dtype({'data=1, float32': 0.49, 'data=1, bfloat16': 0.29}) == 'bfloat16'


def test_a_calibration_file_that_is_missing_or_not_one_is_a_config_error(tmp_path):
  from layout_core.errors import ConfigError  # pylint: disable=import-outside-toplevel
  missing = str(tmp_path / 'nope.json')
  with pytest.raises(ConfigError, match=rf"calibration file '{re.escape(missing)}' cannot be "
                                        r'read: no such file.*--calibration'):
    load_rates(device_type='CPU', path=missing)
  for name, text in (('cut.json', '{"device_type": "CPU", "matmul'), ('list.json', '[1, 2]'),
                     ('partial.json', '{"device_type": "CPU", "matmul": {}}')):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=rf"calibration file '.*{name}' cannot be read"):
      load_rates(device_type='CPU', path=str(tmp_path / name))
  shown = run_module('launch.inspect', *[f'--gin_file={f}' for f in SMALL], '--suggest',
                     f'--calibration={missing}', '--suggest_json=')
  assert shown.returncode == 2 and f"'{missing}' cannot be read" in shown.stderr, (
      shown.stderr[-2000:])
  assert 'Traceback' not in shown.stderr


def test_a_tensor_split_repeats_the_residual_streams_elementwise_work():
  """At 1 FLOP/s elementwise: data=8 splits all elementwise work 8 ways;
  model=8 (Megatron) all but the residual stream's, which every device of
  the split repeats: per block 2 layer norms (7 per element), 2 residual
  adds and the FFN's output bias, and the final layer norm, on the
  [32, 64, 256] stream, forward and backward (3 passes)."""
  rates = flat_rates(matmul={'float32': [(1.0, float('inf'))]}, elementwise={'float32': 1.0})
  data = predict(base_plan(), rates).terms['elementwise']
  model = predict(base_plan(files=SMALL + ['configs/layouts/megatron.gin'],
                            bindings=["mesh.shape = {'data': 1, 'model': 8}"]),
                  rates).terms['elementwise']
  stream = 3 * (4 * (2 * 7 + 3) + 7) * 32 * 64 * 256
  assert model - data == pytest.approx(stream * (1 - 1 / 8))


def test_pipeline_bubble_on_devices_of_their_own():
  """GPipe with S stages and M micro-batches takes (M + S - 1) / M of its
  busiest stage's time on devices of their own; none on shared cores (the
  sub-mesh engine's idle stages give their cores away)."""
  pipelined = base_plan(bindings=["mesh.shape = {'stage': 2, 'data': 4}",
                                  'pipeline.num_stages = 2', 'pipeline.num_micro_batches = 4'])
  own = predict(pipelined, flat_rates())
  assert own.terms['pipeline bubble'] == pytest.approx(own.terms['matmul'] * (2 - 1) / 4,
                                                       rel=1e-6)
  shared = predict(pipelined, flat_rates(devices_share_cores=True))
  assert shared.terms['pipeline bubble'] == 0.0


def test_rates_say_when_they_are_stale(tmp_path):
  nominal = load_rates(device_type='GPU')  # the shipped file is CPU's
  assert 'nominal' in nominal.stale_reason() and 'bench/calibrate.py' in nominal.stale_reason()
  with open(os.path.join(REPO_ROOT, 'bench/results/calibration.json')) as f:
    data = json.load(f)
  data['measured'] = {**data['measured'], 'processor': 'Another CPU 9000'}
  other = tmp_path / 'other.json'
  other.write_text(json.dumps(data))
  reason = load_rates(device_type='CPU', path=str(other)).stale_reason()
  assert 'Another CPU 9000' in reason and 'rerun' in reason
  data['measured'] = {**machine_facts(), 'date': '2020-01-01T00:00:00+00:00'}
  other.write_text(json.dumps(data))
  assert 'days ago' in load_rates(device_type='CPU', path=str(other)).stale_reason()


def test_margins_are_the_benchmarks_worst_errors_per_family(small_search):
  """Each family keeps free the worst under-estimate bench/suggest.py
  measured for it (from its trials, recomputed here), and every ranked
  candidate fits with its family's margin."""
  with open(os.path.join(REPO_ROOT, 'bench/results/suggest.json')) as f:
    results = json.load(f)
  worst = {}
  for rows in results['raw_candidates'].values():
    for r in rows:
      if r['measured_ok']:
        error = r['measured_peak_bytes'] / r['predicted_bytes'] - 1
        worst[r['family']] = max(worst.get(r['family'], 0.0), error)
  margins, default = load_margins()
  assert margins == {f: round(e + 0.005, 2) for f, e in sorted(worst.items())}
  assert default == max(margins.values())
  shipped = Suggester.from_plan(small_search[0].base, num_devices=8, memory_gb=2)
  assert shipped.budget.margins == margins
  ranked = shipped.run().ranked
  assert 0 < len(ranked) < len(small_search[1].ranked)  # the margins drop some
  for e in ranked:
    margin = margins.get(e.candidate.layout.family, default)
    assert e.need * (1 + margin) <= shipped.budget.limit


def test_fits_nowhere_exits_2_with_the_budget_that_would_fit(tmp_path):
  """... and, for a run with a frozen base, names storing it narrower."""
  fits_nowhere = ('launch.inspect', *[f'--gin_file={f}' for f in SMALL], '--suggest',
                  '--memory_gb=0.5', '--suggest_json=')
  small, tuned = run_modules([fits_nowhere, (*fits_nowhere, '--gin_bindings=lora.rank = 4',
                                             "--gin_bindings=lora.targets = [r'.*/attn/wq']")])
  assert small.returncode == 2, small.stderr[-2000:]
  assert 'Traceback' not in small.stderr and 'frozen_dtype' not in small.stderr
  assert tuned.returncode == 2, tuned.stderr[-2000:]
  assert "train.frozen_dtype = 'bfloat16' or 'int8'" in tuned.stderr
  need = re.search(r'give at least ([\d.]+) GiB per process', small.stderr)
  assert need, small.stderr[-2000:]
  enough = run_module('launch.inspect', *[f'--gin_file={f}' for f in SMALL], '--suggest',
                      f'--memory_gb={float(need.group(1)) + 0.01}', '--top_k=1',
                      f'--suggest_json={tmp_path / "s.json"}')
  assert enough.returncode == 0, enough.stderr[-2000:]
  assert len(json.loads((tmp_path / 's.json').read_text())['candidates']) == 1


def test_measure_writes_a_gin_file_that_launch_train_takes(tmp_path):
  """--measure trains the top layout, and the .gin it writes trains the same
  mesh and settings with launch.train."""
  chosen = tmp_path / 'chosen.gin'
  done = run_module('launch.inspect', '--gin_file=configs/experiments/quickstart.gin',
                    '--suggest', '--memory_gb=3', '--top_k=1', '--measure',
                    '--measure_steps=5', f'--suggest_gin={chosen}', '--suggest_json=',
                    timeout=400)
  assert done.returncode == 0, done.stderr[-3000:]
  measured = re.search(r'Chosen: (.*) \(measured (\d+) ms/step, peak ([\d.]+) GiB', done.stdout)
  assert measured, done.stdout[-3000:]
  assert float(measured.group(3)) <= 3.0
  text = chosen.read_text()
  mesh = re.search(r'^mesh\.shape = (.*)$', text, re.M).group(1)
  train = run_module('launch.train', f'--gin_file={chosen}', f'--model_dir={tmp_path / "run"}',
                     '--gin_bindings=train.num_steps = 2', '--gin_bindings=train.eval_every = 0',
                     '--gin_bindings=train.eval_batches = 1',
                     '--gin_bindings=checkpoint.every_steps = 0',
                     '--gin_bindings=checkpoint.save_at_end = False')
  assert train.returncode == 0, train.stderr[-3000:]
  config = (tmp_path / 'run' / 'config.gin').read_text()
  assert f'mesh.shape = {mesh}' in config
  again = run_module('launch.inspect', '--gin_file=configs/experiments/quickstart.gin',
                     '--suggest', f'--suggest_gin={chosen}', '--suggest_json=')
  assert again.returncode == 2 and 'exists' in again.stderr  # nothing overwritten


def test_what_it_cannot_suggest_for_exits_2_saying_why():
  """A Keras model (no declared FLOPs or activations) and --measure across
  hosts (it trains on this machine only) are refused with exit 2."""
  keras = run_module('launch.inspect', '--gin_search_paths=tests/fixtures',
                     '--gin_file=my_project/keras.gin', '--suggest', '--suggest_json=')
  assert keras.returncode == 2 and 'needs a Params model' in keras.stderr, keras.stderr[-2000:]
  hosts = run_module('launch.inspect', *[f'--gin_file={f}' for f in SMALL], '--suggest',
                     '--devices=8', '--hosts=2', '--measure', '--suggest_json=')
  assert hosts.returncode == 2 and 'not --hosts=2' in hosts.stderr, hosts.stderr[-2000:]
  assert 'Traceback' not in keras.stderr + hosts.stderr
  # 7 devices: the quickstart's 32 rows split no way over 7 (nor its 4 heads, nor 2 stages)
  seven = run_module('launch.inspect', '--gin_file=configs/experiments/quickstart.gin',
                     '--suggest', '--devices=7', '--suggest_json=')
  assert seven.returncode == 2, seven.stderr[-2000:]
  assert ('no layout of 7 devices can run this config: the batch of 32 rows does not split '
          '7 ways') in seven.stderr and 'Traceback' not in seven.stderr, seven.stderr[-2000:]


MOE = ['configs/runs/train.gin', 'configs/models/moe_tiny.gin']
EXPERTS_OVER = "layout_rules.rules = [(r'.*/moe/w_.*', ('{}', 'unsharded', 'unsharded'))]"


def test_a_routed_model_splits_its_experts_and_plans_each_split_through_gin():
  """For a routed model the search also splits the experts: over the
  batch's own axis (GShard) or over an `expert` axis of their own, and not
  in the SPMD pipeline, which cannot route (exit 2's reason). One candidate
  of each split, its bindings on the user's config, gives launch.train's
  plan the memory and time the search computed, the experts' weights split
  as the layout says."""
  suggester = Suggester.from_plan(base_plan(MOE), num_devices=8, memory_gb=4,
                                  margins=({}, 0.0))
  result = suggester.run()
  by_split = {}
  for e in result.ranked:
    by_split.setdefault((e.candidate.layout.experts, bool(e.candidate.layout.engine)), e)
  assert set(by_split) == {('replicated', False), ('data', False), ('expert', False),
                           ('replicated', True), ('data', True)}
  assert any('SPMD pipeline' in reason for reason in result.refused)
  for e in by_split.values():
    plan = base_plan(MOE, bindings=suggester.bindings(e.candidate))
    assert dict(plan.mesh_spec.shape) == e.candidate.layout.mesh_shape
    estimate = memory.estimate_memory(
        records=plan.records, params=plan.params,
        input_shapes=[s for s, _ in plan.task.input_specs(plan.train.batch_size)],
        config=plan.train, optimizer=plan.optimizer, mesh_axes=plan.mesh_spec.shape,
        pipeline=plan.pipeline, stage_axis=plan.pipeline_config.stage_axis)
    assert estimate.process_peak(1) == e.need, e.candidate.describe()
    assert predict_plan(plan, rates=suggester.rates).seconds == pytest.approx(e.seconds)
    experts = [r for r in plan.records if '/moe/w_' in r.path]
    assert experts and {r.compute_spec[0] for r in experts} == {
        e.candidate.layout.expert_axis or 'unsharded'}, e.candidate.describe()


def test_the_expert_exchange_counts_bytes_and_calls_by_hand():
  """At 1 byte/s, experts on the batch's own axis move a device's share of
  each routed block's [rows, E, C, D] buffer 4 times (there and back,
  forward and backward; 6 recomputed); on an axis of their own the block's
  output is summed over it twice (the combine and its gradient); replicated,
  nothing moves. At 1 FLOP/s the experts' matmuls run over every slot of
  the buffer, split over the expert axis and the batch's."""
  per_byte = Collective(0.0, 1.0)
  rates = flat_rates(collectives={kind: {2: per_byte}
                                  for kind in ('all_reduce', 'all_gather', 'all_to_all')})
  replicated = base_plan(MOE)
  layer = moe.routed_layers(replicated.params)[0]
  blocks = len(moe.routed_layers(replicated.params))
  rows, length, width = replicated.train.batch_size, 64, layer.input_dim
  buffer = rows * layer.num_experts * length * width  # capacity_factor 0: C = S
  gshard = base_plan(MOE, bindings=[EXPERTS_OVER.format('data')])
  assert predict(gshard, rates).terms['expert exchange'] == pytest.approx(
      blocks * 4 * buffer / 8 * 4)
  assert predict(gshard, rates, remat='full').terms['expert exchange'] == pytest.approx(
      blocks * 6 * buffer / 8 * 4)
  own = base_plan(MOE, bindings=[EXPERTS_OVER.format('expert'),
                                 "mesh.shape = {'expert': 4, 'data': 2}"])
  assert predict(own, rates).terms['expert exchange'] == pytest.approx(
      blocks * 2 * rows * length * width / 2 * 4)
  assert predict(replicated, rates).terms['expert exchange'] == 0
  # the experts' matmuls as executed: every slot through SwiGLU's 3 matrices,
  # forward and backward, split over both axes; the dispatch and combine
  # einsums on the rows; both at the calibrated share of the matmul rate;
  # the rest of the block split over the batch alone
  one = predict(base_plan(MOE, bindings=["mesh.shape = {'data': 1}"]), flat_rates())
  experts = 3 * 2 * buffer * layer.hidden_dim * 3 * blocks
  route = 3 * 2 * 2 * buffer * length * blocks
  rest = one.terms['matmul'] - experts - route
  for share in (1.0, 2.0):
    assert predict(own, flat_rates(moe_matmul_share=share)).terms['matmul'] == pytest.approx(
        rest / 2 + (experts / 8 + route / 2) / share)
  assert predict(gshard, flat_rates()).terms['matmul'] == pytest.approx(
      one.terms['matmul'] / 8)
  # experts on the batch axis: each device's gradients are its own, not summed
  whole = sum(r.bytes_per_device for r in gshard.records)
  split = sum(r.bytes_per_device for r in gshard.records if '/moe/w_' in r.path)
  assert predict(gshard, rates).terms['data all-reduce'] == whole - split > 0
