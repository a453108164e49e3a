"""tests/run.py, the README's test command: every test file runs in exactly
one shard, and the shards' measured times are about equal."""

import glob
import os

from tests import run


def test_every_file_runs_once_in_shards_of_about_equal_time():
  files = sorted(os.path.relpath(f, run.REPO)
                 for f in glob.glob(os.path.join(run.TESTS, 'test_*.py')))
  cut = run.shards(files, run.SHARDS)
  assert len(cut) == run.SHARDS
  assert sorted(f for shard in cut for f in shard) == files
  seconds = lambda shard: sum(run.SECONDS.get(os.path.basename(f), run.UNLISTED)  # noqa: E731
                              for f in shard)
  totals = sorted(seconds(shard) for shard in cut)
  assert totals[-1] - totals[0] <= max(run.SECONDS.values()), totals


def test_the_figures_name_only_files_that_exist():
  assert all(os.path.isfile(os.path.join(run.TESTS, name)) for name in run.SECONDS)
