r"""Dry-run a config: every variable's layout and the memory per device.

  python -m launch.inspect --gin_file=configs/experiments/lm_2d.gin

Resolves the model's variables from the Params tree (nothing is allocated and
no device is touched, so a 100B-parameter model inspects in seconds), applies
the layout rules, and prints the layout table, how many variables each rule
matched, and per-device bytes for parameters and Adam's two slots. Exit 2 with
a one-paragraph message on a configuration error (e.g. a rule that does not
fit a variable).
"""

from __future__ import annotations

from absl import app, flags

from launch import gin_flags

flags.adopt_module_key_flags(gin_flags)

MAX_ROWS = flags.DEFINE_integer(
    'max_rows', 200, 'Print at most this many rows of the layout table (0: all).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')

  def body():
    from plugins import gin_setup, run  # pylint: disable=g-import-not-at-top
    gin_setup.parse_gin(files=gin_flags.GIN_FILES.value,
                        bindings=gin_flags.GIN_BINDINGS.value,
                        search_paths=gin_flags.GIN_SEARCH_PATHS.value)
    print(run.describe_plan(run.plan_run(), max_rows=MAX_ROWS.value))

  gin_flags.run_guarded(body)


if __name__ == '__main__':
  app.run(main)
