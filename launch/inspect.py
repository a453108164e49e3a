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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')

  def body(watcher):
    del watcher
    from plugins import plan, report  # pylint: disable=g-import-not-at-top
    with gin_flags.parsed_config():
      print(report.describe_plan(plan.make_plan(), max_rows=MAX_ROWS.value))

  gin_flags.run_guarded(body)


if __name__ == '__main__':
  app.run(main)
