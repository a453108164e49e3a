"""A trained meshgin LM as a model of EleutherAI's lm-eval harness.

    import lm_eval
    from plugins.lm_eval import load_harness_lm

    model = load_harness_lm(model_dir='/tmp/bytes_run')   # the run's model, mesh and tokenizer
    tasks = lm_eval.tasks.TaskManager(include_path='tests/fixtures/lm_eval_task')
    results = lm_eval.simple_evaluate(model=model, tasks=['meshgin_choice'], task_manager=tasks)
    results['results']['meshgin_choice']['acc,none']

`HarnessLM` implements lm-eval's `LM` interface (`lm_eval.api.model.LM`)
over a `layout_core.infer.decode.CachedLM` and the run's tokenizer
(`layout_core.infer.tokens`): an `lm_corpus` run's SentencePiece model, a
bytes run's UTF-8. A Markov run has no text and is refused.

* `loglikelihood((context, continuation))`: the sum of the model's
  log-softmax at the continuation's tokens after the context, and whether
  each of them is the most likely one. The split is the harness's own
  (`TemplateLM`, which its Hugging Face models use): whitespace at the end of
  the context (spaces, newlines, tabs) goes with the continuation, the text
  is tokenized whole and split where the context's own tokens end. An empty
  context is conditioned on the prefix token (the corpus's eos, which ends
  every document; a newline byte for a bytes run), and so is one of
  whitespace alone. A continuation with no tokens is a ConfigError naming
  the request: scored, it would be 0.0 and greedy, and win any choice.
* `loglikelihood_rolling((text,))`: every token of the text (not a BOS the
  tokenizer puts first: texts are encoded as lm-eval's HFLM encodes them for
  a causal model) after the prefix token, in windows of the model's `max_len`; each window after the
  first sees the `max_len` tokens before its own (lm-eval's rolling windows).
  A continuation longer than `max_len` is scored the same way.
* `generate_until((context, gen_kwargs))`: `CachedLM.generate` (greedy
  unless `do_sample` and a temperature are asked for), the text cut at the
  first of `until`'s strings; a stop string that is one token also ends the
  row early, and so does the corpus's eos. A context longer than the model
  keeps its last tokens (`max_len - max_new_tokens + 1`); at most half of
  `max_len` new tokens are made.

Scoring runs `CachedLM.logits` on the mesh, `batch_size` windows at a time,
longest first; widths are padded to a power of two (at least 16, at most
`max_len`) and batches to `batch_size` rows, so a task compiles a few
shapes, not one per request. Requests are answered in their own order.
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

import numpy as np
from absl import logging
from lm_eval.api.model import TemplateLM

from layout_core.errors import ConfigError
from layout_core.infer import decode, tokens as tokens_lib
from layout_core.infer.sampling import Sampling
from layout_core.layout.variables import to_numpy

NO_LIMIT_LENGTH = 2048  # the window of a model without a position table (max_len 0)
NEWLINE = 10            # a bytes run's prefix token
_KNOWN_GENERATION_KWARGS = {'until', 'max_gen_toks', 'do_sample', 'temperature', 'top_k',
                            'top_p'}


class HarnessLM(TemplateLM):
  """lm-eval's `TemplateLM` over a CachedLM and its tokenizer (module doc).

  Args:
    lm: The model (`layout_core.infer.decode.CachedLM`), on a mesh or not.
    tokenizer: The run's tokenizer (`layout_core.infer.tokens.tokenizer_for`);
      one without text is a ConfigError.
    batch_size: Windows scored, or prompts decoded, per call of the model.
    max_gen_toks: New tokens per generate_until request when its
      gen_kwargs do not say (lm-eval's default, 256), before the model's cap.
    seed: The sampling seed of requests that ask for sampling.
    prefix_token_id: What an empty context is conditioned on (None: eos for
      SentencePiece, a newline for bytes).
    about: What the model is (checkpoint, step, mesh), kept for the results.
  """

  def __init__(self, lm: decode.CachedLM, tokenizer: tokens_lib.Tokenizer, *,
               batch_size: int = 8, max_gen_toks: int = 256, seed: int = 0,
               prefix_token_id: int | None = None, about: dict | None = None):
    super().__init__()
    check_text(tokenizer)
    if batch_size < 1 or max_gen_toks < 1:
      raise ConfigError(f'batch_size {batch_size} and max_gen_toks {max_gen_toks} must be '
                        '>= 1', where='--batch_size / --max_gen_toks', fix='give positive numbers')
    self.lm, self.tokenizer = lm, tokenizer
    self.batch_size, self.max_gen_toks, self.seed = batch_size, max_gen_toks, seed
    self.max_length = lm.max_len or NO_LIMIT_LENGTH
    self.eos_id = _eos_id(tokenizer)
    self._prefix_token_id = (prefix_token_id if prefix_token_id is not None
                             else self.eos_id if self.eos_id is not None else NEWLINE)
    if not 0 <= self._prefix_token_id < lm.vocab_size:
      raise ConfigError(f'prefix token {self._prefix_token_id} is not an id of the model\'s '
                        f'{lm.vocab_size}-token vocabulary', where='prefix_token_id',
                        fix=f'give an id in 0..{lm.vocab_size - 1}')
    self.about = dict(about or {})
    self._added = list(tokenizer.encode(''))  # what encode puts before any text
    self._warned: set[str] = set()

  # -- lm-eval's interface ---------------------------------------------------------------
  @property
  def prefix_token_id(self) -> int:
    return self._prefix_token_id

  @property
  def eot_token_id(self) -> int:
    return self._prefix_token_id

  def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                 **kwargs) -> list[int]:
    """The text's ids without what the tokenizer puts before every text (a
    BOS: Llama's SentencePiece model, Llama 3's post-processor), as lm-eval's
    HFLM encodes for a causal model: a rolling text or a continuation of an
    empty context is scored from the prefix token, never its BOS."""
    del add_special_tokens, kwargs
    ids = self.tokenizer.encode(string)
    return ids[len(self._added):] if ids[:len(self._added)] == self._added else ids

  def loglikelihood(self, requests, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
    for index, request in enumerate(requests):  # the harness reads an empty context's first token
      if not request.args[0] and not self.tok_encode(request.args[1]):
        raise _no_continuation(index, request.args)
    return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = True
                            ) -> list[tuple[float, bool]]:
    """The harness's split requests ((context, continuation), context ids,
    continuation ids), scored in their order."""
    pairs = []
    for index, (args, context, continuation) in enumerate(requests):
      if not continuation:
        raise _no_continuation(index, args)
      pairs.append((context or [self.prefix_token_id], continuation))  # whitespace alone: []
    results = self.score_pairs(pairs)
    for (args, _, _), result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood', args, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = True) -> list[float]:
    pairs = [([self.prefix_token_id], self.tok_encode(request.args[0]))
             for request in requests]
    results = [total for total, _ in self.score_pairs(pairs)]
    for request, result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood_rolling', request.args, result)
    return results

  def generate_until(self, requests, disable_tqdm: bool = True) -> list[str]:
    groups: dict[str, list[int]] = {}
    for index, request in enumerate(requests):
      key = json.dumps(request.args[1], sort_keys=True, default=str)
      groups.setdefault(key, []).append(index)
    results: list[str] = [''] * len(requests)
    for indices in groups.values():
      texts = self.generate_texts([requests[i].args[0] for i in indices],
                                  gen_kwargs=requests[indices[0]].args[1])
      for index, text in zip(indices, texts):
        results[index] = text
        self.cache_hook.add_partial('generate_until', requests[index].args, text)
    return results

  # -- scoring ---------------------------------------------------------------------------
  def score_pairs(self, pairs: Sequence[tuple[list[int], list[int]]]
                  ) -> list[tuple[float, bool]]:
    """(sum of log-probabilities, all greedy) of each continuation after its context."""
    windows = []  # (pair index, inputs, targets)
    for index, (context, continuation) in enumerate(pairs):
      windows += [(index, inputs, targets) for inputs, targets
                  in scoring_windows(context + continuation, first=len(context),
                                     length=self.max_length)]
    totals, greedy = [0.0] * len(pairs), [True] * len(pairs)
    order = sorted(range(len(windows)), key=lambda w: -len(windows[w][1]))
    for start in range(0, len(order), self.batch_size):
      batch = [windows[w] for w in order[start:start + self.batch_size]]
      logits = self._logits([inputs for _, inputs, _ in batch])
      for row, (index, inputs, targets) in enumerate(batch):
        end = len(inputs)
        scores = log_softmax(logits[row, end - len(targets):end])
        totals[index] += float(scores[np.arange(len(targets)), targets].sum())
        greedy[index] &= bool((scores.argmax(-1) == np.asarray(targets)).all())
    return list(zip(totals, greedy))

  def _logits(self, rows: list[list[int]]) -> np.ndarray:
    """float32 [batch_size, width, V] logits of `rows`, right-padded (a
    causal model's logits at a row's own positions do not see the padding)."""
    width = padded_width(max(len(r) for r in rows), limit=self.max_length)
    array = np.zeros([self.batch_size, width], np.int32)
    for row, ids in enumerate(rows):
      array[row, :len(ids)] = ids
    return to_numpy(self.lm.logits(array))

  # -- generation ------------------------------------------------------------------------
  def generate_texts(self, contexts: Sequence[str], *, gen_kwargs: dict) -> list[str]:
    """Each context's continuation as text, cut at the first `until` string."""
    until, max_new, sampling = self.generation_settings(gen_kwargs)
    keep = self.max_length - max_new + 1
    prompts = []
    for context in contexts:
      ids = self.tokenizer.encode(context) if context else [self.prefix_token_id]
      if len(ids) > keep:
        self._warn_once('cut', f'a context of {len(ids)} tokens keeps its last {keep} '
                               f'(max_len {self.max_length}, {max_new} new tokens)')
        ids = ids[-keep:]
      prompts.append(ids)
    stops = self.stop_ids(until)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    texts = [''] * len(prompts)
    for start in range(0, len(order), self.batch_size):
      batch = order[start:start + self.batch_size]
      width = min(padded_width(max(len(prompts[i]) for i in batch), limit=self.max_length),
                  keep)
      array = np.full([self.batch_size, width], self.prefix_token_id, np.int32)
      lengths = np.ones([self.batch_size], np.int32)  # idle rows: one prefix token
      for row, index in enumerate(batch):
        array[row, :len(prompts[index])], lengths[row] = prompts[index], len(prompts[index])
      new = to_numpy(self.lm.generate(array, lengths, max_new_tokens=max_new,
                                      sampling=sampling, seed=self.seed, stop_ids=stops,
                                      first_row=start))
      for row, index in enumerate(batch):
        ids = [int(t) for t in new[row] if t != decode.DONE and t != self.eos_id]
        texts[index] = cut_at(self.continuation_text(prompts[index], ids), until)
    return texts

  def generation_settings(self, gen_kwargs: dict) -> tuple[list[str], int, Sampling]:
    """(stop strings, new tokens, Sampling) of a request's gen_kwargs."""
    gen_kwargs = dict(gen_kwargs or {})
    unknown = sorted(set(gen_kwargs) - _KNOWN_GENERATION_KWARGS)
    if unknown:
      self._warn_once('kwargs', f'generation settings {unknown} are not used')
    until = gen_kwargs.get('until') or []
    until = [until] if isinstance(until, str) else [u for u in until if u]
    requested = int(gen_kwargs.get('max_gen_toks') or self.max_gen_toks)
    max_new = max(1, min(requested, self.max_length // 2))
    if max_new < requested:
      self._warn_once('new', f'{requested} new tokens asked for; at most {max_new} are made '
                             f'(half the model\'s max_len {self.max_length})')
    temperature = float(gen_kwargs.get('temperature') or 0.0)
    if not gen_kwargs.get('do_sample') or temperature <= 0:
      return until, max_new, Sampling()
    return until, max_new, Sampling(temperature=temperature,
                                    top_k=int(gen_kwargs.get('top_k') or 0),
                                    top_p=float(gen_kwargs.get('top_p') or 1.0))

  def stop_ids(self, until: Iterable[str]) -> list[int]:
    """Token ids that end a row: each stop string that is one token whose
    text holds it (the cut then falls at or before that token), and eos. A
    string's ids are `--stop`'s (`layout_core.infer.stops.text_ids`: a
    special token's text is its id, no BOS added as `encode` may add it)."""
    from layout_core.infer import stops  # pylint: disable=g-import-not-at-top
    found = [] if self.eos_id is None else [self.eos_id]
    for text in until:
      ids = stops.text_ids(text, self.tokenizer)
      if len(ids) == 1 and text in self.tokenizer.decode(ids) and ids[0] not in found:
        found.append(ids[0])
    return [i for i in found if 0 <= i < self.lm.vocab_size]

  def continuation_text(self, prompt: list[int], new: list[int]) -> str:
    """The text `new` adds after `prompt` (decoded together, so a
    SentencePiece continuation keeps its leading space)."""
    head = self.tokenizer.decode(prompt)
    whole = self.tokenizer.decode(list(prompt) + list(new))
    return whole[len(head):] if whole.startswith(head) else self.tokenizer.decode(new)

  def _warn_once(self, key: str, message: str) -> None:
    if key not in self._warned:
      self._warned.add(key)
      logging.warning('lm-eval: %s', message)


def _no_continuation(index: int, args: tuple[str, str]) -> ConfigError:
  context, continuation = args
  return ConfigError(f'loglikelihood request {index} has a continuation with no tokens '
                     f'({continuation!r} after a context ending {context[-40:]!r}): it would '
                     'score 0.0 and count as greedy', where=f'the task\'s request {index}',
                     fix='give every choice some text to score (check the task\'s '
                         'doc_to_choice / doc_to_target)')


def scoring_windows(tokens: Sequence[int], *, first: int, length: int
                    ) -> list[tuple[list[int], list[int]]]:
  """(inputs, targets) windows that score `tokens[first:]`, each token once:
  targets in chunks of at most `length`, each chunk's inputs the (at most)
  `length` tokens before its last target; the targets are predicted at the
  inputs' last len(targets) positions. `first` >= 1."""
  if first < 1:
    raise ValueError(f'the first scored token must have a token before it (first={first})')
  windows = []
  for start in range(first, len(tokens), length):
    end = min(start + length, len(tokens))
    windows.append((list(tokens[max(0, end - 1 - length):end - 1]), list(tokens[start:end])))
  return windows


def padded_width(width: int, *, limit: int) -> int:
  """`width` rounded up to a power of two, at least 16, at most `limit`."""
  padded = 16
  while padded < width:
    padded *= 2
  return max(width, min(padded, limit))


def log_softmax(logits: np.ndarray) -> np.ndarray:
  """float64 log-softmax over the last axis."""
  logits = logits.astype(np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def cut_at(text: str, until: Iterable[str]) -> str:
  """`text` up to the first occurrence of any of `until`."""
  for stop in until:
    if stop:
      text = text.split(stop)[0]
  return text


def check_text(tokenizer: tokens_lib.Tokenizer) -> None:
  """ConfigError when the run's tokens are not text (the Markov task)."""
  if not tokenizer.has_text:
    raise ConfigError(f'the model reads no text: {tokenizer.describe()}',
                      where='the run\'s task (data.task)',
                      fix='lm-eval\'s tasks are text: evaluate a run trained on text '
                          '(data.text_file, or an lm_corpus with its spm.model)')


def _eos_id(tokenizer: tokens_lib.Tokenizer) -> int | None:
  """The end of document of a SentencePiece model (None: none, or not SentencePiece)."""
  if not isinstance(tokenizer, tokens_lib.SentencePieceTokenizer):
    return None
  import sentencepiece  # pylint: disable=g-import-not-at-top
  eos = sentencepiece.SentencePieceProcessor(model_file=tokenizer.model_file).eos_id()
  return eos if eos >= 0 else None


def load_harness_lm(*, model_dir: str | None = None, checkpoint: str | None = None,
                    gin_files: Sequence[str] = (), gin_bindings: Sequence[str] = (),
                    search_paths: Sequence[str] = (), run_config: bool = True,
                    spm_model: str | None = None, batch_size: int = 8,
                    max_gen_toks: int = 256, seed: int = 0) -> HarnessLM:
  """A run's checkpoint as a HarnessLM: its config (`<model_dir>/config.gin`
  unless `run_config` is False, then `gin_files` and `gin_bindings`), the
  model built on that config's mesh without a pipeline, the checkpoint read
  into it (read-only), and the run's tokenizer (or `spm_model`)."""
  from plugins import inference  # pylint: disable=g-import-not-at-top
  inference.find_checkpoint(model_dir=model_dir, checkpoint=checkpoint)
  loaded = inference.load_decoder(
      files=inference.config_files(model_dir=model_dir, checkpoint=checkpoint,
                                   gin_files=gin_files, from_run=run_config),
      bindings=gin_bindings, search_paths=search_paths, model_dir=model_dir,
      checkpoint=checkpoint, spm_model=spm_model,
      check=lambda plan, layers, tokenizer: check_text(tokenizer))
  trained, layers, tokenizer = loaded.trained, loaded.layers, loaded.tokenizer
  about = {'checkpoint': trained.checkpoint, 'step': trained.step,
           'mesh': loaded.plan.mesh_spec.describe(), 'tokenizer': tokenizer.describe(),
           'max_len': layers.max_len, 'vocab_size': layers.vocab_size}
  return HarnessLM(loaded.lm, tokenizer, batch_size=batch_size, max_gen_toks=max_gen_toks,
                   seed=seed, about=about)
