"""Chat tokens (layout_core/tasks/chat.py, tokenizer.py) against `transformers`.

For each template a tiny tokenizer directory is built in the test (a
tokenizers `tokenizer.json`, or a SentencePiece `tokenizer.model` trained
here on a few hundred bytes) and meshgin's ids must equal
`AutoTokenizer.from_pretrained(dir).apply_chat_template(messages,
tokenize=True)` exactly. The trained tokens are checked by hand: one run of
tokens per assistant turn, which spells the reply and the end-of-turn token
written out here, nothing else; where the template has `{% generation %}`
blocks, also against `transformers`' `return_assistant_tokens_mask`.
"""

import json
import os

import numpy as np
import pytest

from layout_core.errors import ConfigError
from layout_core.tasks import chat
from layout_core.tasks.instruct import find_tokenizer

transformers = pytest.importorskip('transformers')

CONVERSATION = [{'role': 'system', 'content': 'Be brief.'},
                {'role': 'user', 'content': 'Name a colour.'},
                {'role': 'assistant', 'content': 'Red, the colour.'},
                {'role': 'user', 'content': 'Another <b>one</b>? héllo'},
                {'role': 'assistant', 'content': 'Blue  wörld.'}]
NO_SYSTEM = CONVERSATION[1:]
# What the tokenizers are trained on: the conversations' text and a little more.
TEXT = [m['content'] for m in CONVERSATION] + (
    'the quick brown fox jumps over the lazy dog. name a colour: red, blue, green. '
    'be brief please. another one? héllo wörld, two  spaces and a tab\there. '
    '{"role": "user"} <b>bold</b> assistant system').split('. ')

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}")
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}")
# {% generation %}, loop controls, tojson (non-ASCII and '<' kept), a pad_token variable.
MARKED = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>' + (message | tojson) + pad_token }}{% continue %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|assistant|>\n' }}{% generation %}"
    "{{ message['content'] + eos_token }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|user|>\n' + message['content'] + eos_token + '\n' }}{% endif %}"
    "{% if loop.index >= 5 %}{% break %}{% endif %}{% endfor %}"
    "{{ {'n': messages | length, 'é': '<'} | tojson(indent=1, sort_keys=True) }}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def byte_level_dir(directory, specials, config):
  """A byte-level BPE tokenizer.json (Llama 3's and Qwen2's kind) with `specials` added."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(TEXT * 3, trainer=trainer)
  return save(directory, tokenizer, config)


def metaspace_dir(directory, config):
  """A Metaspace BPE tokenizer.json with BOS added by `encode` (Mistral's kind)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # pylint: disable=g-import-not-at-top
  tokenizer = Tokenizer(models.BPE(unk_token='<unk>', byte_fallback=True))
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme='first', split=False)
  tokenizer.decoder = decoders.Metaspace(prepend_scheme='first', split=False)
  trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=['<unk>', '<s>', '</s>'],
                                show_progress=False)
  tokenizer.train_from_iterator(TEXT * 3, trainer=trainer)
  tokenizer.post_processor = processors.TemplateProcessing(single='<s> $A',
                                                           special_tokens=[('<s>', 1)])
  return save(directory, tokenizer, config)


def save(directory, tokenizer, config):
  os.makedirs(directory)
  tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', **config}, f)
  return str(directory)


def sentencepiece_dir(directory, config):
  """A SentencePiece BPE `tokenizer.model` (byte fallback, as Llama 2's), no tokenizer.json."""
  import io  # pylint: disable=g-import-not-at-top
  import sentencepiece  # pylint: disable=g-import-not-at-top
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(TEXT * 4), model_writer=model, vocab_size=340, model_type='bpe',
      byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
      minloglevel=2)
  os.makedirs(directory)
  with open(os.path.join(directory, 'tokenizer.model'), 'wb') as f:
    f.write(model.getvalue())
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'LlamaTokenizer', 'add_bos_token': True,
               'add_eos_token': False, 'legacy': False, **config}, f)
  return str(directory)


LLAMA3_SPECIALS = ['<|begin_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>']
CASES = {
    # name: (build(directory), messages, an assistant turn's trained text by hand, its end)
    'llama3': (lambda d: byte_level_dir(d, LLAMA3_SPECIALS, {
        'bos_token': '<|begin_of_text|>', 'eos_token': '<|eot_id|>', 'chat_template': LLAMA3}),
               CONVERSATION, lambda reply: reply.strip() + '<|eot_id|>', '<|eot_id|>'),
    'chatml': (lambda d: byte_level_dir(d, ['<|endoftext|>', '<|im_start|>', '<|im_end|>'], {
        'bos_token': None, 'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>',
        'chat_template': CHATML}), NO_SYSTEM, lambda reply: reply + '<|im_end|>', '<|im_end|>'),
    'mistral': (lambda d: metaspace_dir(d, {
        'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>', 'chat_template': MISTRAL}),
                NO_SYSTEM, lambda reply: reply + '</s>', '</s>'),
    'marked': (lambda d: byte_level_dir(d, ['<|system|>', '<|user|>', '<|assistant|>', '</s>',
                                            '<pad>'], {
        'eos_token': '</s>', 'pad_token': '<pad>', 'chat_template': MARKED}),
               CONVERSATION, lambda reply: reply + '</s>', '</s>'),
    'sentencepiece': (lambda d: sentencepiece_dir(d, {
        'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>', 'chat_template': LLAMA2}),
                      CONVERSATION, lambda reply: ' ' + reply.strip() + ' </s>', '</s>'),
}


@pytest.fixture(scope='module', params=sorted(CASES))
def case(request, tmp_path_factory):
  build, messages, trained_text, end = CASES[request.param]
  directory = build(tmp_path_factory.mktemp('chat') / request.param)
  reference = transformers.AutoTokenizer.from_pretrained(directory)
  tokenizer, found = find_tokenizer(directory)
  return dict(name=request.param, reference=reference, tokenizer=tokenizer,
              template=chat.find_template(found), messages=messages, trained_text=trained_text,
              end=end)


def reference_ids(reference, messages, **settings):
  return list(reference.apply_chat_template(messages, tokenize=True, return_dict=False,
                                            **settings))


def test_rendered_ids_equal_transformers(case):
  reference, template = case['reference'], case['template']
  rendered = template.render_trained(case['messages'], where='the test')
  assert rendered.text == reference.apply_chat_template(case['messages'], tokenize=False)
  ids, mask = chat.tokenize(rendered, case['tokenizer'])
  expected = reference_ids(reference, case['messages'])
  assert ids.tolist() == expected
  # a control: the end-of-turn token's text became its one id, once per turn at least
  assert expected.count(reference.convert_tokens_to_ids(case['end'])) >= 2


def test_the_mask_is_each_reply_and_its_end_of_turn(case):
  reference, messages = case['reference'], case['messages']
  ids, mask = chat.tokenize(case['template'].render_trained(messages, where='the test'),
                            case['tokenizer'])
  runs, start = [], None
  for index, bit in enumerate(list(mask) + [0]):
    if bit and start is None:
      start = index
    if not bit and start is not None:
      runs.append(ids[start:index].tolist())
      start = None
  replies = [m['content'] for m in messages if m['role'] == 'assistant']
  assert len(runs) == len(replies)
  for run, reply in zip(runs, replies):
    # (spaces aside: some decoders drop a ▁ that is not at the start)
    text = reference.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert text.split() == case['trained_text'](reply).split() or (
        ''.join(text.split()) == ''.join(case['trained_text'](reply).split())), text
  assert mask.sum() == sum(len(run) for run in runs) and mask.sum() < len(mask) / 2
  if '{% generation %}' in case['template'].source:
    marked = reference.apply_chat_template(messages, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
    assert mask.tolist() == list(marked['assistant_masks'])


def test_a_chat_prompt_and_the_end_of_turn(case):
  reference, tokenizer, template = case['reference'], case['tokenizer'], case['template']
  user = [m for m in case['messages'] if m['role'] != 'assistant'][:2]
  if case['name'] in ('mistral', 'sentencepiece'):  # templates that take user turns alone
    user = user[-1:]
  prompt = chat.chat_prompt(user[-1]['content'], template=template, tokenizer=tokenizer)
  assert prompt == reference_ids(reference, user[-1:], add_generation_prompt=True)
  assert chat.end_of_turn_ids(template, tokenizer) == [
      reference.convert_tokens_to_ids(case['end'])]


def test_plain_encode_and_special_tokens_equal_transformers(case):
  reference, tokenizer = case['reference'], case['tokenizer']
  for text in ('héllo wörld', ' two  spaces\tand</s> more', 'the quick'):
    assert tokenizer.encode(text) == reference(text).input_ids, text
  for token, index in reference.get_added_vocab().items():
    assert tokenizer.token_id(token) == index
  assert tokenizer.token_id('the') is None


def test_a_template_error_names_the_example(tmp_path):
  directory = metaspace_dir(tmp_path / 'tok', {'bos_token': '<s>', 'eos_token': '</s>',
                                               'chat_template': MISTRAL})
  template = chat.find_template(directory)
  with pytest.raises(ConfigError, match='fails on the example at f.jsonl:2.*must alternate'):
    template.render_trained([{'role': 'user', 'content': 'a'}] * 2, where='f.jsonl:2')


def test_sentencepiece_spans_cover_whole_characters(tmp_path):
  directory = sentencepiece_dir(tmp_path / 'sp', {'bos_token': '<s>', 'eos_token': '</s>'})
  tokenizer, _ = find_tokenizer(directory)
  text = 'héllo ☃</s> x'
  ids, spans = tokenizer.encode_rendered(text)
  assert len(ids) == len(spans) and spans[0][0] == 0 and spans[-1][1] == len(text)
  assert all(start < end for start, end in spans)
  assert [text[s:e] for (s, e), i in zip(spans, ids) if i == 2] == ['</s>']
  assert np.all(np.diff([s for s, _ in spans]) >= 0)


@pytest.mark.parametrize('legacy', [True, False])
def test_a_sentencepiece_folder_reads_its_legacy_setting_as_transformers(legacy, tmp_path):
  """`legacy: true` puts a ▁ before the text after every special token (the
  'always' scheme), false only before the text's start: both as transformers."""
  directory = sentencepiece_dir(tmp_path / 'sp', {'bos_token': '<s>', 'eos_token': '</s>',
                                                  'legacy': legacy})
  tokenizer, _ = find_tokenizer(directory)
  text = '<s>[INST] hello there[/INST] ok</s> again'
  expected = transformers.AutoTokenizer.from_pretrained(directory)(text, add_special_tokens=False)
  assert tokenizer.encode_rendered(text)[0] == expected['input_ids']


def test_a_corpus_sentencepiece_model_encodes_pieces_as_its_own_encode(tmp_path):
  """A corpus's spm.model (no ▁ in front: add_dummy_prefix off) gives the
  ids of `encode` for plain text: a --stop of '\n' stays that one token."""
  from layout_core.tasks import prepare  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.tokenizer import SentencePieceTokenizer  # pylint: disable=g-import-not-at-top
  lines = ['The cat sat on the mat.', 'return x', 'We went to the shop.'] * 50
  tokenizer = SentencePieceTokenizer(prepare.train_sentencepiece(
      documents=['\n'.join(lines)], model_prefix=str(tmp_path / 'spm'), vocab_size=120))
  for text in ('\n', 'return', 'The cat sat.'):
    assert tokenizer.encode_rendered(text)[0] == tokenizer.encode(text), text


def test_a_chat_template_jinja_file_is_read_as_transformers_reads_it(tmp_path):
  """transformers 5 saves the template as chat_template.jinja, not in
  tokenizer_config.json; the file wins over the config's entry, as it does
  in `AutoTokenizer.from_pretrained`."""
  from layout_core.convert import hf_tokens  # pylint: disable=g-import-not-at-top
  directory = byte_level_dir(tmp_path / 'jinja', ['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
                             {'bos_token': None, 'eos_token': '<|endoftext|>',
                              'pad_token': '<|endoftext|>'})
  with open(os.path.join(directory, 'chat_template.jinja'), 'w', encoding='utf-8') as f:
    f.write(CHATML)
  reference = transformers.AutoTokenizer.from_pretrained(directory)
  tokenizer, found = find_tokenizer(directory)
  template = chat.find_template(found)
  assert template.config_path.endswith('chat_template.jinja')
  rendered = template.render_trained(NO_SYSTEM, where='the test')
  assert rendered.text == reference.apply_chat_template(NO_SYSTEM, tokenize=False)
  assert chat.tokenize(rendered, tokenizer)[0].tolist() == reference_ids(reference, NO_SYSTEM)
  assert chat.chat_prompt('Name a colour.', template=template, tokenizer=tokenizer) == \
      reference_ids(reference, NO_SYSTEM[:1], add_generation_prompt=True)
  im_end = reference.convert_tokens_to_ids('<|im_end|>')
  assert chat.end_of_turn_ids(template, tokenizer) == [im_end]
  assert im_end in hf_tokens.special_ids(directory)['end_of_turn']
  # a tokenizer_config.json entry beside the file: the file still wins, as in transformers
  config_path = os.path.join(directory, 'tokenizer_config.json')
  with open(config_path) as f:
    config = json.load(f)
  with open(config_path, 'w') as f:
    json.dump({**config, 'chat_template': MARKED}, f)
  reference = transformers.AutoTokenizer.from_pretrained(directory)
  assert chat.find_template(found).render(NO_SYSTEM, generation_prompt=False, where='t') == \
      reference.apply_chat_template(NO_SYSTEM, tokenize=False)
  # without the file, the config's entry; a processor's chat_template.json last
  os.remove(os.path.join(directory, 'chat_template.jinja'))
  assert chat.find_template(found).source == MARKED
  with open(config_path, 'w') as f:
    json.dump(config, f)
  with open(os.path.join(directory, 'chat_template.json'), 'w') as f:
    json.dump({'chat_template': CHATML}, f)
  assert chat.find_template(found).source == CHATML


def test_a_stop_text_reads_its_escapes_and_a_broken_one_is_named():
  """--stop='\\n' is a newline, other characters stay as written (here outside
  latin-1), and a lone trailing backslash is a ConfigError naming --stop."""
  from layout_core.infer.stops import parse_stops  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.tokenizer import ByteTokenizer  # pylint: disable=g-import-not-at-top
  ids, sequences = parse_stops(['你\\n'], ByteTokenizer())
  assert (ids + [i for s in sequences for i in s]) == list('你\n'.encode())
  with pytest.raises(ConfigError) as broken:
    parse_stops(['end\\'], ByteTokenizer())
  assert '--stop' in str(broken.value) and 'backslash' in str(broken.value)
