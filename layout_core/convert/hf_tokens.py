"""The token ids a Hugging Face export declares: BOS, EOS and the end of a turn.

    ids = special_ids('runs/tuned/tokenizer')   # {'bos': 1, 'eos': 2, 'end_of_turn': [5]}
    generation = generation_config('runs/tuned/tokenizer', kept=record_config)
    # {'bos_token_id': 1, 'eos_token_id': [2, 5]}: generate() stops at either

A model tuned on chats ends each answer with its template's end-of-turn
token (Llama 3's `<|eot_id|>`, Qwen2's `<|im_end|>`), which may not be the
tokenizer's `eos_token`: generation must stop at both, as the published
instruct models' `generation_config.json` says. The end-of-turn tokens are
found by rendering the chat template (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`, as `transformers` reads them) on a user turn and an
assistant turn: the special tokens (added tokens marked special) that the
template writes after the assistant's text. The EOS ids are, in order and
once each: the imported config.json's `eos_token_id` (`kept`), the
tokenizer's `eos_token`, the end-of-turn tokens.

An export copies the run's own `generation_config.json` when the import kept
one (`layout_core.convert.hf.TOKENIZER_FILES`); `generation_config` builds
one only for a run without it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from layout_core.errors import ConfigError

_ANSWER = 'ANSWER-7f3a'   # the assistant's text in the probe conversation


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _content(value: Any) -> str:
  """A special token of tokenizer_config.json: a string or {'content': ...}."""
  return str(value.get('content') or '') if isinstance(value, dict) else str(value or '')


def chat_template(directory: str) -> str | None:
  """The tokenizer's chat template as `transformers` finds it
  (`layout_core.tasks.tokenizer.read_chat_template`: chat_template.jinja, else
  tokenizer_config.json's `chat_template`, a string or the one named 'default'
  of a list, else chat_template.json's); None without one or where it cannot
  be read."""
  from layout_core.tasks import tokenizer as tokens_lib  # pylint: disable=g-import-not-at-top
  try:
    found = tokens_lib.read_chat_template(directory)
  except (ConfigError, OSError):
    return None
  source = found[0] if found else None
  if isinstance(source, list):
    source = {entry.get('name'): entry.get('template') for entry in source
              if isinstance(entry, dict)}.get('default')
  return source if isinstance(source, str) and source else None


def _special_tokens(directory: str) -> dict[str, int]:
  """content -> id of the tokens marked special (tokenizer.json's added
  tokens, tokenizer_config.json's added_tokens_decoder)."""
  found = {}
  tokenizer = _read_json(os.path.join(directory, 'tokenizer.json'))
  for token in (tokenizer or {}).get('added_tokens', []) if isinstance(tokenizer, dict) else []:
    if isinstance(token, dict) and token.get('special') and 'id' in token:
      found[str(token.get('content'))] = int(token['id'])
  config = _read_json(os.path.join(directory, 'tokenizer_config.json'))
  decoder = config.get('added_tokens_decoder') if isinstance(config, dict) else None
  for token_id, token in (decoder or {}).items():
    if isinstance(token, dict) and token.get('special'):
      found.setdefault(str(token.get('content')), int(token_id))
  return found


def _token_id(directory: str, content: str) -> int | None:
  """The id of the token `content` (a special one, or one of the vocabulary)."""
  special = _special_tokens(directory)
  if content in special:
    return special[content]
  tokenizer = _read_json(os.path.join(directory, 'tokenizer.json'))
  vocab = (tokenizer.get('model') or {}).get('vocab') if isinstance(tokenizer, dict) else None
  if isinstance(vocab, dict) and isinstance(vocab.get(content), int):
    return vocab[content]
  return None


def special_ids(directory: str) -> dict[str, Any]:
  """{'bos': id or None, 'eos': id or None, 'end_of_turn': [ids]} of the
  tokenizer files in `directory` (module doc)."""
  config = _read_json(os.path.join(directory, 'tokenizer_config.json'))
  config = config if isinstance(config, dict) else {}
  ids = {}
  for key in ('bos', 'eos'):
    content = _content(config.get(f'{key}_token'))
    ids[key] = _token_id(directory, content) if content else None
  tail = _answer_tail(directory, config)
  ids['end_of_turn'] = [token_id for content, token_id in _special_tokens(directory).items()
                        if content and content in tail]
  return ids


def _answer_tail(directory: str, config: Mapping[str, Any]) -> str:
  """What the chat template writes after an assistant's text ('' if no
  template, or one that cannot render the probe conversation)."""
  source = chat_template(directory)
  if source is None:
    return ''
  from layout_core.tasks.instruct import JinjaTemplate  # pylint: disable=g-import-not-at-top
  try:
    template = JinjaTemplate(os.path.join(directory, 'tokenizer_config.json'),
                             {**config, 'chat_template': source})
    text = template.render([{'role': 'user', 'content': 'Hello'},
                            {'role': 'assistant', 'content': _ANSWER}],
                           generation_prompt=False, where='the probe conversation')
  except ConfigError:
    return ''
  return text.rsplit(_ANSWER, 1)[1] if _ANSWER in text else ''


def _as_list(value: Any) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_ids(directory: str | None, *, kept: Mapping[str, Any] | None = None) -> list[int]:
  """The ids generation stops at, in order, once each (module doc)."""
  ids = _as_list((kept or {}).get('eos_token_id'))
  if directory:
    found = special_ids(directory)
    ids += _as_list(found['eos']) + found['end_of_turn']
  return list(dict.fromkeys(ids))


def bos_id(directory: str | None, *, kept: Mapping[str, Any] | None = None) -> int | None:
  if (kept or {}).get('bos_token_id') is not None:
    return kept['bos_token_id']
  return special_ids(directory)['bos'] if directory else None


def token_fields(directory: str | None, *,
                 kept: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """bos_token_id and eos_token_id (an id, or a list when several) for
  config.json and generation_config.json; those unknown are left out."""
  fields = {}
  bos, eos = bos_id(directory, kept=kept), eos_ids(directory, kept=kept)
  if bos is not None:
    fields['bos_token_id'] = bos
  if eos:
    fields['eos_token_id'] = eos[0] if len(eos) == 1 else eos
  if (kept or {}).get('pad_token_id') is not None:
    fields['pad_token_id'] = kept['pad_token_id']
  return fields


def generation_config(directory: str | None, *,
                      kept: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
  """generation_config.json for a run without its own (module doc); None
  when no token id is known."""
  fields = token_fields(directory, kept=kept)
  return fields or None
