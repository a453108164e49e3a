r"""Dry-run a config: every variable's layout and the memory per device.

  python -m launch.inspect --gin_file=configs/experiments/lm_2d.gin

Resolves the model's variables from the Params tree (nothing is allocated and
no device is touched, so a 100B-parameter model inspects in seconds), applies
the layout rules, and prints the layout table, how many variables each rule
matched, and the memory estimate (parameters, optimizer state, gradients,
activations; per device, in total, and whether it fits mesh.device_memory_gb). It checks
the config exactly as `launch.train` does before training (the same typed
plan), so it rejects the same configs, with the same exit 2 and message; only
what needs the machine itself (enough devices, an existing checkpoint) is
left to `launch.train`.

  python -m launch.inspect --gin_file=configs/models/lm_small.gin --suggest \
      --devices=8 --memory_gb=2 [--measure] [--suggest_gin=chosen.gin]

With --suggest it chooses the layout instead (docs/choosing-a-layout.md):
every way to use --devices devices (data, FSDP, ZeRO-1, a model axis with the
model's tensor rules, both pipeline engines) with the settings that trade
speed for memory (bf16, remat, accumulation, micro-batches), planned as
launch.train plans them; those whose memory estimate does not fit the budget
are dropped; the rest are ranked by a cost model. Its rates come from
--calibration, by default bench/results/calibration.json of the checkout (the
development machine's until `python bench/calibrate.py` measures this one); an
installed wheel has no bench/ and uses nominal rates
(docs/choosing-a-layout.md#where-the-rates-come-from). It prints the top
--top_k as gin bindings (and writes them as JSON to --suggest_json, when
given: by default no file is written). --measure then
trains each for a few steps (one process each) and ranks them by measured
speed and peak memory. A model that fits nowhere exits 2 with the smallest
budget that would fit it.
"""

from __future__ import annotations

if __name__ == '__main__':  # first, before the imports below take their time
  import launch
  launch.install_start_up_handlers()

from absl import app, flags


from launch import gin_flags

flags.adopt_module_key_flags(gin_flags)

MAX_ROWS = flags.DEFINE_integer(
    'max_rows', 200, 'Print at most this many rows of the layout table (0: all).')
SUGGEST = flags.DEFINE_bool(
    'suggest', False, 'Suggest layouts for this model instead: the fastest that fit the '
    'memory budget, predicted (see the module help).')
DEVICES = flags.DEFINE_integer(
    'devices', 0, '--suggest: devices to lay the model out on (0: the config\'s mesh size).',
    lower_bound=0)
HOSTS = flags.DEFINE_integer(
    'hosts', 1, '--suggest: hosts the devices are spread over, evenly; collectives over an '
    'axis that spans hosts cost the cross-host rate.', lower_bound=1)
MEMORY_GB = flags.DEFINE_float(
    'memory_gb', None, '--suggest: the budget in GiB, per process on CPU (one process holds '
    'its host\'s devices), per device elsewhere. Default: mesh.device_memory_gb (on CPU '
    'times the devices per process), else on CPU this machine\'s memory.')
TOP_K = flags.DEFINE_integer('top_k', 5, '--suggest: how many layouts to print and write.')
SUGGEST_JSON = flags.DEFINE_string(
    'suggest_json', '', '--suggest: also write the top --top_k, with every cost term and '
    'memory category, as JSON to this file (default \'\': no file).')
SUGGEST_GIN = flags.DEFINE_string(
    'suggest_gin', '', '--suggest: write the best layout (measured best with --measure) as a '
    '.gin file that launch.train takes.')
MEASURE = flags.DEFINE_bool(
    'measure', False, '--suggest: train each of the top --top_k for --measure_steps steps '
    '(one process each, on this machine) and rank them by measured step time and peak.')
MEASURE_STEPS = flags.DEFINE_integer(
    'measure_steps', 8, '--measure: steps per layout; the first 3 are not timed.')
CALIBRATION = flags.DEFINE_string(
    'calibration', '', '--suggest: the rates file (default: bench/results/calibration.json).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')

  def body(watcher):
    del watcher
    from plugins import plan, report  # pylint: disable=g-import-not-at-top
    with gin_flags.parsed_config():
      base = plan.make_plan()
    if not SUGGEST.value:
      print(report.describe_plan(base, max_rows=MAX_ROWS.value))
      return
    from plugins.suggest import run  # pylint: disable=g-import-not-at-top
    run.suggest(base, files=gin_flags.GIN_FILES.value, bindings=gin_flags.GIN_BINDINGS.value,
                search_paths=gin_flags.GIN_SEARCH_PATHS.value, devices=DEVICES.value,
                hosts=HOSTS.value, memory_gb=MEMORY_GB.value, top_k=TOP_K.value,
                json_path=SUGGEST_JSON.value, gin_path=SUGGEST_GIN.value,
                measure=MEASURE.value, measure_steps=MEASURE_STEPS.value,
                calibration=CALIBRATION.value or None,
                env=gin_flags.environment_for_children())

  gin_flags.run_guarded(body)


if __name__ == '__main__':
  app.run(main, flags_parser=launch.parse_flags)
