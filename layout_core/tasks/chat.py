"""Chat templates: a conversation as text, which of it is trained, its token ids.

    template = find_template('runs/llama/tokenizer')      # its chat_template, or the default
    rendered = template.render_trained(messages, where='train.jsonl:3')
    ids, loss_mask = tokenize(rendered, tokenizer)       # the ids `transformers` gives
    chat_prompt('Add 2 and 3.', template=template, tokenizer=tokenizer)  # for decoding
    template.end_of_turn()                               # '<|eot_id|>': where a reply ends

A tokenizer directory's chat template (Jinja, as Hugging Face models ship
it: `chat_template.jinja`, else the `chat_template` of
`tokenizer_config.json`, else `chat_template.json`, in `transformers`' order,
`tokenizer.read_chat_template`) is rendered as `transformers`'
`apply_chat_template` renders it: a sandboxed environment with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension
(`{% break %}`, `{% continue %}`), `{% generation %}` blocks, a `tojson`
that writes JSON as `json.dumps` does (no HTML escaping, `indent` and
`sort_keys` allowed), `raise_exception(message)` and `strftime_now(format)`;
its variables are `messages`, `add_generation_prompt`, `tools` and
`documents` (None), and every special token the config names (`bos_token`,
`eos_token`, `unk_token`, `pad_token`, ..., `additional_special_tokens`).
Without a chat_template the default template writes each turn as

    <|system|>\\n{content}<|end|>\\n      (and <|user|> alike)
    <|assistant|>\\n{content}<|end|>\\n

whose markers are plain text to the tokenizer.

The whole text is tokenized at once (`Tokenizer.encode_rendered`: special
tokens' text as their ids, no BOS added), so the ids are those of
`apply_chat_template(messages, tokenize=True)`. The trained text of each
assistant turn: what its `{% generation %}` block renders, where the
template has them (what `return_assistant_tokens_mask` marks); else the
difference between the conversation rendered up to the turn with the
generation prompt and up to and including the turn (`{content}<|end|>` in
the default template, `{content}<|eot_id|>` in Llama 3's), less whitespace
after its end (ChatML's newline after `<|im_end|>`). A token is trained when
its characters overlap trained text. A template whose renders are not
prefixes of one another (it rewrites earlier turns) is a ConfigError.
Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Mapping, NamedTuple

import numpy as np

from layout_core.errors import ConfigError
from layout_core.tasks import tokenizer as tokens_lib

Messages = list[dict[str, str]]
END = '<|end|>'  # the default template's end of a turn
_PROBE = 'MESHGIN_REPLY'  # an assistant reply whose end of turn `end_of_turn` looks for
_GENERATION_SPANS = 'meshgin_generation_spans'  # the render's record, in the template context


class Rendered(NamedTuple):
  """A conversation's text and the (start, end) characters of its trained text."""
  text: str
  trained: list[tuple[int, int]]


class DefaultTemplate:
  """The default chat template (module doc)."""

  def describe(self) -> str:
    return 'default template'

  def render(self, messages: Messages, *, generation_prompt: bool, where: str) -> str:
    del where  # this template renders every conversation
    text = ''.join(f'<|{m["role"]}|>\n{m["content"]}{END}\n' for m in messages)
    return text + ('<|assistant|>\n' if generation_prompt else '')

  def render_trained(self, messages: Messages, *, where: str) -> Rendered:
    del where  # this template renders every conversation
    text, trained = '', []
    for message in messages:
      text += f'<|{message["role"]}|>\n'
      if message['role'] == 'assistant':
        trained.append((len(text), len(text) + len(message['content'] + END)))
      text += f'{message["content"]}{END}\n'
    return Rendered(text, trained)

  def end_of_turn(self) -> str:
    return END


class JinjaTemplate:
  """A tokenizer's chat template, rendered as `transformers` renders it
  (module doc). `config_path`: the file it was read from; `config`:
  tokenizer_config.json (its special tokens); `source`: the template, else
  config's `chat_template`."""

  def __init__(self, config_path: str, config: Mapping[str, Any], source: Any = None):
    import jinja2  # pylint: disable=g-import-not-at-top
    self.config_path = config_path
    source = config['chat_template'] if source is None else source
    if isinstance(source, list):  # [{'name': 'default', 'template': ...}, ...]
      named = {entry.get('name'): entry.get('template') for entry in source
               if isinstance(entry, dict)}
      source = named.get('default')
    if not isinstance(source, str):
      raise ConfigError(f'the chat_template of {config_path} is not a template string',
                        where=config_path, fix='give a Jinja template string, or remove it '
                                               'to use the default template')
    self.source, self._errors = source, (jinja2.TemplateError,)
    try:
      self.template = _environment().from_string(source)
    except jinja2.TemplateError as e:
      raise ConfigError(f'the chat_template of {config_path} is not valid Jinja ({e})',
                        where=config_path, fix='correct the template') from None
    self.context = template_variables(config)

  def describe(self) -> str:
    return f'chat_template of {self.config_path}'

  def _render(self, messages: Messages, *, generation_prompt: bool, where: str
              ) -> tuple[str, list[tuple[int, int]]]:
    chunks: list[str] = []
    spans: list[tuple[int, int]] = []
    try:
      for chunk in self.template.generate(
          messages=messages, add_generation_prompt=generation_prompt, tools=None,
          documents=None, **self.context, **{_GENERATION_SPANS: (chunks, spans)}):
        chunks.append(chunk)
    except self._errors as e:
      raise ConfigError(f'the chat_template of {self.config_path} fails on the example at '
                        f'{where} ({e})', where=where,
                        fix='correct the example or the template') from None
    return ''.join(chunks), spans

  def render(self, messages: Messages, *, generation_prompt: bool, where: str) -> str:
    return self._render(messages, generation_prompt=generation_prompt, where=where)[0]

  def render_trained(self, messages: Messages, *, where: str) -> Rendered:
    text, marked = self._render(messages, generation_prompt=False, where=where)
    if marked:  # the template's own {% generation %} blocks
      return Rendered(text, marked)
    trained, done = [], ''

    def extend(upto: str, rendered: str) -> str:
      if not upto.startswith(done) or not text.startswith(upto):
        raise ConfigError(
            f'the chat_template of {self.config_path} renders the example at {where} '
            f'differently up to {rendered} than before it (it rewrites earlier turns), so '
            'the assistant tokens cannot be told apart', where=self.config_path,
            fix='use a template whose renders of a conversation\'s first turns are '
                'prefixes of the whole, or remove chat_template to use the default')
      return upto

    for i, message in enumerate(messages):
      if message['role'] == 'assistant':
        done = extend(self.render(messages[:i], generation_prompt=True, where=where),
                      f'the generation prompt of message {i}')
        start = len(done)
        done = extend(self.render(messages[:i + 1], generation_prompt=False, where=where),
                      f'message {i}')
        end = start + len(done[start:].rstrip()) if done[start:].strip() else len(done)
        trained.append((start, end))
    return Rendered(text, trained)

  def end_of_turn(self) -> str:
    """The text after an assistant reply in its trained text ('' if none)."""
    text, trained = self.render_trained(
        [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': _PROBE}],
        where='a probe conversation')
    for start, end in trained:
      reply = text[start:end]
      if _PROBE in reply:
        return reply[reply.index(_PROBE) + len(_PROBE):].strip()
    return ''


def template_variables(config: Mapping[str, Any]) -> dict[str, Any]:
  """The special tokens a template sees, as `transformers` passes them."""
  found = {name: tokens_lib.special_text(config.get(name))
           for name in tokens_lib.SPECIAL_NAMES if tokens_lib.special_text(config.get(name))}
  extra = [tokens_lib.special_text(v) for v in config.get('additional_special_tokens') or []]
  if extra:
    found['additional_special_tokens'] = extra
  return found


def _environment():
  """The Jinja environment of a chat template (module doc)."""
  # pylint: disable=g-import-not-at-top
  import jinja2
  from jinja2 import ext, nodes, sandbox

  class Generation(ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and records
    where that text falls in the whole (the render passes a (chunks, spans)
    pair in its context: the chunks yielded so far, the spans found)."""
    tags = {'generation'}

    def parse(self, parser):
      line = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      call = self.call_method('_record', [nodes.ContextReference()])
      return nodes.CallBlock(call, [], [], body).set_lineno(line)

    def _record(self, context, caller):
      text = caller()
      record = context.get(_GENERATION_SPANS)
      if record is not None:
        chunks, spans = record
        start = sum(len(chunk) for chunk in chunks)
        spans.append((start, start + len(text)))
      return text

  def raise_exception(message):
    raise jinja2.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(format_string):
    return datetime.datetime.now().strftime(format_string)

  environment = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, ext.loopcontrols])
  environment.filters['tojson'] = tojson
  environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
  return environment


def find_template(directory: str | None) -> DefaultTemplate | JinjaTemplate:
  """The chat template of the tokenizer `directory` (module doc), else the default."""
  config = tokens_lib.read_config(directory)
  found = tokens_lib.read_chat_template(directory, config)
  if found is None:
    return DefaultTemplate()
  return JinjaTemplate(found[1], config, found[0])


def tokenize(rendered: Rendered, tokenizer: tokens_lib.Tokenizer
             ) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, loss mask) of a rendered conversation: the whole text
  tokenized at once, a token trained where it overlaps trained text."""
  ids, spans = tokenizer.encode_rendered(rendered.text) if rendered.text else ([], [])
  mask = [int(any(end > lo and start < hi for lo, hi in rendered.trained))
          for start, end in spans]
  return np.asarray(ids, np.int64), np.asarray(mask, np.int32)


def chat_prompt(text: str, *, template: DefaultTemplate | JinjaTemplate,
                tokenizer: tokens_lib.Tokenizer) -> list[int]:
  """The ids a model tuned with `template` answers `text` from: `text` as a
  user turn and the generation prompt (`apply_chat_template(...,
  add_generation_prompt=True)`)."""
  rendered = template.render([{'role': 'user', 'content': text}], generation_prompt=True,
                             where='the prompt')
  return [int(i) for i in tokenizer.encode_rendered(rendered)[0]]


def end_of_turn_ids(template: DefaultTemplate | JinjaTemplate,
                    tokenizer: tokens_lib.Tokenizer) -> list[int]:
  """The ids that end an assistant turn in `template` ([] when it has no end)."""
  text = template.end_of_turn()
  return [int(i) for i in tokenizer.encode_rendered(text)[0]] if text else []
