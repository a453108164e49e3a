r"""Sample text from a trained Transformer LM's checkpoint, with a KV cache.

  python -m launch.decode --model_dir=/tmp/quickstart --prompt_ids=1,2,3 --max_new_tokens=20
  python -m launch.decode --model_dir=runs/lm_corpus --prompt='def main(' \
      --temperature=0.8 --top_p=0.95 --seed=7 --output=/tmp/samples.jsonl

The config is the run's own (`<model_dir>/config.gin`, or the checkpoint's
copy), then any --gin_file and --gin_bindings on top (another mesh:
--gin_bindings="mesh.shape = {'data': 1}"); --norun_config uses only the
files given. The newest complete checkpoint of --model_dir is read, or
--checkpoint (a ckpt-N directory or its prefix), into the model built on the
config's mesh, without its pipeline if it has one (a pipelined run's
checkpoint holds the same keys). Read only: nothing is written under the run.

Prompts: --prompt (text, repeatable), --prompt_ids ("1,2,3", repeatable),
--prompts_file (one prompt a line; .jsonl: {"prompt": text} or {"ids": [...]}
a line). Text goes through the run's tokenizer (`layout_core.infer.tokens`):
an lm_corpus run's SentencePiece model (or --spm_model), a bytes run's UTF-8;
a Markov run has ids only. Each prompt gets --max_new_tokens new tokens
(`layout_core.infer.decode.CachedLM.generate`): greedy, or sampled with
--temperature, --top_k, --top_p and --seed (the same seed gives the same
text on any mesh). A row ends at a --stop (`layout_core.infer.stops`): an
id, ids in a row, a special token's text (its id, no BOS), or text, whose
ids end the row when its new tokens end with all of them. With --chat a row
also ends where the chat's reply ends: the template's end-of-turn token, the
tokenizer's EOS, and the `eos_token_id`s of the run's
tokenizer/generation_config.json. The continuations are printed, and
written as JSON lines to --output: {"prompt", "ids", "continuation", "text"}.

Exit status: 0 done; 2 a configuration error in one paragraph (no
checkpoint, a checkpoint of another model, a model that is not a Transformer
LM, a prompt too long for the model's max_len, a tokenizer that is not the
model's), nothing written.
"""

from __future__ import annotations

if __name__ == '__main__':  # first, before the imports below take their time
  import launch
  launch.install_start_up_handlers()

import json
import os
import re
import time

from absl import app, flags, logging

from launch import checkpoint_flags, gin_flags, sampling_flags

flags.adopt_module_key_flags(gin_flags)
flags.adopt_module_key_flags(checkpoint_flags)
flags.adopt_module_key_flags(sampling_flags)
MODEL_DIR, CHECKPOINT = checkpoint_flags.MODEL_DIR, checkpoint_flags.CHECKPOINT

PROMPT = flags.DEFINE_multi_string(
    'prompt', [], 'A prompt as text (repeat for more), through the run\'s tokenizer.')
CHAT = flags.DEFINE_bool(
    'chat', False, 'Give each text prompt as a user turn of a conversation, formatted by '
    'the chat template the run was tuned with (its instruct task\'s; else the '
    'chat_template of its tokenizer/, as an imported chat model has; else the default '
    'template), up to where the assistant\'s answer starts; the reply ends at the '
    'template\'s end of turn, the tokenizer\'s EOS and generation_config.json\'s '
    'eos_token_id.')
PROMPT_IDS = flags.DEFINE_multi_string(
    'prompt_ids', [], 'A prompt as token ids, e.g. "1,2,3" (repeat for more).')
PROMPTS_FILE = flags.DEFINE_string(
    'prompts_file', None, 'A file of prompts, one a line: text (ids "1,2,3" for a run '
    'without text), or with .jsonl {"prompt": text} or {"ids": [...]}.')
MAX_NEW_TOKENS = flags.DEFINE_integer(
    'max_new_tokens', 32, 'New tokens per prompt; a prompt plus these, less one, must fit '
    'the model\'s max_len.', lower_bound=1)
SEED = flags.DEFINE_integer(
    'seed', 0, 'Sampling seed: the samples are a function of (seed, prompt index, position).')
STOP = flags.DEFINE_multi_string(
    'stop', [], 'What ends a prompt\'s continuation: an id ("1"), ids in a row ("7,8"), a '
    'special token\'s text ("<|eot_id|>": its id), or text (escapes such as "\\n" '
    'allowed), which ends a row when its new tokens end with the text\'s tokens. Repeat '
    'for more.')
OUTPUT = flags.DEFINE_string(
    'output', None, 'Also write the continuations here as JSON lines: prompt, ids (the '
    'prompt\'s), continuation (ids), text.')
SPM_MODEL = flags.DEFINE_string(
    'spm_model', None, 'The SentencePiece model for text (default: the one beside an '
    'lm_corpus run\'s train files).')
BATCH_SIZE = flags.DEFINE_integer(
    'batch_size', 32, 'Prompts decoded together (each batch padded to its longest).',
    lower_bound=1)


def parse_ids(text: str, where: str) -> list[int]:
  from layout_core.errors import ConfigError  # pylint: disable=g-import-not-at-top
  parts = [p for p in re.split(r'[,\s]+', text.strip()) if p]
  if not parts or not all(re.fullmatch(r'\d+', p) for p in parts):
    raise ConfigError(f'{text!r} is not a list of token ids', where=where,
                      fix='give ids separated by commas, e.g. 1,2,3')
  return [int(p) for p in parts]


def read_prompts(tokenizer, encode=None) -> list[tuple[str, list[int]]]:
  """(prompt as given, its ids) for every prompt of the flags, in order;
  text through `encode` (default: the tokenizer's)."""
  from layout_core.errors import ConfigError  # pylint: disable=g-import-not-at-top
  encode = encode or tokenizer.encode
  prompts = [(text, encode(text)) for text in PROMPT.value]
  prompts += [(text, parse_ids(text, '--prompt_ids')) for text in PROMPT_IDS.value]
  path = PROMPTS_FILE.value
  if path:
    if not os.path.isfile(path):
      raise ConfigError(f'--prompts_file {path!r} does not exist', where='--prompts_file',
                        fix='give a file of prompts, one a line')
    with open(path, encoding='utf-8') as f:
      lines = [line.rstrip('\n') for line in f]
    for number, line in enumerate(lines, 1):
      where = f'--prompts_file {path}, line {number}'
      if not line.strip():
        continue
      if path.endswith('.jsonl'):
        try:
          record = json.loads(line)
        except ValueError as e:
          raise ConfigError(f'{where} is not JSON ({e})', where=where,
                            fix='write {"prompt": "text"} or {"ids": [1, 2]} a line') from None
        if isinstance(record, dict) and isinstance(record.get('prompt'), str):
          prompts.append((record['prompt'], encode(record['prompt'])))
        elif isinstance(record, dict) and isinstance(record.get('ids'), list):
          prompts.append((str(record['ids']), parse_ids(','.join(map(str, record['ids'])), where)))
        else:
          raise ConfigError(f'{where} has neither "prompt" (text) nor "ids" (a list)',
                            where=where, fix='write {"prompt": "text"} or {"ids": [1, 2]}')
      elif tokenizer.has_text:
        prompts.append((line, encode(line)))
      else:
        prompts.append((line, parse_ids(line, where)))
  if not prompts:
    raise ConfigError('no prompt given', where='the command line',
                      fix='add --prompt="text", --prompt_ids=1,2,3 or --prompts_file=FILE')
  return prompts


def chat_template(plan):
  """(the chat template --chat formats with, its tokenizer directory or None):
  the flag's help says which."""
  # pylint: disable=g-import-not-at-top
  from layout_core.tasks import chat
  from layout_core.tasks.tokenizer import RUN_TOKENIZER_DIR
  from plugins import inference
  run = inference.run_directory(model_dir=MODEL_DIR.value, checkpoint=CHECKPOINT.value)
  own = os.path.join(run, RUN_TOKENIZER_DIR) if run else None
  directory = own if own and os.path.isdir(own) else getattr(plan.task, 'tokenizer_dir', None)
  template = getattr(plan.task, 'template', None)
  return (template if template is not None else chat.find_template(directory)), directory


def chat_encoder(template, tokenizer):
  """--chat's encoding of a prompt (`layout_core.tasks.chat.chat_prompt`)."""
  # pylint: disable=g-import-not-at-top
  from layout_core.errors import ConfigError
  from layout_core.tasks import chat
  if not tokenizer.has_text:
    raise ConfigError(f'--chat formats text, but {tokenizer.why}', where='--chat',
                      fix='leave out --chat and give the prompt as ids')
  return lambda text: chat.chat_prompt(text, template=template, tokenizer=tokenizer)


def stops_of_flags(plan, tokenizer):
  """(stop ids, stop sequences): --stop's, and with --chat the chat's own."""
  from layout_core.infer import stops  # pylint: disable=g-import-not-at-top
  found = stops.parse_stops(STOP.value, tokenizer)
  if CHAT.value and tokenizer.has_text:
    template, directory = chat_template(plan)
    chat_ids, chat_sequences = stops.chat_stops(tokenizer, template=template,
                                                directory=directory)
    found = stops.split([[i] for i in found[0] + chat_ids] + found[1] + chat_sequences)
  return found


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)

  def body(watcher):
    # pylint: disable=g-import-not-at-top
    import numpy as np
    from layout_core.infer import decode
    from layout_core.layout.variables import to_numpy
    from plugins import inference
    # All that needs no model first: a bad flag or prompt exits 2 in a second.
    if OUTPUT.value:
      from layout_core.durable import check_writable
      check_writable(OUTPUT.value, where='--output')
    inference.find_checkpoint(model_dir=MODEL_DIR.value, checkpoint=CHECKPOINT.value)
    sampling = sampling_flags.sampling()
    prompts, stops = [], []

    def check(plan, layers, tokenizer):  # before the checkpoint is read
      encode = chat_encoder(chat_template(plan)[0], tokenizer) if CHAT.value else None
      prompts[:], stops[:] = read_prompts(tokenizer, encode), stops_of_flags(plan, tokenizer)
      for index, (text, ids) in enumerate(prompts):
        decode.check_fits(prompt_length=len(ids), max_new_tokens=MAX_NEW_TOKENS.value,
                          max_len=layers.max_len,
                          where=f'prompt {index} ({text[:40]!r}) / --max_new_tokens')
    loaded = inference.load_decoder(
        files=checkpoint_flags.config_files(), bindings=gin_flags.GIN_BINDINGS.value,
        search_paths=gin_flags.GIN_SEARCH_PATHS.value, model_dir=MODEL_DIR.value,
        checkpoint=CHECKPOINT.value, spm_model=SPM_MODEL.value, check=check)
    plan, tokenizer, trained, lm = loaded.plan, loaded.tokenizer, loaded.trained, loaded.lm
    start, results = time.perf_counter(), []
    size = BATCH_SIZE.value
    for first in range(0, len(prompts), size):
      batch = prompts[first:first + size]
      width = max(len(ids) for _, ids in batch)
      array = np.zeros([len(batch), width], np.int32)
      for row, (_, ids) in enumerate(batch):
        array[row, :len(ids)] = ids
      new = to_numpy(lm.generate(array, np.array([len(ids) for _, ids in batch], np.int32),
                                 max_new_tokens=MAX_NEW_TOKENS.value, sampling=sampling,
                                 seed=SEED.value, first_row=first, stop_ids=stops[0],
                                 stop_sequences=stops[1]))
      results += [[int(t) for t in row if t != decode.DONE] for row in new]
    seconds = time.perf_counter() - start
    records = [{'prompt': text, 'ids': ids, 'continuation': new, 'text': tokenizer.decode(new)}
               for (text, ids), new in zip(prompts, results)]
    watcher.defer()  # writing: a signal now waits for the file to be whole
    if OUTPUT.value:
      from layout_core.durable import write_atomically  # pylint: disable=g-import-not-at-top
      write_atomically(OUTPUT.value,
                       ''.join(json.dumps(r) + '\n' for r in records).encode('utf-8'))
    for index, record in enumerate(records):
      print(f'[{index}] {record["prompt"]}\n  -> {record["text"]!r}', flush=True)
    made = sum(len(r) for r in results)
    print(f'Decoded {len(records)} prompt(s) from {trained.checkpoint} (step {trained.step}) '
          f'on {plan.mesh_spec.describe()}, {sampling.describe()}: {made} new tokens in '
          f'{seconds:.2f} s' + (f'; wrote {OUTPUT.value}' if OUTPUT.value else ''), flush=True)

  gin_flags.run_guarded(body)


if __name__ == '__main__':
  app.run(main, flags_parser=launch.parse_flags)
