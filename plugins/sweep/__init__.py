"""Config sweeps: many `launch.train` trials of one base config, into
TensorBoard's HParams dashboard. Uses neither TensorFlow nor gin itself
(trials parse their own configs; the pre-check calls into `plugins`).

  spec           the axes (`key=[...]`, ranges), the trial list, sweep files
  driver         the runner: scheduling, failure isolation, resume, results
  trial_process  one attempt of one trial: its process, log, environment, ending
  slurm          the Slurm launcher: each attempt one sbatch job, watched with squeue
  board          the HParams experiment and session records

    from plugins import sweep
    records = sweep.SweepRunner(sweep.Sweep(root=..., gin_files=[...], gin_bindings=[],
                                            axes=[sweep.parse_axis('train.seed=[0, 1]')])).run()
"""

from plugins.sweep.driver import STOP_GRACE, Sweep, SweepRunner
from plugins.sweep.trial_process import (FAILURE, INTERRUPTED, LOG_FILE, STATUS_FILE, SUCCESS,
                                         first_error_line, read_status, trial_outcome)
from plugins.sweep.spec import parse_axis

__all__ = ['FAILURE', 'INTERRUPTED', 'LOG_FILE', 'STATUS_FILE', 'STOP_GRACE', 'SUCCESS', 'Sweep',
           'SweepRunner', 'first_error_line', 'parse_axis', 'read_status', 'trial_outcome']
