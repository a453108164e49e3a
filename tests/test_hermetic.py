"""The tests read and write nothing outside their own temporary directories.

A test that reads a fixed path (the classifier's data under /tmp, a cache in
the home directory) passes on the machine where something once wrote it and
fails on a newcomer's. `fixed_paths` finds such paths in the test sources:
every text file under tests/ but this one, whose samples are the check's own
positive controls.
"""

from __future__ import annotations

import os
import re

TESTS = os.path.dirname(os.path.abspath(__file__))
# A path under /tmp, the home directory by any of its spellings, or Python's
# ways of reaching the home directory.
FIXED = re.compile('|'.join([
    r'(?<![\w.{}])/tmp\b',             # '/tmp', '/tmp/x' (not 'a/tmp', '{root}/tmp')
    r'(?<![\w/])~\w*/',                 # '~/x', '~user/x' (not '~1.5')
    r'\$\{?HOME\b',                     # $HOME, ${HOME}
    r'\bexpanduser\(',                  # os.path.expanduser(...)
    r'\bPath\.home\(',                  # pathlib.Path.home()
    r"environ(\.get\(|\[)['\"]HOME",    # os.environ['HOME'], os.environ.get('HOME')
]))
TEXT_SUFFIXES = ('.py', '.gin', '.sweep', '.json', '.jsonl', '.yaml', '.txt', '.md', '.sh')


def fixed_paths(text: str) -> list[tuple[int, str]]:
  """(line number, line) of each line of `text` that names a fixed path."""
  return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1)
          if FIXED.search(line)]


def test_no_test_names_a_fixed_path_outside_its_tmp_dir():
  hits = []
  for directory, _, names in os.walk(TESTS):
    for name in sorted(names):
      if name.endswith(TEXT_SUFFIXES) and name != os.path.basename(__file__):
        path = os.path.join(directory, name)
        with open(path, encoding='utf-8') as f:
          hits += [f'{os.path.relpath(path, os.path.dirname(TESTS))}:{n}: {line}'
                   for n, line in fixed_paths(f.read())]
  assert not hits, ('these lines name a fixed path outside the test\'s own temporary '
                    'directories; write the file into tmp_path (or a session fixture\'s '
                    'tmp_path_factory dir) and point at it there:\n' + '\n'.join(hits))


def test_the_check_finds_each_spelling_and_passes_what_is_not_one():
  found = ["open('/tmp/meshgin/blobs/train-0.tfrecord')", "'--out_dir=/tmp'",
           "os.path.expanduser('~/.keras')", 'cache = "~/data"', 'cd $HOME/meshgin',
           '${HOME}/x', 'pathlib.Path.home() / "x"', "os.environ['HOME']",
           "os.environ.get('HOME', '')"]
  passed = ["f'{tmp_path}/train-*.tfrecord'", "root / 'tmp'", "'runs/tmp/x'",
            "env={'HF_HOME': str(tmp_path / 'hf')}", 'x = a ~ b', "'/data/a b.txt'",
            "f'{root}/tmp-0'"]
  assert [line for line in found if not fixed_paths(line)] == []
  assert [line for line in passed if fixed_paths(line)] == []
