r"""Make an LM corpus: text files -> a tokenizer -> TFRecords of token ids.

  python -m launch.prepare_data --output_dir=/tmp/corpus \
      [--text_root=/usr/lib/python3.11] [--max_bytes=4000000] [--vocab_size=1024]
  python -m launch.prepare_data --output_dir=/tmp/qwen_corpus --tokenizer=runs/qwen \
      --text_file=my_notes.md

Collects text already on this machine (by default the sources and docs of the
Python standard library, walked in sorted order up to --max_bytes; nothing is
downloaded), holds out every k-th file for eval (k = 1 / --eval_fraction),
trains a SentencePiece model on the rest (or copies --spm_model) and writes to
--output_dir:

  spm.model                              the tokenizer (pad 0, eos 1, unk 2)
  train-00000-of-00008.tfrecord, ...     one tf.train.Example per file: int64
  eval-00000-of-00008.tfrecord, ...        feature 'tokens', ending in eos (1)
  corpus.json                            counts, vocab size, the tokenizer's
                                         sha256, file names

With --tokenizer (a Hugging Face model directory, or a run directory made by
launch.import_hf) no SentencePiece model is trained: that directory's
tokenizer.json tokenizes each document (copied to --output_dir/tokenizer.json)
and its end-of-sequence token (--eos_token, default the one its
tokenizer_config.json names) ends it. Training from such a run checks that the
corpus was made with the model's own tokenizer.

A split with fewer documents than --num_shards gets one file per document
(never an empty file). --output_dir becomes a link to a complete version of
the corpus (in --output_dir.versions/), switched in one rename: a run stopped
at any point leaves the previous corpus as it was. The same inputs give
byte-identical files. Exit status: 0 on success, 2 on a bad setting (a missing
file, a vocab too large for the text, an --output_dir that holds other files),
with one paragraph saying what and how to fix it.
"""

from __future__ import annotations

if __name__ == '__main__':  # first, before the imports below take their time
  import launch
  launch.install_start_up_handlers()

import os
import time

from absl import app, flags, logging


from launch import gin_flags

flags.declare_key_flag('verbose')  # the one shared flag that applies here

OUTPUT_DIR = flags.DEFINE_string(
    'output_dir', None, 'Directory for spm.model, the train-*/eval-*.tfrecord shards and '
    'corpus.json.', required=True)
TEXT_ROOT = flags.DEFINE_multi_string(
    'text_root', [os.path.dirname(os.__file__)], 'A directory to collect .py, .md, .rst '
    'and .txt files of 200 B to 200 KB from, in sorted order; repeatable. Default: the '
    'Python standard library. Not used with --text_file unless given too.')
TEXT_FILE = flags.DEFINE_multi_string(
    'text_file', [], 'A text file to use whole, as one document; repeatable.')
MAX_BYTES = flags.DEFINE_integer(
    'max_bytes', 4_000_000, 'Stop collecting from --text_root once the files total this '
    'many bytes.')
VOCAB_SIZE = flags.DEFINE_integer(
    'vocab_size', None, 'Pieces in the SentencePiece model to train (default 1024). With '
    '--spm_model: checked against that model when given.')
NUM_SHARDS = flags.DEFINE_integer(
    'num_shards', 8, 'Files per split; documents are dealt round-robin over them.')
EVAL_FRACTION = flags.DEFINE_float(
    'eval_fraction', 0.05, 'Fraction of documents held out for eval (every k-th file, '
    'k = 1 / eval_fraction); 0: no eval split.')
SPM_MODEL = flags.DEFINE_string(
    'spm_model', None, 'An existing SentencePiece .model to tokenize with (copied to '
    '--output_dir/spm.model) instead of training one.')
TOKENIZER = flags.DEFINE_string(
    'tokenizer', None, 'A Hugging Face model directory, or a meshgin run directory (its '
    'tokenizer/), whose tokenizer.json tokenizes the text instead of a SentencePiece model: '
    'continued pre-training with the model\'s own tokenizer.')
EOS_TOKEN = flags.DEFINE_string(
    'eos_token', None, '--tokenizer: the token that ends each document (default: the '
    'eos_token its tokenizer_config.json names, else eos_token_id of its config).')

DEFAULT_VOCAB_SIZE = 1024


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)

  def body(watcher):
    del watcher
    from layout_core.tasks import prepare  # pylint: disable=g-import-not-at-top
    use_roots = flags.FLAGS['text_root'].present or not TEXT_FILE.value
    vocab_size = VOCAB_SIZE.value
    if vocab_size is None and SPM_MODEL.value is None and TOKENIZER.value is None:
      vocab_size = DEFAULT_VOCAB_SIZE
    start = time.monotonic()
    summary = prepare.prepare_corpus(
        output_dir=OUTPUT_DIR.value, text_roots=TEXT_ROOT.value if use_roots else [],
        text_files=TEXT_FILE.value, max_bytes=MAX_BYTES.value, vocab_size=vocab_size,
        num_shards=NUM_SHARDS.value, eval_fraction=EVAL_FRACTION.value,
        spm_model=SPM_MODEL.value, tokenizer=TOKENIZER.value, eos_token=EOS_TOKEN.value)
    print(describe(summary, output_dir=OUTPUT_DIR.value, seconds=time.monotonic() - start))

  gin_flags.run_guarded(body)


def describe(summary: dict, *, output_dir: str, seconds: float) -> str:
  """A few lines: sources, vocabulary, and each split's counts."""
  sources, tokenizer = summary['sources'], summary['tokenizer']
  lines = [f'Prepared {output_dir} in {seconds:.1f} s: {sources["files"]} files '
           f'({sources["bytes"] / 1e6:.2f} MB), {sources["documents"]} documents, '
           f'vocab {summary["vocab_size"]} ({tokenizer["file"]}, eos {tokenizer["eos_id"]})']
  for split in ('train', 'eval'):
    counts = summary[split]
    lines.append(f'  {split + ":":6} {counts["documents"]:6,} documents {counts["tokens"]:10,} '
                 f'tokens ({counts["unknown_tokens"]:,} unk) in {len(counts["files"])} files')
  if not summary['eval']['files']:
    lines.append('  No eval files (--eval_fraction=0): point lm_corpus.eval_files at the '
                 'train files, or hold out a fraction')
  return '\n'.join(lines)


if __name__ == '__main__':
  app.run(main, flags_parser=launch.parse_flags)
