"""Where a run came from: its tokenizer and import record, carried by `checkpoint.init_from`.

    carry_origin('runs/llama', 'runs/tuned')   # runs/tuned/tokenizer/, hf_import.json
    record, tokenizer_dir = origin_of('runs/tuned')
    record['hf_dir']          # the Hugging Face directory the base was imported from

An imported run (`plugins.hf.import_run`) holds `tokenizer/` (the model's
tokenizer files, chat template and generation_config.json) and
`hf_import.json` (the directory it came from, its config.json as read). A
run started from it with `checkpoint.init_from` trains in a new directory;
`carry_origin`, called when that run starts (`plugins.record.record_run`),
copies both into it, each whole or not at all (`layout_core.durable`), and
adds to the record `init_from`: the base run's directory. A run that
already has them keeps its own (a resumed run, or one whose files were
replaced by hand). So `launch.decode --prompt`, `launch.export --format=hf`
(the tokenizer files, EOS ids) and `--adapters_only` (the PEFT
`base_model_name_or_path`) find them in any run of the chain.

`origin_of` reads them for a run, looking in the base run of a run that
started before carrying existed (its config's `checkpoint.init_from`).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from absl import logging

from layout_core.errors import ConfigError
from layout_core.durable import directory_aside, write_atomically
from layout_core.infer.tokens import RUN_TOKENIZER_DIR

IMPORT_RECORD = 'hf_import.json'


def base_run(source: str | None) -> str | None:
  """The run directory of `checkpoint.init_from = source` (a run or one of
  its checkpoints), None when it is no meshgin run."""
  if not source:
    return None
  from plugins.inference import run_directory  # pylint: disable=g-import-not-at-top
  directory = run_directory(model_dir=None, checkpoint=source)
  return os.path.abspath(directory) if directory and os.path.isdir(directory) else None


def read_record(run_dir: str | None) -> dict[str, Any] | None:
  path = os.path.join(run_dir or '', IMPORT_RECORD)
  if not run_dir or not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      record = json.load(f)
  except ValueError as e:
    raise ConfigError(f'{path} is not JSON ({e})', where=path,
                      fix='restore it from the run it came from, or delete it (the run then '
                          'exports without its Hugging Face origin)') from None
  if not isinstance(record, dict):
    raise ConfigError(f'{path} holds a {type(record).__name__}, not an object', where=path,
                      fix='restore it from the run it came from, or delete it')
  return record


def carry_origin(source: str | None, model_dir: str) -> list[str]:
  """Copies the base run's tokenizer/ and import record into `model_dir`
  (module doc); returns the names copied."""
  base = base_run(source)
  if base is None or os.path.abspath(base) == os.path.abspath(model_dir):
    return []
  copied = []
  tokenizer = os.path.join(base, RUN_TOKENIZER_DIR)
  target = os.path.join(model_dir, RUN_TOKENIZER_DIR)
  if os.path.isdir(tokenizer) and not os.path.exists(target):
    with directory_aside(target) as partial:
      for name in sorted(os.listdir(tokenizer)):
        if os.path.isfile(os.path.join(tokenizer, name)):
          shutil.copyfile(os.path.join(tokenizer, name), os.path.join(partial, name))
    copied.append(RUN_TOKENIZER_DIR)
  record = read_record(base)
  if record is not None and not os.path.exists(os.path.join(model_dir, IMPORT_RECORD)):
    record = {**record, 'init_from': base}
    write_atomically(os.path.join(model_dir, IMPORT_RECORD),
                     json.dumps(record, indent=1, default=str).encode())
    copied.append(IMPORT_RECORD)
  if copied:
    logging.info('Carried %s from %s (checkpoint.init_from)', ', '.join(copied), base)
  return copied


def origin_of(run_dir: str | None, init_from: str | None = None,
              ) -> tuple[dict[str, Any] | None, str | None]:
  """(the import record, the tokenizer directory) of the run `run_dir`, each
  None when neither it nor the base run `init_from` has one."""
  record, tokenizer = None, None
  for directory in (run_dir, base_run(init_from)):
    if not directory:
      continue
    record = record or read_record(directory)
    if tokenizer is None and os.path.isdir(os.path.join(directory, RUN_TOKENIZER_DIR)):
      tokenizer = os.path.join(directory, RUN_TOKENIZER_DIR)
  return record, tokenizer
