"""lm-eval over a meshgin LM (`plugins.lm_eval`), against independent references.

The references: the model's own logits (one `CachedLM.logits` call per
window, unpadded, its log-softmax read at each continuation token) over the
windows lm-eval's own code defines (its HF model's left truncation, and
`lm_eval.utils.get_rolling_token_windows` for rolling), not the adapter's
windows, padding or batches; greedy `CachedLM.generate` cut at the stop
string by hand; and the same model on one device without DTensor. The weights are random with a wide spread, so
scores differ clearly between texts. `launch.lm_eval` runs the local tasks of
tests/fixtures/lm_eval_task end to end on a briefly trained bytes run (slow).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import tensorflow as tf

pytest.importorskip('lm_eval')

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from layout_core.checkpoint.shard_io import assign_global  # noqa: E402
from layout_core.errors import ConfigError  # noqa: E402
from layout_core.infer.decode import DONE, CachedLM  # noqa: E402
from layout_core.infer.tokens import (ByteTokenizer, IdTokenizer,  # noqa: E402
                                      SentencePieceTokenizer)
from layout_core.layout.rules import LayoutRules  # noqa: E402
from layout_core.layout.variables import to_numpy  # noqa: E402
from layout_core.model.built import build_params_model  # noqa: E402
from layout_core.model.lm import transformer_lm_params  # noqa: E402
from layout_core.tasks import prepare  # noqa: E402
from plugins.lm_eval import HarnessLM, scoring_windows  # noqa: E402
from tests.conftest import TWO_DEVICES, run_module  # noqa: E402

MAX_LEN = 32
PARAMS = transformer_lm_params(vocab_size=256, model_dim=32, num_heads=4, ffn_dim=64,
                               num_layers=2, max_len=MAX_LEN)
TASKS = 'tests/fixtures/lm_eval_task'


def random_values(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  values = {}
  for spec in PARAMS.cls.variable_specs(PARAMS):
    name = spec.path.rsplit('/', 1)[1]
    scale = 0.1 if len(spec.shape) == 1 else 0.5
    values[spec.path] = ((1.0 if name == 'scale' else 0.0)
                         + scale * rng.standard_normal(spec.shape)).astype(np.float32)
  return values


@pytest.fixture(scope='module')
def values():
  return random_values()


@pytest.fixture(scope='module')
def plain(values):
  return CachedLM(PARAMS, {path: tf.Variable(v) for path, v in values.items()})


@pytest.fixture(scope='module')
def harness(plain):
  return HarnessLM(plain, ByteTokenizer(), batch_size=4)


def request(kind: str, *args) -> Instance:
  return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def reference_scores(lm: CachedLM, windows) -> tuple[float, bool]:
  """Sum of log-softmax at each window's continuation, read from the model's
  logits over the window alone (context + continuation, less its last token),
  and whether every continuation token is the most likely one."""
  total, greedy = 0.0, True
  for context, continuation in windows:
    tokens = list(context) + list(continuation)
    assert len(tokens) - 1 <= MAX_LEN
    logits = to_numpy(lm.logits(np.array([tokens[:-1]], np.int32)))[0]
    scores = tf.nn.log_softmax(logits[len(context) - 1:], axis=-1).numpy()
    total += float(sum(scores[i, t] for i, t in enumerate(continuation)))
    greedy &= all(int(scores[i].argmax()) == t for i, t in enumerate(continuation))
  return total, greedy


def lm_eval_windows(context: list[int], continuation: list[int]):
  """The windows lm-eval's own models score: the text truncated on the left
  to max_len + 1 tokens (its HF model's loglikelihood), or, for a longer
  continuation, lm-eval's rolling windows after the context's last token."""
  if len(continuation) <= MAX_LEN:
    tokens = (context + continuation)[-(MAX_LEN + 1):]
    return [(tokens[:-len(continuation)], continuation)]
  return [make_disjoint_window(w) for w in get_rolling_token_windows(
      token_list=continuation, prefix_token=context[-1], max_seq_len=MAX_LEN, context_len=1)]


# -- loglikelihood and rolling ----------------------------------------------------------
PAIRS = [('The cat sat on the', ' mat'), ('The cat sat on the', ' sky'),
         ('A dog ran', ' to the park and back again'), ('', 'hello'),
         ('x', 'y' * 70)]  # a continuation longer than max_len: three windows


def test_loglikelihood_equals_the_models_own_log_softmax(plain, harness):
  got = harness.loglikelihood([request('loglikelihood', c, x) for c, x in PAIRS])
  for (context, continuation), (score, greedy) in zip(PAIRS, got):
    want, want_greedy = reference_scores(plain, lm_eval_windows(
        list((context or '\n').encode()), list(continuation.encode())))
    assert math.isclose(score, want, rel_tol=1e-5, abs_tol=1e-3), (context, continuation)
    assert greedy == want_greedy
  # positive controls: the continuation and the context both move the score
  assert abs(got[0][0] - got[1][0]) > 0.1
  other = harness.loglikelihood([request('loglikelihood', 'Some other words,', ' mat')])
  assert abs(other[0][0] - got[0][0]) > 0.1


def test_a_greedy_continuation_is_reported_greedy(plain, harness):
  prompt = list(b'The cat')
  new = to_numpy(plain.generate(np.array([prompt], np.int32), np.array([7], np.int32),
                                max_new_tokens=3))[0].tolist()
  [(_, greedy)] = harness.score_pairs([(prompt, new)])
  [(_, other)] = harness.score_pairs([(prompt, new[:2] + [(new[2] + 1) % 256])])
  assert greedy and not other


def test_rolling_scores_every_token_once_after_the_prefix(plain, harness):
  text = 'the quick brown fox jumps over the lazy dog; ' * 2   # 90 bytes: 3 windows
  [score] = harness.loglikelihood_rolling([request('loglikelihood_rolling', text)])
  want, _ = reference_scores(plain, lm_eval_windows([10], list(text.encode())))
  assert math.isclose(score, want, rel_tol=1e-5, abs_tol=1e-3)
  [(same, _)] = harness.loglikelihood([request('loglikelihood', '', text)])
  assert math.isclose(score, same, rel_tol=1e-9)


def test_scoring_windows_cover_each_token_once_with_the_most_context():
  tokens = list(range(100))
  windows = scoring_windows(tokens, first=5, length=32)
  assert [t for _, targets in windows for t in targets] == tokens[5:]
  for inputs, targets in windows:
    assert len(inputs) <= 32 and inputs[-len(targets):] == [t - 1 for t in targets]
  assert [len(i) for i, _ in windows] == [32, 32, 32]   # every window has all it can


class Recording(HarnessLM):
  """A HarnessLM that keeps the (context ids, continuation ids) pairs the
  harness's split hands it, unscored."""

  def score_pairs(self, pairs):
    self.pairs = [(list(c), list(x)) for c, x in pairs]
    return [(0.0, True)] * len(pairs)


def split(harness_lm: HarnessLM, context: str, continuation: str):
  recording = Recording(harness_lm.lm, harness_lm.tokenizer)
  recording.loglikelihood([request('loglikelihood', context, continuation)])
  [pair] = recording.pairs
  return pair


# (context, continuation) -> the split lm-eval's own models make (its
# TemplateLM._encode_pair: all trailing whitespace moves to the continuation),
# written out by hand: bytes of the context's rstrip, then the rest.
WHITESPACE = [('The cat ', 'sat', 'The cat', ' sat'),
              ('Question: 2+2?\n', 'Answer: 4', 'Question: 2+2?', '\nAnswer: 4'),
              ('name:\t', 'value', 'name:', '\tvalue'),
              ('Lines end here. \n\n', 'Next', 'Lines end here.', ' \n\nNext')]


@pytest.mark.parametrize('context, continuation, head, rest', WHITESPACE,
                         ids=['space', 'newline', 'tab', 'mixed'])
def test_trailing_whitespace_goes_with_the_continuation_as_in_lm_eval(
    plain, harness, context, continuation, head, rest):
  assert split(harness, context, continuation) == (list(head.encode()), list(rest.encode()))
  [(score, greedy)] = harness.loglikelihood([request('loglikelihood', context, continuation)])
  want, want_greedy = reference_scores(plain, [(list(head.encode()), list(rest.encode()))])
  assert math.isclose(score, want, rel_tol=1e-5, abs_tol=1e-3) and greedy == want_greedy


def test_empty_or_whitespace_contexts_are_conditioned_on_the_prefix_token(plain, harness):
  assert split(harness, '', 'hi') == ([10], list(b'hi'))
  # the harness's rule: a continuation that starts with the prefix token is its own context
  assert split(harness, '', '\nhi') == ([10], list(b'hi'))
  assert split(harness, ' \n\t', 'x') == ([10], list(b' \n\tx'))   # whitespace alone
  [(score, _)] = harness.loglikelihood([request('loglikelihood', ' \n\t', 'x')])
  want, _ = reference_scores(plain, [([10], list(b' \n\tx'))])
  assert math.isclose(score, want, rel_tol=1e-5, abs_tol=1e-3)


@pytest.mark.parametrize('context', ['The cat', ''])
def test_a_continuation_without_tokens_is_a_config_error_naming_the_request(harness, context):
  requests = [request('loglikelihood', 'The cat', ' sat'), request('loglikelihood', context, '')]
  with pytest.raises(ConfigError, match=r"request 1 has a continuation with no tokens \(''"):
    harness.loglikelihood(requests)


def test_a_sentencepiece_run_splits_whole_text_and_starts_after_eos(plain, tmp_path):
  lines = ['The cat sat on the mat.', 'The dog ran to the park.', 'We went to the shop.'] * 50
  tokenizer = SentencePieceTokenizer(prepare.train_sentencepiece(
      documents=['\n'.join(lines)], model_prefix=str(tmp_path / 'spm'), vocab_size=160))
  harness = HarnessLM(plain, tokenizer)
  assert harness.prefix_token_id == harness.eos_id == prepare.EOS_ID
  assert harness.stop_ids(['never one token']) == [prepare.EOS_ID]
  context, continuation = split(harness, 'The cat sat on the ', 'mat')
  assert context + continuation == tokenizer.encode('The cat sat on the mat')
  assert tokenizer.decode(continuation) == ' mat' and len(continuation) < 4
  assert harness.continuation_text(context, continuation) == ' mat'


# -- generate_until ---------------------------------------------------------------------
def test_generate_until_is_greedy_generation_cut_at_the_stop(plain, harness):
  contexts = ['The cat sat', 'We went', '']
  references = []
  for context in contexts:
    ids = list(context.encode()) or [10]
    new = to_numpy(plain.generate(np.array([ids], np.int32), np.array([len(ids)], np.int32),
                                  max_new_tokens=12))[0]
    assert DONE not in new
    references.append(bytes(int(t) for t in new).decode('utf-8', errors='replace'))
  # a stop of one character that the first continuation makes after its start
  stop = next(ch for ch in references[0][2:] if ch != '\ufffd')
  two_char = references[1][3:5]   # a stop string of two tokens: cut by text alone
  got = harness.generate_until(
      [request('generate_until', contexts[0], {'until': [stop], 'max_gen_toks': 12}),
       request('generate_until', contexts[1], {'until': [two_char], 'max_gen_toks': 12}),
       request('generate_until', contexts[2], {'until': [stop], 'max_gen_toks': 12})])
  assert got[0] == references[0].split(stop)[0] and len(got[0]) < len(references[0])
  assert got[1] == references[1].split(two_char)[0] and len(got[1]) <= 3
  assert got[2] == references[2].split(stop)[0]
  if len(stop.encode()) == 1:  # a one-token stop also ends the row early
    assert harness.stop_ids([stop]) == list(stop.encode())
  assert harness.stop_ids([two_char]) == []


def test_a_stop_string_of_one_token_is_one_id_where_encode_adds_bos(plain, tmp_path):
  """A Hugging Face tokenizer whose `encode` puts BOS first (Llama 3's
  post-processor): a one-token stop string, a special token's text included,
  is still one stop id, as `--stop` maps it (layout_core.infer.stops); a
  rolling text is scored without that BOS."""
  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer, processors
  from layout_core.infer.tokens import HuggingFaceTokenizer
  from tests import hf_fixtures
  hf_fixtures.write_tokenizer(str(tmp_path), chat=True)
  path = str(tmp_path / 'tokenizer.json')
  loaded = Tokenizer.from_file(path)
  bos = loaded.token_to_id('<s>')
  loaded.post_processor = processors.TemplateProcessing(single='<s> $A',
                                                        special_tokens=[('<s>', bos)])
  loaded.save(path)
  tokenizer = HuggingFaceTokenizer(path)
  word = next(w for w in hf_fixtures.WORDS if len(tokenizer.encode_rendered(w)[0]) == 1)
  assert tokenizer.encode('<|eot|>')[0] == bos and len(tokenizer.encode(word)) == 2  # the control
  harness_lm = HarnessLM(plain, tokenizer, batch_size=4)
  assert harness_lm.stop_ids(['<|eot|>', word, 'the quick brown']) == [
      loaded.token_to_id('<|eot|>'), tokenizer.encode_rendered(word)[0][0]]
  # Scored as lm-eval's HFLM scores a causal model: the text's own tokens
  # after the prefix token, not the BOS `encode` puts first.
  text = ' '.join(hf_fixtures.WORDS[:6])
  own = tokenizer.encode(text)[1:]
  assert harness_lm.tok_encode(text) == own
  [score] = harness_lm.loglikelihood_rolling([request('loglikelihood_rolling', text)])
  [(want, _)] = harness_lm.score_pairs([([harness_lm.prefix_token_id], own)])
  assert score == want


def test_new_tokens_are_capped_at_half_the_window(plain, harness):
  until, new, sampling = harness.generation_settings({'until': '\n', 'max_gen_toks': 500})
  assert (until, new, sampling.greedy) == (['\n'], MAX_LEN // 2, True)
  long_context = 'abc' * 40   # 120 bytes: keeps its last 17 (17 + 16 - 1 = max_len)
  [text] = harness.generate_until([request('generate_until', long_context,
                                           {'until': [], 'max_gen_toks': 500})])
  kept = list(long_context.encode())[-17:]
  new = to_numpy(plain.generate(np.array([kept], np.int32), np.array([17], np.int32),
                                max_new_tokens=MAX_LEN // 2))[0]
  assert text == bytes(int(t) for t in new).decode('utf-8', errors='replace')


# -- on a mesh, and refusals ------------------------------------------------------------
def test_scores_on_the_data8_mesh_equal_one_devices(mesh_data8, values, harness):
  built = build_params_model(PARAMS, mesh=mesh_data8, rules=LayoutRules([]), seed=0)
  for path, variable in built.variables.items():
    assign_global(variable, values[path])
  on_mesh = HarnessLM(CachedLM(PARAMS, built.variables, batch_axis='data'), ByteTokenizer(),
                      batch_size=8)
  requests = [request('loglikelihood', c, x) for c, x in PAIRS]
  for (a, greedy_a), (b, greedy_b) in zip(on_mesh.loglikelihood(requests),
                                          harness.loglikelihood(requests)):
    assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-3) and greedy_a == greedy_b


def test_a_model_without_text_is_a_config_error(plain):
  tokenizer = IdTokenizer('the run\'s task (Markov chain) has no text, only token ids',
                          fix='give ids')
  with pytest.raises(ConfigError, match='reads no text.*Markov'):
    HarnessLM(plain, tokenizer)


# -- launch.lm_eval on a trained bytes run (slow) ----------------------------------------
@pytest.fixture(scope='module')
def bytes_run(tmp_path_factory):
  directory = tmp_path_factory.mktemp('lm_eval')
  rng = np.random.default_rng(0)
  words = (['The cat', 'The dog', 'She', 'We', 'A man'],
           ['sat on the', 'ran to the', 'said hello to the', 'went to the'],
           ['mat', 'park', 'man', 'shop', 'tree'])
  lines = [' '.join(rng.choice(part) for part in words) + '.' for _ in range(2000)]
  text = directory / 'text.txt'
  text.write_text('\n'.join(lines) + '\n')
  model_dir = str(directory / 'run')
  done = run_module('launch.train', '--gin_file=configs/experiments/quickstart.gin', TWO_DEVICES,
                    f'--model_dir={model_dir}', f"--gin_bindings=data.text_file = '{text}'",
                    '--gin_bindings=transformer_lm.vocab_size = 256',
                    '--gin_bindings=train.num_steps = 40', '--gin_bindings=train.eval_every = 0',
                    '--gin_bindings=train.log_every = 20')
  assert done.returncode == 0, done.stderr[-3000:]
  return model_dir


def test_lm_eval_runs_the_local_tasks_end_to_end(bytes_run, tmp_path):
  output = str(tmp_path / 'results.json')
  done = run_module('launch.lm_eval', f'--model_dir={bytes_run}', f'--include_path={TASKS}',
                    '--tasks=meshgin_choice,meshgin_until,meshgin_rolling',
                    '--noinclude_defaults', '--log_samples', f'--output={output}',
                    env={'HF_HOME': str(tmp_path / 'hf')})
  assert done.returncode == 0, done.stderr[-3000:]
  with open(output) as f:
    record = json.load(f)
  results = record['results']
  assert results['meshgin_choice']['acc,none'] >= 0.75   # trained: words beat gibberish
  assert 0 <= results['meshgin_until']['exact_match,none'] <= 1
  assert 0 < results['meshgin_rolling']['bits_per_byte,none'] < 8   # below uniform bytes
  assert record['n-samples']['meshgin_choice']['effective'] == 4
  assert record['meshgin']['step'] == 40 and 'data=2' in record['meshgin']['mesh']
  answers = [s['filtered_resps'][0] for s in record['samples']['meshgin_until']]
  assert len(answers) == 4 and all('.' not in a and '\n' not in a for a in answers)
  assert 'meshgin_choice' in done.stdout and 'Scored' in done.stdout


def test_lm_eval_refuses_unknown_tasks_and_runs_without_text(bytes_run, tmp_path):
  env = {'HF_HOME': str(tmp_path / 'hf')}
  for args, said in (
      (['--tasks=meshgin_choise'], 'did you mean meshgin_choice'),
      (['--tasks=meshgin_choice', "--gin_bindings=data.text_file = ''",
        '--gin_bindings=data.vocab_size = 256'], 'reads no text')):
    bad = run_module('launch.lm_eval', f'--model_dir={bytes_run}', f'--include_path={TASKS}',
                     '--noinclude_defaults', *args, env=env)
    assert bad.returncode == 2, (args, bad.stderr[-2000:])
    assert said in bad.stderr and 'Traceback' not in bad.stderr
