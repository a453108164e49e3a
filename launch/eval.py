r"""Evaluate a trained checkpoint, on any mesh, without touching the run.

  python -m launch.eval --model_dir=/tmp/quickstart
  python -m launch.eval --model_dir=/tmp/quickstart --name=2x4 \
      --gin_file=configs/layouts/megatron.gin \
      --gin_bindings="mesh.shape = {'data': 2, 'model': 4}"
  python -m launch.eval --checkpoint=/tmp/quickstart/checkpoints/ckpt-200 --eval_batches=16

The config is the run's own (`<model_dir>/config.gin`, or the checkpoint's
copy of it), then any --gin_file (another mesh or layout, other eval data)
and --gin_bindings on top; --norun_config uses only the files given. The
newest complete checkpoint of --model_dir is evaluated, or --checkpoint (a
ckpt-N directory or its prefix). It reads the checkpoint into the model
built on this config's mesh and runs the training loop's evaluation
(`layout_core.infer.evaluate`) over --eval_batches batches of the task's
eval split (default train.eval_batches; 'all': every record of a streamed
eval split once). It writes, under `<output_dir or model_dir>/eval_<name>/`,
the loop's eval/* TensorBoard scalars at the checkpoint's step and
metrics.json; nothing else, and never into checkpoints/.

Exit status: 0 done; 2 a configuration error (no checkpoint, a checkpoint
of another model, a config that does not build), nothing written; 5 a data
file could not be read.
"""

from __future__ import annotations

if __name__ == '__main__':  # first, before the imports below take their time
  import launch
  launch.install_start_up_handlers()

import dataclasses
import sys

from absl import app, flags, logging

from launch import checkpoint_flags, gin_flags

flags.adopt_module_key_flags(gin_flags)
flags.adopt_module_key_flags(checkpoint_flags)
MODEL_DIR, CHECKPOINT = checkpoint_flags.MODEL_DIR, checkpoint_flags.CHECKPOINT

OUTPUT_DIR = flags.DEFINE_string(
    'output_dir', None, 'Where eval_<name>/ goes (default: --model_dir, or the model_dir '
    'holding --checkpoint).')
NAME = flags.DEFINE_string(
    'name', 'heldout', 'The evaluation\'s name: its directory is eval_<name>/. Evaluating '
    'again under a name replaces its metrics.json (said in the log) and adds a point at '
    'the checkpoint\'s step to its TensorBoard run.')
EVAL_BATCHES = flags.DEFINE_string(
    'eval_batches', None, 'Batches of train.batch_size rows of the eval split: a number, '
    'or "all" (a streamed eval split read once). Default: the config\'s train.eval_batches.')


def eval_batches(text: str | None, plan) -> int:
  """--eval_batches as a count (see its help)."""
  from layout_core.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from layout_core.infer.evaluate import one_pass_batches  # pylint: disable=g-import-not-at-top
  if text is None:
    return plan.train.eval_batches
  if text.strip().lower() == 'all':
    return one_pass_batches(plan.task, batch_size=plan.train.batch_size)
  try:
    count = int(text)
  except ValueError:
    count = 0
  if count < 1:
    raise ConfigError(f'--eval_batches={text!r} is not a positive number or "all"',
                      where='--eval_batches', fix='give e.g. --eval_batches=16, or "all"')
  return count


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)

  def body(watcher):
    # pylint: disable=g-import-not-at-top
    from layout_core.infer import evaluate as evaluate_lib
    from layout_core.tasks.streams import DataError
    from plugins import gin_setup, inference, plan as plan_lib, run_status
    inference.find_checkpoint(model_dir=MODEL_DIR.value, checkpoint=CHECKPOINT.value)
    directory = evaluate_lib.output_directory(
        name=NAME.value, output_dir=OUTPUT_DIR.value, model_dir=MODEL_DIR.value,
        checkpoint=CHECKPOINT.value)
    with gin_setup.parsed_config(files=checkpoint_flags.config_files(),
                                 bindings=gin_flags.GIN_BINDINGS.value,
                                 search_paths=gin_flags.GIN_SEARCH_PATHS.value):
      plan = plan_lib.make_plan(data_splits=('eval',))  # never the training data
      count = eval_batches(EVAL_BATCHES.value, plan)
      plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, eval_batches=count))
      trained = inference.load_trained(plan, model_dir=MODEL_DIR.value,
                                       checkpoint=CHECKPOINT.value)
    try:
      evaluation = evaluate_lib.evaluate(trained.trainer)
    except DataError as e:
      print(f'\nData error: {run_status.one_line(str(e))}', file=sys.stderr)
      sys.exit(run_status.EXIT_DATA_ERROR)
    watcher.defer()  # writing: a signal now waits for the files to be whole
    previous = evaluate_lib.read_record(directory) or {}
    if previous.get('checkpoint') not in (None, trained.checkpoint):
      logging.warning('%s held the evaluation of %s (step %s); replacing its metrics.json '
                      '(its TensorBoard points stay)', directory, previous['checkpoint'],
                      previous.get('step'))
    spec = plan.mesh_spec
    path = evaluate_lib.write_evaluation(directory, evaluation, about={
        'name': NAME.value, 'checkpoint': trained.checkpoint, 'step': trained.step,
        'mesh': {'shape': dict(spec.shape), 'devices': spec.num_devices,
                 'describe': spec.describe()},
        'engine': type(trained.engine).__name__, 'data': plan.task.describe()})
    numbers = ''.join(f', {n} {v:.4f}' for n, v in evaluation.metrics.items())
    perplexity = (f' (perplexity {evaluation.perplexity:.3f})'
                  if evaluation.perplexity is not None else '')
    print(f'Evaluated {trained.checkpoint} (step {trained.step}) on {spec.describe()}: '
          f'loss {evaluation.loss:.6f}{perplexity}{numbers} over {evaluation.batches} '
          f'batches ({evaluation.examples} examples, {evaluation.tokens} tokens). '
          f'Wrote {path}', flush=True)

  gin_flags.run_guarded(body)


if __name__ == '__main__':
  app.run(main, flags_parser=launch.parse_flags)
