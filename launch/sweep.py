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

On a Slurm cluster, --launcher=slurm submits each trial as its own sbatch job
(`srun python -m launch.train ... --cluster=slurm`, output appended to the
trial's trial.log) and watches the jobs with squeue; everything else is as
above (plugins/sweep/slurm.py says why one sbatch job per trial):

  python -m launch.sweep ... --launcher=slurm --slurm_partition=gpu \
      --slurm_tasks=2 --slurm_sbatch_arg=--gres=gpu:4 --parallel=8

A stop signal cancels queued jobs and sends running ones SIGTERM (they save);
--slurm_on_stop=leave exits at once and leaves them to Slurm, and the same
command later watches them again instead of submitting them twice.

Exit status: 0 every trial succeeded; 1 some trial failed (see the table and
sweep.tsv); 2 the sweep itself is misconfigured (also: Slurm's commands are
missing, or Slurm refuses the job options); 4 interrupted by a signal (run the
same command to continue).
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
    'model_dir', None, 'Required. The sweep\'s root: one directory per trial, plus '
    'sweep.json, sweep.tsv and the HParams experiment config; the root of an earlier '
    'sweep resumes it.')
PARALLEL = flags.DEFINE_integer(
    'parallel', 1, 'Trials run at once; the CPU threads are divided between them.')
TRIAL_TIMEOUT = flags.DEFINE_float(
    'trial_timeout', 0, 'Seconds a trial may run before it is stopped (it saves a '
    'checkpoint) and recorded as failed; 0: no limit. With --launcher=slurm the clock '
    'starts when the job runs, and the job gets --time (timeout plus 2 minutes to save) '
    'as the scheduler\'s backstop.')
LAUNCHER = flags.DEFINE_enum(
    'launcher', 'local', ['local', 'slurm'],
    'local: each trial is a subprocess on this machine; slurm: each trial is one sbatch '
    'job (srun launch.train --cluster=slurm), watched with squeue. --parallel is then '
    'the number of jobs queued or running at once.')
SLURM_PARTITION = flags.DEFINE_string(
    'slurm_partition', None, '--launcher=slurm: the partition every trial job is '
    'submitted to (default: the cluster\'s default partition).')
SLURM_TASKS = flags.DEFINE_integer(
    'slurm_tasks', 1, '--launcher=slurm: tasks per trial, each one launch.train client '
    '(sbatch --ntasks); must divide every trial\'s mesh size, and on the sub-mesh '
    'pipeline engine leave each task a multiple of the stage count in devices. '
    '1: a plain single process.')
SLURM_CPUS_PER_TASK = flags.DEFINE_integer(
    'slurm_cpus_per_task', None, '--launcher=slurm: sbatch --cpus-per-task for every '
    'trial (default: the cluster\'s).')
SLURM_SBATCH_ARG = flags.DEFINE_multi_string(
    'slurm_sbatch_arg', [], '--launcher=slurm: one more sbatch option for every trial, '
    'as written, e.g. --slurm_sbatch_arg=--gres=gpu:4 --slurm_sbatch_arg=--qos=high. '
    'Repeatable; checked with sbatch --test-only before anything is submitted.')
SLURM_ON_STOP = flags.DEFINE_enum(
    'slurm_on_stop', 'cancel', ['cancel', 'leave'],
    '--launcher=slurm, on SIGTERM/SIGINT to the sweep: cancel (queued jobs are '
    'cancelled, running ones get SIGTERM, save, and the sweep waits for them) or leave '
    '(the sweep exits at once; the jobs go on, and running the same command again '
    'watches them instead of submitting them twice).')



def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  outcome = {}

  def body(watcher):
    del watcher  # the runner forwards stop signals to its trials itself
    # pylint: disable=g-import-not-at-top
    from plugins import sweep as sweep_lib
    from plugins.sweep import spec as sweep_spec
    gin_flags.require_model_dir(MODEL_DIR.value, 'a sweep')
    values = {'gin_file': list(gin_flags.GIN_FILES.value),
              'gin_bindings': list(gin_flags.GIN_BINDINGS.value),
              'sweep': list(SWEEP.value), 'sweep_mode': SWEEP_MODE.value,
              'num_trials': NUM_TRIALS.value, 'seed': SEED.value,
              'parallel': PARALLEL.value, 'trial_timeout': TRIAL_TIMEOUT.value,
              'launcher': LAUNCHER.value, 'slurm_partition': SLURM_PARTITION.value,
              'slurm_tasks': SLURM_TASKS.value,
              'slurm_cpus_per_task': SLURM_CPUS_PER_TASK.value,
              'slurm_sbatch_arg': list(SLURM_SBATCH_ARG.value),
              'slurm_on_stop': SLURM_ON_STOP.value}
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
    environment = gin_flags.environment_for_children()
    launcher = None
    if values['launcher'] == 'slurm':
      from plugins.sweep import slurm
      launcher = slurm.SlurmLauncher(
          partition=values['slurm_partition'], tasks=values['slurm_tasks'],
          cpus_per_task=values['slurm_cpus_per_task'],
          sbatch_args=values['slurm_sbatch_arg'], on_stop=values['slurm_on_stop'],
          time_limit_minutes=slurm.time_limit_minutes(values['trial_timeout'],
                                                      stop_grace=sweep_lib.STOP_GRACE),
          environment=environment)
    runner = sweep_lib.SweepRunner(sweep, parallel=values['parallel'],
                                   trial_timeout=values['trial_timeout'],
                                   command_line=sys.argv, environment=environment,
                                   launcher=launcher)
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
  app.run(main, flags_parser=launch.parse_flags)
