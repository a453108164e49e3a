"""The instruct task's JSON-lines files: each line one example, parsed and checked.

    messages = parse_example('{"prompt": "Add 2 and 3.", "response": "5"}',
                             path='train.jsonl', line=1)
    # [{'role': 'user', 'content': 'Add 2 and 3.'}, {'role': 'assistant', 'content': '5'}]
    check_example_files(['train.jsonl'])   # {'train.jsonl': 1}, or a ConfigError at file:line

The formats are described in `layout_core.tasks.instruct`'s module doc. A
file's lines are read by the task's streams as `numbered_lines` records, so
that an example is named by file and line wherever it fails.
"""

from __future__ import annotations

import itertools
import json
from typing import Iterator, Sequence

from layout_core.errors import ConfigError
from layout_core.lazy import tf

ROLES = ('system', 'user', 'assistant')

Messages = list[dict[str, str]]


def parse_example(text: str, *, path: str, line: int) -> Messages:
  """The conversation on one line of a JSON-lines file (module doc); a
  ConfigError naming `path:line` when the line is not an example."""
  expected = ('one JSON object per line: {"prompt": "...", "response": "..."} or '
              '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
              '"content": "..."}]}')

  def bad(what: str) -> ConfigError:
    return ConfigError(f'{path}:{line} {what}', where=f'{path}:{line}', fix=f'write {expected}')

  if not text.strip():
    raise bad('is empty')
  try:
    example = json.loads(text)
  except ValueError as e:
    raise bad(f'is not JSON ({e})') from None
  if not isinstance(example, dict):
    raise bad(f'holds a {type(example).__name__}, not an object')
  if 'messages' in example:
    messages = example['messages']
    if not isinstance(messages, list) or not messages:
      raise bad('has "messages" that is not a non-empty list')
    messages = check_messages(messages, bad)
  elif 'prompt' in example or 'response' in example:
    if not (isinstance(example.get('prompt'), str) and isinstance(example.get('response'), str)):
      raise bad(f'needs string "prompt" and "response" (it has keys {sorted(example)})')
    messages = [{'role': 'user', 'content': example['prompt']},
                {'role': 'assistant', 'content': example['response']}]
  else:
    raise bad(f'has neither "messages" nor "prompt"/"response" (keys {sorted(example)})')
  if not any(m['role'] == 'assistant' for m in messages):
    raise bad('has no assistant turn: nothing to train on')
  return messages


def check_messages(messages: list, bad) -> Messages:
  """`messages` as [{'role', 'content'}], each checked: a dict with a string
  content and a role of ROLES; `bad(what)` makes the error to raise."""
  for number, message in enumerate(messages):
    if not isinstance(message, dict) or not isinstance(message.get('content'), str):
      raise bad(f'message {number} is {message!r}, not {{"role": ..., "content": "..."}}')
    if message.get('role') not in ROLES:
      raise bad(f'message {number} has role {message.get("role")!r}, not one of {ROLES}')
  return [{'role': m['role'], 'content': m['content']} for m in messages]


def file_lines(path: str) -> Iterator[tuple[int, str]]:
  """(line number from 1, text) of each line of `path`; a ConfigError naming
  `path:line` for a line that is not UTF-8."""
  with open(path, 'rb') as f:
    for number, raw in enumerate(f, 1):
      try:
        yield number, raw.decode('utf-8')
      except UnicodeDecodeError as e:
        raise ConfigError(f'{path}:{number} is not UTF-8 ({e})', where=f'{path}:{number}',
                          fix='write the file as UTF-8') from None


def check_example_files(files: Sequence[str], parse=parse_example) -> dict[str, int]:
  """Reads and checks every line of `files` with `parse(text, path=, line=)`
  (`parse_example`; the preference task's `parse_pair`); returns each file's
  number of lines."""
  counts = {}
  for path in files:
    number = 0
    for number, text in file_lines(path):
      parse(text, path=path, line=number)
    counts[path] = number
  return counts


def count_lines(path: str, *, at_most: int) -> int:
  """Lines of a file, counted up to `at_most` (the streams' `count`)."""
  with open(path, 'rb') as f:
    return sum(1 for _ in itertools.islice(f, at_most))


def numbered_lines(files) -> 'tf.data.Dataset':
  """The lines of `files` (a string tensor [n]) in order, each as
  'path\\nline number\\ntext' so that an example can be named by file:line."""
  def of_file(path):
    lines = tf.data.TextLineDataset(path).enumerate(start=1)
    return lines.map(lambda number, text: tf.strings.join(
        [path, '\n', tf.strings.as_string(number), '\n', text]))
  return tf.data.Dataset.from_tensor_slices(files).flat_map(of_file)
