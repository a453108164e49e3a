"""The whole suite as two pytest processes side by side: the README's test command.

    python -m tests.run -q --durations=25     # any pytest options, given to both

One pytest process keeps ~1.5 of the 2 cores busy (its tests wait on
subprocess start-ups, compiles run partly on one core), so the test files are
cut into two shards of about equal measured time and run at once, each with
its own temporary directory. Each shard's report is printed whole
when it ends, then where the CPU time went (tests/cpu_ledger.py: the
costliest test files and launched runs) and the total CPU seconds of every
process the suite ran; the exit status is the worse of the two. With
MESHGIN_TEST_CPU_SAVE=FILE the whole ledger (every test file and run) is
also written to FILE, to compare two runs. Given test paths, it is plain
pytest on those paths.
"""

from __future__ import annotations

import glob
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from tests import cpu_ledger

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
SHARDS = 2
# Seconds per test file in one full run (2 cores, 2026-11-29, --durations=0: each file's
# setup, call and teardown times summed; a trimmed file's scaled by its CPU change), to
# balance the shards; a file not listed counts as UNLISTED. Stale figures cost balance only.
SECONDS = {
    'test_composition.py': 248, 'test_export.py': 233, 'test_precision.py': 165,
    'test_sweep.py': 151, 'test_fsdp.py': 130, 'test_multi_client.py': 112,
    'test_pipeline_clients.py': 110, 'test_data_runs.py': 103, 'test_mesh_tab.py': 89,
    'test_pipeline_spmd.py': 89, 'test_sweep_slurm.py': 79, 'test_hf_models.py': 67,
    'test_lora.py': 62, 'test_bad_input.py': 60, 'test_checkpoint.py': 59,
    'test_resume.py': 58, 'test_optimizer_state.py': 53, 'test_decode.py': 51,
    'test_tasks.py': 47, 'test_launch.py': 45, 'test_streams.py': 40, 'test_suggest.py': 39,
    'test_speed_paths.py': 25, 'test_pipeline.py': 38, 'test_lm_eval.py': 36,
    'test_tied_embeddings.py': 32, 'test_never_lose_work.py': 30, 'test_docs_site.py': 28,
    'test_wheel.py': 28, 'test_eval.py': 24, 'test_flags.py': 22, 'test_tf_internals.py': 19,
    'test_pipeline_training.py': 17, 'test_layout_scope.py': 16, 'test_memory.py': 13,
    'test_keras_models.py': 12, 'test_gather.py': 11, 'test_own_model.py': 9,
    'test_imports.py': 9, 'test_lost_peer.py': 8, 'test_docs_reference.py': 6,
    'test_runner.py': 6, 'test_hf_convert.py': 6, 'test_unsplit_axes.py': 5,
    'test_optimizer.py': 4, 'test_prepare_data.py': 4, 'test_llama_blocks.py': 4,
    'test_instruct.py': 4, 'test_layers.py': 4, 'test_docs_commands.py': 4,
    'test_inspect.py': 3, 'test_checkpoint_safety.py': 3, 'test_docs_concepts.py': 3,
    'test_sampling.py': 3, 'test_startup.py': 2, 'test_keras_compat.py': 2,
    'test_configs.py': 2, 'test_console.py': 2,
}
UNLISTED = 1


def shards(files: list[str], count: int) -> list[list[str]]:
  """`files` cut into `count` lists of about equal total SECONDS (longest first)."""
  cut: list[list[str]] = [[] for _ in range(count)]
  totals = [0.0] * count
  for name in sorted(files, key=lambda f: -SECONDS.get(os.path.basename(f), UNLISTED)):
    lightest = totals.index(min(totals))
    cut[lightest].append(name)
    totals[lightest] += SECONDS.get(os.path.basename(name), UNLISTED)
  return [sorted(shard) for shard in cut if shard]


def main(args: list[str]) -> int:
  pytest = [sys.executable, '-m', 'pytest']
  if any(not a.startswith('-') and os.path.exists(a.split('::')[0]) for a in args):
    return subprocess.call(pytest + args, cwd=REPO)
  files = [os.path.relpath(f, REPO) for f in glob.glob(os.path.join(TESTS, 'test_*.py'))]
  began = time.monotonic()
  with tempfile.TemporaryDirectory(prefix='meshgin-tests-') as scratch:
    running = []
    ledgers = [os.path.join(scratch, f'cpu-{index}.json') for index in range(SHARDS)]
    for index, shard in enumerate(shards(files, SHARDS)):
      log = open(os.path.join(scratch, f'shard-{index}.log'), 'w+')
      command = pytest + [*args, f'--basetemp={scratch}/tmp-{index}', *shard]
      env = {**os.environ, 'MESHGIN_TEST_CPU_LOG': ledgers[index]}
      running.append((index, shard, log, time.monotonic(),
                      subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       env=env)))
    worst = 0
    while running:
      time.sleep(0.5)
      for entry in [e for e in running if e[4].poll() is not None]:
        index, shard, log, started, process = entry
        running.remove(entry)
        log.seek(0)
        print(f'=== shard {index + 1} of {SHARDS} ({len(shard)} files: '
              f'{" ".join(os.path.basename(f) for f in shard)}), exit {process.returncode} '
              f'after {time.monotonic() - started:.0f} s ===', flush=True)
        sys.stdout.write(log.read())
        sys.stdout.flush()
        log.close()
        # pytest's 5 (no tests collected, e.g. a -m that leaves a shard empty) is no failure
        worst = max(worst, 0 if process.returncode == 5 else process.returncode)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process waited for, below
    found = []
    for path in ledgers:
      if os.path.exists(path):
        with open(path) as f:
          found.append(json.load(f))
    if os.environ.get('MESHGIN_TEST_CPU_SAVE'):  # the whole ledger, to compare two runs
      with open(os.environ['MESHGIN_TEST_CPU_SAVE'], 'w') as f:
        json.dump(found, f)
    print(cpu_ledger.report(found, total=usage.ru_utime + usage.ru_stime,
                            wall=time.monotonic() - began), flush=True)
    return worst


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
