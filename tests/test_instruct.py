"""The instruction task (layout_core/tasks/instruct.py): the loss covers the
responses only, token by token, with the default and a Jinja chat template;
too-long examples; bad lines; exact resume.

Expected rows are written out here from the texts (the default template's
markers typed by hand), never from the task's own formatting."""

import json

import numpy as np
import pytest
import tensorflow as tf

from layout_core.errors import ConfigError
from layout_core.tasks.instruct import InstructionTask, example_counts
from layout_core.tasks.objective import finish


def write_lines(path, lines):
  with open(path, 'w', encoding='utf-8') as f:
    for line in lines:
      f.write((line if isinstance(line, str) else json.dumps(line)) + '\n')
  return str(path)


def make_task(tmp_path, examples, **settings):
  path = write_lines(tmp_path / 'train.jsonl', examples)
  settings = dict(dict(tokenizer='bytes', vocab_size=256, seq_len=64, shuffle_window=1,
                       num_streams=1), **settings)
  return InstructionTask(train_files=path, eval_files=path, **settings)


def spell(pieces):
  """(byte ids, mask) of [(text, trained), ...]: the expected row by hand."""
  ids, mask = [], []
  for text, trained in pieces:
    data = list(text.encode('utf-8'))
    ids += data
    mask += [int(trained)] * len(data)
  return ids, mask


def user_turn(text):
  return (f'<|user|>\n{text}<|end|>\n', False)


def answer(text):
  return [('<|assistant|>\n', False), (f'{text}<|end|>', True), ('\n', False)]


# -- 1. the loss by hand -------------------------------------------------------------
def test_loss_counts_exactly_the_response_targets(tmp_path):
  task = make_task(tmp_path, [{'prompt': 'two plus two', 'response': 'four'},
                              {'prompt': 'hi', 'response': 'hello there'}],
                   pack=False, seq_len=63)
  batch = next(task.reader(split='train', batch_size=2))
  rows = [('two plus two', 'four'), ('hi', 'hello there')]
  # the response's first byte sits after the prompt text; it and the bytes of
  # 'response<|end|>' are the tokens to predict
  trained_tokens = []
  for prompt, response in rows:
    start = len(f'<|user|>\n{prompt}<|end|>\n<|assistant|>\n')
    trained_tokens.append(range(start, start + len(f'{response}<|end|>')))
  for row, (prompt, response) in enumerate(rows):  # the rows are those texts
    text = bytes(batch['tokens'][row][batch['segments'][row] > 0].astype(np.uint8)).decode()
    assert text == f'<|user|>\n{prompt}<|end|>\n<|assistant|>\n{response}<|end|>\n'

  logits = np.random.default_rng(0).normal(size=(2, 63, 256)).astype(np.float32)
  losses, correct = [], []
  for row in range(2):
    for t in range(63):  # target t is token t + 1
      if t + 1 in trained_tokens[row]:
        label = batch['tokens'][row, t + 1]
        z = logits[row, t].astype(np.float64)
        losses.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[label])
        correct.append(z.argmax() == label)
  assert len(losses) == len('four<|end|>') + len('hello there<|end|>')

  logits_tensor = tf.constant(logits)
  with tf.GradientTape() as tape:
    tape.watch(logits_tensor)
    loss, metrics = finish(task.loss_and_metrics(
        logits_tensor, {k: tf.constant(v) for k, v in batch.items()}))
  np.testing.assert_allclose(float(loss), np.mean(losses), rtol=1e-5)
  np.testing.assert_allclose(float(metrics['accuracy']), np.mean(correct), atol=1e-6)
  assert float(metrics['tokens_trained']) == len(losses)

  gradient = np.abs(tape.gradient(loss, logits_tensor).numpy()).sum(axis=-1)  # [2, 63]
  for row in range(2):
    trained = np.array([t + 1 in trained_tokens[row] for t in range(63)])
    assert (gradient[row][~trained] == 0).all()  # prompt and padding: exactly nothing
    assert (gradient[row][trained] > 0).all()    # control: every response target learns


# -- 2. both forms, packed, token by token ---------------------------------------
CHAT = {'messages': [{'role': 'system', 'content': 'Be brief.'},
                     {'role': 'user', 'content': 'Name a colour.'},
                     {'role': 'assistant', 'content': 'Red.'},
                     {'role': 'user', 'content': 'Another?'},
                     {'role': 'assistant', 'content': 'Blue.'}]}
CHAT_PIECES = ([('<|system|>\nBe brief.<|end|>\n', False), user_turn('Name a colour.')]
               + answer('Red.') + [user_turn('Another?')] + answer('Blue.'))
PAIR = {'prompt': '2+2?', 'response': '4'}
PAIR_PIECES = [user_turn('2+2?')] + answer('4')


def test_both_forms_packed_with_segments_positions_and_mask(tmp_path):
  chat_ids, chat_mask = spell(CHAT_PIECES)
  pair_ids, pair_mask = spell(PAIR_PIECES)
  length = len(chat_ids) + len(pair_ids) + 5  # both fit, 5 tokens of padding
  task = make_task(tmp_path, [CHAT, PAIR], seq_len=length - 1)
  batch = next(task.reader(split='train', batch_size=1))
  assert {k: v.shape for k, v in batch.items()} == {
      k: (1, length) for k in ('tokens', 'segments', 'positions', 'loss_mask')}
  pad = [0] * 5
  assert batch['tokens'][0].tolist() == chat_ids + pair_ids + pad
  assert batch['loss_mask'][0].tolist() == chat_mask + pair_mask + pad
  assert batch['segments'][0].tolist() == [1] * len(chat_ids) + [2] * len(pair_ids) + pad
  assert batch['positions'][0].tolist() == (list(range(len(chat_ids))) +
                                            list(range(len(pair_ids))) + pad)
  # the trained bytes spell the two answers of the chat, then the pair's
  trained = bytes(np.asarray(chat_ids + pair_ids, np.uint8)[
      np.asarray(chat_mask + pair_mask, bool)]).decode()
  assert trained == 'Red.<|end|>Blue.<|end|>4<|end|>'
  assert task.needs_segments and task.sequence_inputs(batch)[0].shape == (1, length - 1)


def test_unpacked_rows_hold_one_example_each(tmp_path):
  chat_ids, chat_mask = spell(CHAT_PIECES)
  pair_ids, pair_mask = spell(PAIR_PIECES)
  length = len(chat_ids) + 3
  task = make_task(tmp_path, [CHAT, PAIR], seq_len=length - 1, pack=False)
  assert not task.needs_segments
  batch = next(task.reader(split='train', batch_size=2))
  rest = length - len(pair_ids)
  assert batch['tokens'].tolist() == [chat_ids + [0] * 3, pair_ids + [0] * rest]
  assert batch['loss_mask'].tolist() == [chat_mask + [0] * 3, pair_mask + [0] * rest]
  assert batch['segments'].tolist() == [[1] * len(chat_ids) + [0] * 3,
                                        [1] * len(pair_ids) + [0] * rest]


# -- 3. a Jinja chat template and a tokenizer.json ----------------------------------
LLAMA_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
SPECIALS = ['<|begin_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>']
WORDS = ['[UNK]', 'system', 'user', 'assistant', 'be', 'brief', 'name', 'a', 'colour',
         'red', 'another', 'blue', 'please']


def hf_tokenizer_dir(tmp_path, template):
  from tokenizers import Tokenizer, models, pre_tokenizers, processors  # pylint: disable=g-import-not-at-top
  vocab = {word: i for i, word in enumerate(WORDS)}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.add_special_tokens(SPECIALS)
  # `encode` adds a BOS, as Llama 3's does: one per piece would show in the row
  tokenizer.post_processor = processors.TemplateProcessing(
      single='<|begin_of_text|> $A', special_tokens=[('<|begin_of_text|>', len(WORDS))])
  directory = tmp_path / 'tok'
  directory.mkdir()
  tokenizer.save(str(directory / 'tokenizer.json'))
  (directory / 'tokenizer_config.json').write_text(json.dumps(
      {'bos_token': '<|begin_of_text|>', 'eos_token': {'content': '<|eot_id|>'},
       'chat_template': template}))
  ids = dict(vocab, **{s: len(WORDS) + i for i, s in enumerate(SPECIALS)})
  return str(directory), ids


def test_jinja_chat_template_masks_exactly_the_assistant_content(tmp_path):
  directory, ids = hf_tokenizer_dir(tmp_path, LLAMA_LIKE)
  chat = {'messages': [{'role': 'system', 'content': 'be brief'},
                       {'role': 'user', 'content': 'name a colour'},
                       {'role': 'assistant', 'content': 'red'},
                       {'role': 'user', 'content': 'another please'},
                       {'role': 'assistant', 'content': 'blue'}]}
  task = make_task(tmp_path, [chat], tokenizer=directory, vocab_size=32, seq_len=40,
                   pack=False)
  assert 'tokenizer_config.json' in task.describe()
  batch = next(task.reader(split='train', batch_size=1))
  bot, start, end, eot = (ids[s] for s in SPECIALS)

  def header(role):
    return [start, ids[role], end]

  expected = ([(t, 0) for t in [bot] + header('system') + [ids['be'], ids['brief'], eot]
               + header('user') + [ids['name'], ids['a'], ids['colour'], eot]
               + header('assistant')]
              + [(ids['red'], 1), (eot, 1)]
              + [(t, 0) for t in header('user') + [ids['another'], ids['please'], eot]
                 + header('assistant')]
              + [(ids['blue'], 1), (eot, 1)])
  n = len(expected)
  assert batch['tokens'][0, :n].tolist() == [t for t, _ in expected]
  assert batch['loss_mask'][0, :n].tolist() == [m for _, m in expected]
  assert not batch['segments'][0, n:].any()


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
  reversed_turns = ("{% for message in messages | reverse %}{{ message['content'] + ' ' }}"
                    "{% endfor %}")
  directory, _ = hf_tokenizer_dir(tmp_path, reversed_turns)
  task = make_task(tmp_path, [{'messages': [{'role': 'user', 'content': 'red'},
                                            {'role': 'assistant', 'content': 'blue'}]}],
                   tokenizer=directory, vocab_size=32, seq_len=16)
  with pytest.raises(ConfigError, match='rewrites earlier turns'):
    next(task.reader(split='train', batch_size=1))


# -- 4. too long, bad lines ---------------------------------------------------------
def test_too_long_examples_are_cut_or_dropped_and_counted(tmp_path):
  short, long = {'prompt': 'a', 'response': 'b'}, {'prompt': 'x' * 50, 'response': 'y'}
  short_ids, short_mask = spell([user_turn('a')] + answer('b'))
  long_ids, _ = spell([user_turn('x' * 50)] + answer('y'))
  length = len(short_ids) + 4  # a short one fits; a long one does not
  assert len(long_ids) > length
  examples = [short, long, short]

  cut = make_task(tmp_path, examples, seq_len=length - 1, pack=False)
  reader = cut.reader(split='train', batch_size=3)
  batch = next(reader)
  assert batch['tokens'][1].tolist() == long_ids[:length]  # the first seq_len + 1 tokens
  assert not batch['loss_mask'][1].any()   # its response was past the cut
  assert batch['tokens'][2].tolist() == short_ids + [0] * 4
  assert example_counts(reader) == {'examples': 3, 'cut': 1, 'dropped': 0}

  dropped = make_task(tmp_path, examples, seq_len=length - 1, pack=False, too_long='drop')
  reader = dropped.reader(split='train', batch_size=2)
  batch = next(reader)  # the long one is left out: the two short ones
  assert batch['tokens'].tolist() == [short_ids + [0] * 4] * 2
  assert batch['loss_mask'].tolist() == [short_mask + [0] * 4] * 2
  assert example_counts(reader) == {'examples': 3, 'cut': 0, 'dropped': 1}

  with pytest.raises(ConfigError, match="too_long is 'split'"):
    make_task(tmp_path, examples, too_long='split')


def test_trained_targets_count_the_answer_bytes_left_in_each_row(tmp_path):
  """`trained_targets` (the host-side count the checks use) against the
  answers' bytes counted from the texts: an answer starts where the text up
  to it ends, and a cut row keeps the bytes of it below seq_len + 1."""
  examples = [{'prompt': 'two plus two', 'response': 'four'},
              {'prompt': 'x' * 30, 'response': 'a long answer'},
              {'prompt': 'x' * 70, 'response': 'never seen'}]
  length = 64
  task = make_task(tmp_path, examples, pack=False, seq_len=length - 1)
  expected = []
  for example in examples:
    start = len(f'<|user|>\n{example["prompt"]}<|end|>\n<|assistant|>\n')
    end = start + len(f'{example["response"]}<|end|>')
    expected.append(max(0, min(end, length) - start))
  assert expected[1] > 0 and expected[1] < len('a long answer<|end|>') and expected[2] == 0
  batch = next(task.reader(split='train', batch_size=3))
  assert [task.trained_targets({k: v[row:row + 1] for k, v in batch.items()})
          for row in range(3)] == expected
  assert task.trained_targets(batch) == sum(expected)


def test_a_run_that_would_train_nothing_is_refused_and_a_later_batch_is_warned(
    tmp_path, caplog):
  """The first batch of either split with no trained token: a ConfigError
  naming instruct.seq_len, the rows cut and the seq_len that keeps them. A
  later train batch with none: counted and warned about as it is read."""
  from layout_core.train.trained_tokens import UntrainedBatches, check_first_batches  # pylint: disable=g-import-not-at-top
  long = {'prompt': 'x' * 30, 'response': 'yes'}     # 72 bytes, answer from byte 61
  short = {'prompt': 'a', 'response': 'b'}           # 41 bytes, answer from byte 32
  all_long = make_task(tmp_path, [long] * 3, pack=False, seq_len=40)
  with pytest.raises(ConfigError) as error:
    check_first_batches(all_long, batch_size=2)
  text = ' '.join(str(error.value).split())
  assert 'the first train batch (2 rows) holds no trained token' in text
  assert '2 of the 2 example(s) read so far were longer than a row' in text
  assert 'instruct.seq_len = 40: 41 tokens' in text
  assert error.value.where == 'instruct.seq_len'
  assert 'set instruct.seq_len >= 71 (the longest example read is 72 tokens)' in text

  eval_path = write_lines(tmp_path / 'eval.jsonl', [long] * 2)
  train_path = write_lines(tmp_path / 'short.jsonl', [short] * 2)
  eval_only = InstructionTask(train_files=train_path, eval_files=eval_path, tokenizer='bytes',
                              vocab_size=256, seq_len=40, pack=False, num_streams=1)
  with pytest.raises(ConfigError, match='the first eval batch .* its eval loss would be 0'):
    check_first_batches(eval_only, batch_size=2)
  fits = make_task(tmp_path, [long] * 3, pack=False, seq_len=71)
  check_first_batches(fits, batch_size=2)  # control: the suggested seq_len trains

  later = make_task(tmp_path, [short, long, short], pack=False, seq_len=40)
  reader = later.reader(split='train', batch_size=1)
  watch = UntrainedBatches(later)
  caplog.set_level('WARNING')
  warnings = []
  for step in range(3):
    caplog.clear()
    watch.see(step=step, batch=next(reader), reader=reader)
    warnings.append([r.getMessage() for r in caplog.records
                     if 'no trained token' in r.getMessage()])
  assert [len(w) for w in warnings] == [0, 1, 0] and watch.count == 1
  text = ' '.join(warnings[1][0].split())
  assert 'the rows of the train batch of step 2 this process read hold no trained token' in text
  assert '1 of the 2 example(s) read so far were longer than a row' in text
  assert 'set instruct.seq_len >= 71' in text


def test_launch_train_refuses_a_seq_len_that_cuts_every_answer(tmp_path):
  """instruct_tiny with instruct.seq_len = 32: each answer starts at byte 35,
  so nothing would train (it used to run with |g| 0.000, eval loss 0 and end
  in a ZeroDivisionError). Exit 2 before training, model_dir not created."""
  from tests.conftest import run_module  # pylint: disable=g-import-not-at-top
  lines = [{'prompt': f'{a}+{b}=', 'response': str(a + b)} for a in range(4) for b in range(4)]
  model_dir = tmp_path / 'run'
  result = run_module(
      'launch.train', '--gin_file=configs/experiments/instruct_tiny.gin',
      f'--gin_bindings=instruct.train_files = "{write_lines(tmp_path / "t.jsonl", lines)}"',
      f'--gin_bindings=instruct.eval_files = "{write_lines(tmp_path / "e.jsonl", lines)}"',
      '--gin_bindings=instruct.seq_len = 32', '--gin_bindings=train.num_steps = 2',
      f'--model_dir={model_dir}')
  assert result.returncode == 2, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr and 'Training steps' not in result.stderr
  message = ' '.join(result.stderr[result.stderr.index('Configuration error:'):].split())
  assert 'the first train batch' in message and 'holds no trained token' in message, message
  assert 'instruct.seq_len = 32: 33 tokens' in message, message
  assert 'example(s) read so far were longer than a row' in message, message
  assert 'set instruct.seq_len >= 43' in message, message  # '<|user|>\n0+0=...0<|end|>\n'
  assert not model_dir.exists()


def test_packing_without_segment_attention_names_instruct_pack(tmp_path):
  """The packing refusal names the setting under the task in use."""
  from layout_core.run.planning import check_segments_supported  # pylint: disable=g-import-not-at-top
  task = make_task(tmp_path, [{'prompt': 'a', 'response': 'b'}], pack=True)
  with pytest.raises(ConfigError) as error:
    check_segments_supported(object(), task, pipelined=True)
  text = str(error.value)
  assert 'instruct.pack = True' in text and 'set instruct.pack = False' in text, text
  assert error.value.where == 'instruct.pack' and 'lm_corpus' not in text
  check_segments_supported(object(), make_task(tmp_path, [], pack=False), pipelined=True)


@pytest.mark.parametrize('line,why', [
    ('{"prompt": "a", "response": ', 'is not JSON'),
    ('{"prompt": "a"}', 'needs string "prompt" and "response"'),
    ('{"question": "a", "answer": "b"}', 'has neither "messages"'),
    ('{"messages": [{"role": "robot", "content": "a"}]}', "message 0 has role 'robot'"),
    ('{"messages": [{"role": "user", "content": "a"}]}', 'has no assistant turn'),
    ('{"messages": []}', 'has "messages" that is not a non-empty list'),
    ('', 'is empty'),
    ('[1, 2]', 'holds a list'),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, why):
  good = json.dumps({'prompt': 'a', 'response': 'b'})
  path = write_lines(tmp_path / 'bad.jsonl', [good, good, line, good])
  with pytest.raises(ConfigError) as error:
    InstructionTask(train_files=str(tmp_path / '*.jsonl'), eval_files=path,
                    tokenizer='bytes', vocab_size=256).check_data()
  assert f'{path}:3 {why}' in str(error.value)
  assert 'Fix: write one JSON object per line' in str(error.value)


def test_the_files_are_read_only_for_the_splits_a_plan_checks(tmp_path):
  """Making the task reads no file (decode and export plan it so); eval
  checks its split alone; training checks both, every line."""
  good = write_lines(tmp_path / 'eval.jsonl', [{'prompt': 'a', 'response': 'b'}])
  bad = write_lines(tmp_path / 'train.jsonl', ['{"prompt": "a"}'])
  task = InstructionTask(train_files=str(tmp_path / 'gone-*.jsonl'), eval_files=good,
                         tokenizer='bytes', vocab_size=256)
  task.check_data(())
  task.check_data(('eval',))
  assert 'eval 1 file(s) (1 examples)' in task.describe()
  with pytest.raises(ConfigError, match="no file matches the train pattern '.*gone-"):
    task.check_data()
  with pytest.raises(ConfigError, match=f'{bad}:1 needs string'):  # control: lines are read
    InstructionTask(train_files=bad, eval_files=good, tokenizer='bytes',
                    vocab_size=256).check_data()


def test_a_token_outside_the_vocabulary_names_the_example(tmp_path):
  path = write_lines(tmp_path / 'train.jsonl', [{'prompt': 'a', 'response': 'b'},
                                                {'prompt': 'a', 'response': 'caf\u00e9'}])
  task = InstructionTask(train_files=path, eval_files=path, tokenizer='bytes',
                         vocab_size=128, num_streams=1, shuffle_window=1, seq_len=16)
  reader = task.reader(split='train', batch_size=1)
  next(reader)  # control: the first example is ASCII and fits the vocabulary
  with pytest.raises(ConfigError, match=f'{path}:2 has token id 195'):
    next(reader)


# -- 5. resume -----------------------------------------------------------------------
def test_a_reader_from_the_saved_state_continues_exactly(tmp_path):
  rng = np.random.default_rng(3)
  words = ['alpha', 'beta', 'gamma', 'delta', 'epsilon']
  for shard in range(2):
    write_lines(tmp_path / f'train-{shard}.jsonl', [
        {'prompt': ' '.join(rng.choice(words, rng.integers(1, 6))),
         'response': ' '.join(rng.choice(words, rng.integers(1, 6)))} for _ in range(9)])
  task = InstructionTask(train_files=str(tmp_path / 'train-*.jsonl'),
                         eval_files=str(tmp_path / 'train-*.jsonl'), tokenizer='bytes',
                         vocab_size=256, seq_len=60, shuffle_window=4)
  reader = task.reader(split='train', batch_size=2)
  first = [next(reader) for _ in range(3)]
  state = json.loads(json.dumps(reader.state()))  # as data_state.json keeps it
  fourth = next(reader)
  resumed = next(task.reader(split='train', batch_size=2, start_step=3, state=state))
  for name in fourth:
    np.testing.assert_array_equal(resumed[name], fourth[name], err_msg=name)
  # control: the state matters (a fresh reader gives another batch)
  assert not np.array_equal(first[0]['tokens'], fourth['tokens'])
  with pytest.raises(ConfigError, match='needs the data position'):
    task.reader(split='train', batch_size=2, start_step=3)


def test_a_chat_prompt_is_what_training_saw_before_the_answer(tmp_path):
  """`launch.decode --chat` encodes a prompt as `chat_prompt` does: the user
  turn and the generation prompt, the exact ids a trained row holds before
  its first response token (the default template on bytes, and a Llama-like
  Jinja template with a BOS-adding tokenizer). The run's tokenizer is the
  task's own."""
  from layout_core.infer.tokens import tokenizer_for  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.instruct import chat_prompt  # pylint: disable=g-import-not-at-top
  directory, _ = hf_tokenizer_dir(tmp_path, LLAMA_LIKE)
  for settings, prompt in ((dict(), 'add 2 and 3'), (dict(tokenizer=directory, vocab_size=32),
                                                     'name a colour')):
    example = {'prompt': prompt, 'response': 'red'}
    task = make_task(tmp_path, [example], pack=False, **settings)
    assert tokenizer_for(task) is task.tokenizer
    row = next(task.reader(split='train', batch_size=1))
    first_trained = int(np.argmax(row['loss_mask'][0]))
    assert row['loss_mask'][0, first_trained] == 1
    ids = chat_prompt(prompt, template=task.template, tokenizer=task.tokenizer)
    assert ids == row['tokens'][0, :first_trained].tolist()
  assert bytes(chat_prompt('hi', template=make_task(tmp_path, [example]).template,
                           tokenizer=tokenizer_for(make_task(tmp_path, [example])))
               ) == b'<|user|>\nhi<|end|>\n<|assistant|>\n'
