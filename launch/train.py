r"""Train a model from gin config files.

  python -m launch.train --gin_file=configs/experiments/quickstart.gin \
      --model_dir=/tmp/quickstart [--gin_bindings='train.num_steps = 50']

Builds the mesh, the Params tree and the layout scope from the config, trains,
and writes to --model_dir: config.gin (operative config), params.txt,
layouts.txt, checkpoints and TensorBoard events (`tensorboard --logdir <model_dir>`).
Running the same command again resumes from the newest checkpoint.

Exit status: 0 on success (also when stopped by SIGTERM/SIGINT: the current
step finishes and a checkpoint is saved); 2 on a configuration error, with a
one-paragraph message saying what, where (gin file and line) and how to fix
it; 3 when the loss became NaN or infinite (one line: 'Training diverged: ...').
Nothing in --model_dir is created or changed before the config, the machine
and any existing checkpoint have been checked.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

from launch import gin_flags

flags.adopt_module_key_flags(gin_flags)  # show the gin flags in --help

MODEL_DIR = flags.DEFINE_string(
    'model_dir', '/tmp/meshgin/run', 'Directory for checkpoints, TensorBoard '
    'events and the run record (config.gin, params.txt, layouts.txt).')

EXIT_DIVERGED = 3  # the loss became NaN or infinite (launch.sweep records it as such)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)

  def body(watcher):
    from plugins import plan, training  # pylint: disable=g-import-not-at-top
    with gin_flags.parsed_config():
      run_plan = plan.make_plan()
      plan.check_model_dir(MODEL_DIR.value)
      try:
        training.run_training(run_plan, model_dir=MODEL_DIR.value, watcher=watcher)
      except FloatingPointError as e:  # raised by the trainer on a non-finite loss
        logging.error('Training diverged: %s', e)
        print(f'\nTraining diverged: {e}', file=sys.stderr)
        sys.exit(EXIT_DIVERGED)

  gin_flags.run_guarded(body)


if __name__ == '__main__':
  app.run(main)
