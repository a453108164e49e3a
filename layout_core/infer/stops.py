"""Where decoding ends a row: stop ids, stop sequences, and a chat's defaults.

    ids, sequences = parse_stops(['<|eot_id|>', '\\n\\n', '7,8'], tokenizer)
    # [128009] (a special token's text: its id), [[271], [7, 8]] ... one id
    # texts become stop ids, longer ones stop sequences
    ids, sequences = chat_stops(tokenizer, template=template, directory='runs/x/tokenizer')
    lm.generate(..., stop_ids=ids, stop_sequences=sequences)

A stop id ends a row where it is drawn; a stop sequence ends a row when the
row's new tokens end with the whole sequence (`ends_with`, checked for each
row on its own at every step; the prompt's tokens do not count). Either way
the stop is the row's last token and the positions after it hold DONE.

A `--stop` value (`parse_stops`) is an id ("2"), ids in a row ("7,8"), or
text: the text of a special token is that token's id (`<|eot_id|>`, with no
BOS put before it), other text is its ids as a rendered chat tokenizes it
(`Tokenizer.encode_rendered`; escapes such as "\\n" allowed).

A chat's default stops (`chat_stops`): the end of an assistant turn in its
template (`<|eot_id|>`, `<|im_end|>`, `</s>`; the default template's
`<|end|>`, several tokens), the tokenizer's EOS (`eos_token` of
tokenizer_config.json), and the `eos_token_id` (an id or a list) of the
`generation_config.json` an import kept beside the tokenizer. Importing this
module does not import TensorFlow.
"""

from __future__ import annotations

import json
import os
import re
from typing import Sequence

from layout_core.errors import ConfigError
from layout_core.lazy import tf
from layout_core.tasks import tokenizer as tokens_lib

GENERATION_CONFIG = 'generation_config.json'

Stops = tuple[list[int], list[list[int]]]  # (stop ids, stop sequences)


def parse_stops(values: Sequence[str], tokenizer: tokens_lib.Tokenizer, *,
                where: str = '--stop') -> Stops:
  """The stop ids and sequences of `values` (module doc)."""
  found: list[list[int]] = []
  for value in values:
    if re.fullmatch(r'\d+(\s*,\s*\d+)*', value.strip()):
      found.append([int(part) for part in value.split(',')])
      continue
    if not tokenizer.has_text:
      raise ConfigError(f'{where}={value!r} is text, but {tokenizer.why}', where=where,
                        fix='give the stop token as an id, e.g. --stop=1')
    ids = text_ids(unescaped(value, where) if '\\' in value else value, tokenizer)
    if not ids:
      raise ConfigError(f'{where}={value!r} has no tokens', where=where,
                        fix='give a token id, a special token or some text')
    found.append([int(i) for i in ids])
  return split(found)


def unescaped(value: str, where: str) -> str:
  """`value` with Python's backslash escapes read ('\\n' a newline); any
  other character kept as it is."""
  try:  # characters outside latin-1 travel as their own escapes, and come back
    return value.encode('latin-1', 'backslashreplace').decode('unicode_escape')
  except UnicodeDecodeError as e:
    raise ConfigError(f'{where}={value!r} has a backslash escape that does not read ({e.reason})',
                      where=where, fix='write the escape whole (\\n, \\t, \\u2581), or '
                                       'double the backslash for a backslash') from None


def text_ids(text: str, tokenizer: tokens_lib.Tokenizer) -> list[int]:
  """The ids of a stop text: a special token's text is that token's id, other
  text its ids as a rendered chat tokenizes it (no BOS put before it)."""
  special = tokenizer.token_id(text)
  return [int(special)] if special is not None else [
      int(i) for i in tokenizer.encode_rendered(text)[0]]


def chat_stops(tokenizer: tokens_lib.Tokenizer, *, template, directory: str | None) -> Stops:
  """The stops a chat's reply ends at by default (module doc). `template`:
  a `layout_core.tasks.chat` template; `directory`: the tokenizer's, or None."""
  from layout_core.tasks import chat  # pylint: disable=g-import-not-at-top
  found = [chat.end_of_turn_ids(template, tokenizer)]
  config = tokens_lib.read_config(directory)
  eos = tokens_lib.special_text(config.get('eos_token'))
  if eos:
    special = tokenizer.token_id(eos)
    found.append([special] if special is not None else tokenizer.encode_rendered(eos)[0])
  found += [[i] for i in generation_eos(directory)]
  vocab = tokenizer.vocab_size
  return split([ids for ids in found if ids and (vocab is None or max(ids) < vocab)])


def generation_eos(directory: str | None) -> list[int]:
  """The `eos_token_id` (an id or a list) of `directory/generation_config.json`."""
  path = os.path.join(directory, GENERATION_CONFIG) if directory else None
  if not path or not os.path.isfile(path):
    return []
  try:
    with open(path, encoding='utf-8') as f:
      value = json.load(f).get('eos_token_id')
  except (ValueError, AttributeError) as e:
    raise ConfigError(f'{path} is not a JSON object ({e})', where=path,
                      fix='restore the model\'s generation_config.json') from None
  values = value if isinstance(value, list) else [value]
  return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def split(found: Sequence[Sequence[int]]) -> Stops:
  """One-token stops as stop ids, longer ones as sequences, each once."""
  unique = list(dict.fromkeys(tuple(ids) for ids in found))
  return ([ids[0] for ids in unique if len(ids) == 1],
          [list(ids) for ids in unique if len(ids) > 1])


def checked(stop_ids: Sequence[int], stop_sequences: Sequence[Sequence[int]], *,
            vocab_size: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
  """(stop ids, sequences of 2 ids or more) as the decoder takes them; a
  ConfigError for an empty sequence or an id outside the vocabulary."""
  sequences = [tuple(int(i) for i in s) for s in stop_sequences]
  if () in sequences:
    raise ConfigError('a stop sequence is empty', where='stop_sequences',
                      fix='give each stop sequence one token id or more')
  ids, longer = split([[int(i)] for i in stop_ids] + sequences)
  bad = sorted({i for i in ids + sum(longer, []) if not 0 <= i < vocab_size})
  if bad:
    raise ConfigError(f'stop ids {bad} are not token ids of a {vocab_size}-token '
                      'vocabulary', where='stop_ids', fix=f'give ids in 0..{vocab_size - 1}')
  return tuple(ids), tuple(tuple(s) for s in longer)


def ends_with(out, step, sequences):
  """[B] bool: whether each row's new tokens `out` [B, N] (int32), written
  up to column `step`, end with one of `sequences` (each 2 ids or more).
  A column is read as a one-hot sum: exact, and no gather on a mesh."""
  columns = tf.expand_dims(tf.range(tf.shape(out)[1]), 0)
  nowhere = tf.reduce_any(tf.zeros_like(out) > 0, axis=1)   # [B] False, laid out as the rows
  found = nowhere
  for sequence in sequences:
    match = tf.logical_not(nowhere)
    for back, token in enumerate(reversed(sequence)):
      at = tf.equal(columns, step - back)                      # [1, N]: nowhere when < 0
      value = tf.reduce_sum(tf.where(at, out, tf.zeros_like(out)), axis=1)
      match = tf.logical_and(match, tf.logical_and(tf.equal(value, token), step - back >= 0))
    found = tf.logical_or(found, match)
  return found
