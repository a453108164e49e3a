"""Wrong flags end every launcher with exit 2 before anything loads.

A value absl cannot parse, a flag no launcher defines, and a number out of
its range are configuration errors like a bad gin binding: exit 2 (not
absl's 1), absl's one message naming the flag, no traceback, and nothing
written (the --model_dir given does not appear).
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import run_modules

LAUNCHERS = ('train', 'eval', 'decode', 'export', 'inspect', 'lm_eval', 'sweep',
             'local_cluster', 'prepare_data', 'import_hf')
WRITERS = ('train', 'sweep', 'import_hf')  # given a --model_dir, which must not appear
# (launcher, flag) -> the words absl's message must hold
OUT_OF_RANGE = [
    ('decode', '--batch_size=0', 'batch_size'), ('decode', '--max_new_tokens=0', 'max_new_tokens'),
    ('lm_eval', '--batch_size=0', 'batch_size'), ('lm_eval', '--max_gen_toks=0', 'max_gen_toks'),
    ('export', '--max_new_tokens=0', 'max_new_tokens'), ('export', '--prompt_len=0', 'prompt_len'),
    ('export', '--seq_len=-1', 'seq_len'), ('inspect', '--devices=-4', 'devices'),
    ('inspect', '--hosts=0', 'hosts'), ('export', '--max_shard_mb=0', 'max_shard_mb')]
UNPARSEABLE = [('decode', '--temperature=abc', 'temperature'),
               ('export', '--top_k=two', 'top_k'), ('train', '--verbose=perhaps', 'verbose'),
               ('export', '--format=onnx', 'format'), ('import_hf', '--overwrite=maybe', 'overwrite')]


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory):
  """{(launcher, flag): CompletedProcess}, all run at once (absl parses the
  flags first; nothing heavy is imported before)."""
  root = tmp_path_factory.mktemp('flags')
  cases = ([(name, '--no_such_flag=1', 'no_such_flag') for name in LAUNCHERS]
           + OUT_OF_RANGE + UNPARSEABLE)
  calls = [(f'launch.{name}', flag,
            *([f'--model_dir={root}/{name}-{index}'] if name in WRITERS else []))
           for index, (name, flag, _) in enumerate(cases)]
  results = run_modules(calls, timeout=120)
  return root, [(case, result) for case, result in zip(cases, results)]


def test_every_wrong_flag_exits_2_naming_it_and_writes_nothing(outcomes):
  root, results = outcomes
  for (name, flag, words), result in results:
    shown = f'launch.{name} {flag}: exit {result.returncode}\n{result.stderr[-2000:]}'
    assert result.returncode == 2, shown
    assert 'FATAL Flags parsing error' in result.stderr and words in result.stderr, shown
    assert 'Traceback' not in result.stderr, shown
  assert os.listdir(root) == []
