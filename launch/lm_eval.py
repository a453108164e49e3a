r"""Score a trained LM's checkpoint with EleutherAI's lm-eval harness.

  python -m launch.lm_eval --model_dir=/tmp/bytes_run --tasks=meshgin_choice,meshgin_until \
      --include_path=tests/fixtures/lm_eval_task --output=/tmp/lm_eval.json
  python -m launch.lm_eval --model_dir=runs/lm_corpus --tasks=hellaswag --limit=100 \
      --nooffline --output=/tmp/hellaswag.json

Needs the `lm_eval` extra (`pip install 'meshgin[lm_eval]'`). The config is
the run's own (`<model_dir>/config.gin`, or the checkpoint's copy), then any
--gin_file and --gin_bindings on top (another mesh: --gin_bindings="mesh.shape
= {'data': 1}"); the newest complete checkpoint of --model_dir is read, or
--checkpoint, into the model built on that mesh (without its pipeline), read
only. `plugins.lm_eval.HarnessLM` answers the harness's loglikelihood,
loglikelihood_rolling and generate_until requests with the run's tokenizer
(an lm_corpus run's SentencePiece model or --spm_model, a bytes run's UTF-8;
a Markov run has no text and is refused).

--tasks names the harness's tasks (its own, or YAML tasks under
--include_path); --limit takes the first N documents of each. With
--offline (the default) the Hugging Face libraries make no network call:
local-file tasks (`dataset_path: json` and `data_files`) and datasets
already in the cache run; --nooffline lets the harness download its
datasets. The results (lm-eval's results, configs, versions, n-shot and
the checkpoint scored) are printed as lm-eval's table and written as JSON
to --output (with every request and answer under "samples" with
--log_samples).

Exit status: 0 done; 2 a configuration error in one paragraph (lm-eval not
installed, no checkpoint, a model that is not a Transformer LM, a run
without text, an unknown task), nothing written.
"""

from __future__ import annotations

if __name__ == '__main__':  # first, before the imports below take their time
  import launch
  launch.install_start_up_handlers()

import difflib
import json
import os

from absl import app, flags, logging

from launch import checkpoint_flags, gin_flags

flags.adopt_module_key_flags(gin_flags)
flags.adopt_module_key_flags(checkpoint_flags)
MODEL_DIR, CHECKPOINT, RUN_CONFIG = (
    checkpoint_flags.MODEL_DIR, checkpoint_flags.CHECKPOINT, checkpoint_flags.RUN_CONFIG)

TASKS = flags.DEFINE_list(
    'tasks', [], 'lm-eval tasks, groups or tags, comma-separated (patterns such as '
    '"meshgin_*" allowed).')
INCLUDE_PATH = flags.DEFINE_multi_string(
    'include_path', [], 'A directory of lm-eval task YAML files to add (repeatable).')
INCLUDE_DEFAULTS = flags.DEFINE_bool(
    'include_defaults', True, 'Also index lm-eval\'s own tasks (a few seconds); '
    '--noinclude_defaults: only --include_path\'s.')
LIMIT = flags.DEFINE_float(
    'limit', None, 'Documents per task: N (the first N), or a fraction below 1. Default: all.')
NUM_FEWSHOT = flags.DEFINE_integer(
    'num_fewshot', None, 'Few-shot examples in each prompt (default: the task\'s own).')
BATCH_SIZE = flags.DEFINE_integer(
    'batch_size', 8, 'Windows scored, or prompts decoded, per call of the model.',
    lower_bound=1)
MAX_GEN_TOKS = flags.DEFINE_integer(
    'max_gen_toks', 256, 'New tokens of a generate_until request whose task does not say '
    '(at most half the model\'s max_len are made).', lower_bound=1)
SEED = flags.DEFINE_integer(
    'seed', 0, 'Sampling seed (for tasks that sample) and lm-eval\'s own seeds.')
SPM_MODEL = flags.DEFINE_string(
    'spm_model', None, 'The SentencePiece model for text (default: the one beside an '
    'lm_corpus run\'s train files).')
OFFLINE = flags.DEFINE_bool(
    'offline', True, 'No network: HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 for the '
    'harness\'s dataset loading (local files and the cache only).')
OUTPUT = flags.DEFINE_string(
    'output', None, 'Write the results here as JSON.')
LOG_SAMPLES = flags.DEFINE_bool(
    'log_samples', False, 'Also write every request and the model\'s answer in --output.')


def import_harness():
  """lm_eval, imported after the offline switches it reads at import."""
  from layout_core.errors import ConfigError  # pylint: disable=g-import-not-at-top
  if OFFLINE.value:
    os.environ['HF_DATASETS_OFFLINE'] = '1'
    os.environ['HF_HUB_OFFLINE'] = '1'
  try:
    import lm_eval  # pylint: disable=g-import-not-at-top
    import lm_eval.tasks  # pylint: disable=g-import-not-at-top,unused-import
  except ModuleNotFoundError as e:
    if not (e.name or '').startswith('lm_eval'):
      raise
    raise ConfigError('lm-eval is not installed', where='the Python environment',
                      fix='pip install \'meshgin[lm_eval]\' (or \'lm-eval>=0.4.13,<0.5\')'
                      ) from None
  return lm_eval


def task_manager(lm_eval):
  """(the harness's task index, --tasks checked against it, patterns expanded)."""
  from layout_core.errors import ConfigError  # pylint: disable=g-import-not-at-top
  if not TASKS.value:
    raise ConfigError('no task given', where='--tasks',
                      fix='name lm-eval tasks, e.g. --tasks=hellaswag, or YAML tasks under '
                          '--include_path')
  for path in INCLUDE_PATH.value:
    if not os.path.isdir(path):
      raise ConfigError(f'--include_path {path!r} is not a directory', where='--include_path',
                        fix='give a directory of lm-eval task YAML files')
  manager = lm_eval.tasks.TaskManager(include_path=INCLUDE_PATH.value or None,
                                      include_defaults=INCLUDE_DEFAULTS.value)
  known = manager.all_tasks
  missing = [t for t in TASKS.value if not manager.match_tasks([t])]
  if missing:
    near = sorted({n for t in missing for n in difflib.get_close_matches(t, known, n=3)})
    where = ', '.join(INCLUDE_PATH.value) or 'lm-eval\'s own tasks'
    raise ConfigError(f'unknown lm-eval task(s) {missing} ({len(known)} known, from {where})',
                      where='--tasks / --include_path',
                      fix=(f'did you mean {", ".join(near)}? ' if near else '')
                      + 'name a task of the harness, or add its YAML\'s directory with '
                        '--include_path')
  names = [n for t in TASKS.value for n in ([t] if t in known else manager.match_tasks([t]))]
  return manager, list(dict.fromkeys(names))


def limit():
  from layout_core.errors import ConfigError  # pylint: disable=g-import-not-at-top
  value = LIMIT.value
  if value is None:
    return None
  if value <= 0 or (value >= 1 and value != int(value)):
    raise ConfigError(f'--limit={value:g}', where='--limit',
                      fix='give a number of documents (e.g. 100) or a fraction below 1')
  return int(value) if value >= 1 else value


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)

  def body(watcher):
    # pylint: disable=g-import-not-at-top
    from layout_core.durable import write_atomically
    lm_eval = import_harness()
    from plugins import lm_eval as harness
    # All that needs no model first: a bad flag or task exits 2 in seconds.
    (manager, tasks), documents = task_manager(lm_eval), limit()
    model = harness.load_harness_lm(
        model_dir=MODEL_DIR.value, checkpoint=CHECKPOINT.value,
        gin_files=gin_flags.GIN_FILES.value, gin_bindings=gin_flags.GIN_BINDINGS.value,
        search_paths=gin_flags.GIN_SEARCH_PATHS.value, run_config=RUN_CONFIG.value,
        spm_model=SPM_MODEL.value, batch_size=BATCH_SIZE.value,
        max_gen_toks=MAX_GEN_TOKS.value, seed=SEED.value)
    results = lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=manager, limit=documents,
        num_fewshot=NUM_FEWSHOT.value, bootstrap_iters=0, log_samples=LOG_SAMPLES.value,
        random_seed=SEED.value, numpy_random_seed=SEED.value, fewshot_random_seed=SEED.value)
    kept = ('results', 'groups', 'group_subtasks', 'configs', 'versions', 'n-shot',
            'higher_is_better', 'n-samples', 'lm_eval_version', 'date')
    record = {name: results[name] for name in kept if name in results}
    record['meshgin'] = {**model.about, 'tasks': tasks, 'limit': documents,
                         'batch_size': BATCH_SIZE.value}
    if LOG_SAMPLES.value:
      record['samples'] = results.get('samples', {})
    watcher.defer()  # writing: a signal now waits for the file to be whole
    if OUTPUT.value:
      text = json.dumps(record, indent=1, default=lm_eval.utils.handle_non_serializable)
      write_atomically(OUTPUT.value, text.encode('utf-8'))
    print(lm_eval.utils.make_table(results), flush=True)
    print(f'Scored {model.about["checkpoint"]} (step {model.about["step"]}) on '
          f'{model.about["mesh"]} with lm-eval {results.get("lm_eval_version", "")}: '
          f'{", ".join(tasks)}' + (f'; wrote {OUTPUT.value}' if OUTPUT.value else ''),
          flush=True)

  gin_flags.run_guarded(body)


if __name__ == '__main__':
  app.run(main, flags_parser=launch.parse_flags)
