r"""Sweep gin bindings: one `launch.train` run per trial, compared in TensorBoard.

  python -m launch.sweep --gin_file=configs/experiments/quickstart.gin \
      --gin_bindings='train.num_steps = 100' \
      --sweep='optimizer.learning_rate=[3e-3, 1e-3, 3e-4]' \
      --sweep='data.branching=[2, 4]' --model_dir=/tmp/sweep --parallel=2
  tensorboard --logdir /tmp/sweep      # the HPARAMS tab compares the trials

Each trial trains in `--model_dir/<trial-name>` (named from its swept values).
Running the same command again skips the trials that succeeded, retries the
failed ones and continues interrupted ones from their checkpoints. --verbose
is passed on: the trials then show TensorFlow's own log lines in their
trial.log; without it each trial keeps them out, as launch.train does.
Exit status: 0 every trial succeeded; 1 some trial failed (see the table and
sweep.tsv); 2 the sweep itself is misconfigured; 4 interrupted by a signal
(run the same command to continue).
"""

from __future__ import annotations

if __name__ == '__main__':  # first, before the imports below take their time
  import launch
  launch.install_start_up_handlers()

import sys

from absl import app, flags

from plugins import run_status

from launch import gin_flags

flags.adopt_module_key_flags(gin_flags)

SWEEP = flags.DEFINE_multi_string(
    'sweep', [], "One swept binding: 'key=[v1, v2, ...]' (gin values), or for "
    "--sweep_mode=random also 'key=uniform(lo, hi)', 'key=log_uniform(lo, hi)', "
    "'key=int_range(lo, hi)'. Repeat for more axes.")
SWEEP_FILE = flags.DEFINE_string(
    'sweep_file', None, 'A file of sweep flags, one "flag = value" per line without '
    'the leading --, e.g. "sweep = optimizer.learning_rate = [1e-3, 3e-4]". '
    'Command-line flags add to its lists and override its settings.')
SWEEP_MODE = flags.DEFINE_enum(
    'sweep_mode', 'product', ['product', 'zip', 'random'],
    'product: every combination; zip: the i-th value of every axis; random: '
    '--num_trials draws with --seed.')
NUM_TRIALS = flags.DEFINE_integer(
    'num_trials', 0, 'random: how many trials to draw; product/zip: run only the '
    'first N trials (0: all).')
SEED = flags.DEFINE_integer('seed', 0, 'Random search seed (same seed, same trials).')
MODEL_DIR = flags.DEFINE_string(
    'model_dir', '/tmp/meshgin/sweep', 'Sweep root: one directory per trial, plus '
    'sweep.json, sweep.tsv and the HParams experiment config.')
PARALLEL = flags.DEFINE_integer(
    'parallel', 1, 'Trials run at once; the CPU threads are divided between them.')
TRIAL_TIMEOUT = flags.DEFINE_float(
    'trial_timeout', 0, 'Seconds a trial may run before it is stopped (it saves a '
    'checkpoint) and recorded as failed; 0: no limit.')



def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  outcome = {}

  def body(watcher):
    del watcher  # the runner forwards stop signals to its trials itself
    # pylint: disable=g-import-not-at-top
    from plugins import sweep as sweep_lib
    from plugins.sweep import spec as sweep_spec
    values = {'gin_file': list(gin_flags.GIN_FILES.value),
              'gin_bindings': list(gin_flags.GIN_BINDINGS.value),
              'sweep': list(SWEEP.value), 'sweep_mode': SWEEP_MODE.value,
              'num_trials': NUM_TRIALS.value, 'seed': SEED.value,
              'parallel': PARALLEL.value, 'trial_timeout': TRIAL_TIMEOUT.value}
    if SWEEP_FILE.value:
      from_file = sweep_spec.read_sweep_file(SWEEP_FILE.value)
      for name in sweep_spec.SweepFile.LIST_FIELDS:
        values[name] = getattr(from_file, name) + values[name]
      for name, text in from_file.settings.items():
        if not flags.FLAGS[name].present:  # the command line wins
          values[name] = _parse(name, text)
    sweep = sweep_lib.Sweep(
        root=MODEL_DIR.value, gin_files=values['gin_file'],
        gin_bindings=values['gin_bindings'],
        gin_search_paths=list(gin_flags.GIN_SEARCH_PATHS.value),
        axes=[sweep_spec.parse_axis(spec) for spec in values['sweep']],
        mode=values['sweep_mode'], num_trials=values['num_trials'], seed=values['seed'],
        train_flags=['--verbose'] if gin_flags.VERBOSE.value else [])
    # Trials get the environment as the user gave it: each quiets its own
    # console unless --verbose, never by this process's setting.
    runner = sweep_lib.SweepRunner(sweep, parallel=values['parallel'],
                                   trial_timeout=values['trial_timeout'],
                                   command_line=sys.argv,
                                   environment=gin_flags.environment_for_children())
    records = runner.run()
    outcome['interrupted'] = runner.stop_signal is not None
    outcome['failed'] = any(r['status'] != sweep_lib.SUCCESS for r in records)

  gin_flags.run_guarded(body)
  if outcome.get('interrupted'):
    sys.exit(run_status.EXIT_SWEEP_INTERRUPTED)
  sys.exit(run_status.EXIT_SWEEP_FAILED if outcome.get('failed') else run_status.EXIT_OK)


def _parse(name: str, text: str):
  """A sweep-file setting through its flag's own parser (same checks as the flag)."""
  from layout_core.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    return flags.FLAGS[name]._parse(text)  # pylint: disable=protected-access
  except (ValueError, flags.IllegalFlagValueError) as e:
    raise ConfigError(f'{name} = {text!r} in the sweep file: {e}',
                      where=f'--sweep_file={SWEEP_FILE.value}',
                      fix=f'see python -m launch.sweep --helpfull for --{name}') from e


if __name__ == '__main__':
  app.run(main)
