"""The whole suite as two pytest processes side by side: the README's test command.

    python -m tests.run -q --durations=25     # any pytest options, given to both

One pytest process keeps ~1.5 of the 2 cores busy (its tests wait on
subprocess start-ups, compiles run partly on one core), so the test files are
cut into two shards of about equal measured time and run at once, each with
its own temporary directory. Each shard's report is printed whole
when it ends, then where the CPU time went (tests/cpu_ledger.py: the
costliest test files and launched runs) and the total CPU seconds of every
process the suite ran; the exit status is the worse of the two (a shard
killed by a signal fails it: `exit_status`). The shards, and every process
they start, allocate with jemalloc where it is installed (`with_jemalloc`: the
suite then takes about an eighth less CPU). With
MESHGIN_TEST_CPU_SAVE=FILE the whole ledger (every test file and run) is
also written to FILE, to compare two runs. Given test paths, it is plain
pytest on those paths.
"""

from __future__ import annotations

import ctypes.util
import glob
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from plugins.run_status import shell_status
from tests import cpu_ledger

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
SHARDS = 2
# Seconds per test file in one full run (2 cores, 2026-11-29, --durations=0: each file's
# setup, call and teardown times summed; a trimmed file's scaled by its CPU change; each
# shard's files then scaled by that shard's measured wall over its sum here), to balance
# the shards; a file not listed counts as UNLISTED. Stale figures cost balance only.
SECONDS = {
    'test_composition.py': 263, 'test_export.py': 227, 'test_frozen_dtype.py': 50, 'test_precision.py': 161,
    'test_moe.py': 40,
    'test_sweep.py': 129, 'test_fsdp.py': 127, 'test_multi_client.py': 119,
    'test_pipeline_clients.py': 116, 'test_data_runs.py': 100, 'test_pipeline_spmd.py': 94,
    'test_sweep_slurm.py': 84, 'test_mesh_tab.py': 81, 'test_hf_models.py': 90,
    'test_bad_input.py': 64, 'test_checkpoint.py': 62, 'test_lora.py': 60, 'test_resume.py': 56,
    'test_decode.py': 54, 'test_optimizer_state.py': 52, 'test_tasks.py': 50,
    'test_launch.py': 44, 'test_suggest.py': 41, 'test_pipeline.py': 40, 'test_streams.py': 39,
    'test_lm_eval.py': 35, 'test_tied_embeddings.py': 31, 'test_wheel.py': 30,
    'test_docs_site.py': 27, 'test_never_lose_work.py': 27, 'test_speed_paths.py': 26,
    'test_eval.py': 23, 'test_flags.py': 21, 'test_tf_internals.py': 20,
    'test_pipeline_training.py': 18, 'test_layout_scope.py': 16, 'test_memory.py': 14,
    'test_objective.py': 30, 'test_preference.py': 105, 'test_sliding_window.py': 8, 'test_peft_files.py': 4,
    'test_chat_tokens.py': 3, 'test_keras_models.py': 12, 'test_gather.py': 12,
    'test_own_model.py': 9,
    'test_imports.py': 9, 'test_lost_peer.py': 8, 'test_docs_reference.py': 6,
    'test_runner.py': 6, 'test_hf_convert.py': 6, 'test_unsplit_axes.py': 5,
    'test_optimizer.py': 4, 'test_prepare_data.py': 4, 'test_docs_commands.py': 4,
    'test_llama_blocks.py': 4, 'test_instruct.py': 4, 'test_layers.py': 4, 'test_inspect.py': 3,
    'test_docs_concepts.py': 3, 'test_checkpoint_safety.py': 3, 'test_sampling.py': 3,
    'test_startup.py': 2, 'test_console.py': 2, 'test_keras_compat.py': 2, 'test_configs.py': 2,
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


def exit_status(returncode: int) -> int:
  """A shard's part in the suite's exit status: pytest's own, except 5 (no
  tests collected, e.g. a -m that leaves a shard empty), which is no failure;
  a shard killed by a signal (Popen's -N: the OOM killer's SIGKILL, a
  SIGTERM) fails the suite as a shell reports it, 128 + N."""
  return 0 if returncode == 5 else shell_status(returncode)


def with_jemalloc(env: dict[str, str]) -> dict[str, str]:
  """`env` with jemalloc preloaded (LD_PRELOAD), where the machine has it
  (Debian's libjemalloc2, which README command 2 installs); else `env` as it is.

  TensorFlow builds and frees many small protos and graph nodes per compile,
  and the suite compiles thousands of step functions: with glibc's malloc, a
  sixth of a test process's CPU samples are in malloc and free (perf). One
  file's tests, test_fsdp.py, four runs each in turns: 85.9 CPU-s with
  jemalloc against 99.0 with glibc (bench/allocator.py measures a training
  run's). An allocator changes no value a test compares."""
  library = ctypes.util.find_library('jemalloc')
  preloaded = env.get('LD_PRELOAD', '')
  if library is None or 'jemalloc' in preloaded:
    return env
  return {**env, 'LD_PRELOAD': f'{library} {preloaded}'.strip()}


def main(args: list[str]) -> int:
  pytest = [sys.executable, '-m', 'pytest']
  environ = with_jemalloc(dict(os.environ))
  if any(not a.startswith('-') and os.path.exists(a.split('::')[0]) for a in args):
    return subprocess.call(pytest + args, cwd=REPO, env=environ)
  files = [os.path.relpath(f, REPO) for f in glob.glob(os.path.join(TESTS, 'test_*.py'))]
  began = time.monotonic()
  preloaded = environ.get('LD_PRELOAD', '')
  print('allocator: ' + (f'jemalloc ({preloaded})' if 'jemalloc' in preloaded else
                         "glibc's malloc (apt-get install libjemalloc2: an eighth less CPU)"),
        flush=True)
  with tempfile.TemporaryDirectory(prefix='meshgin-tests-') as scratch:
    running = []
    ledgers = [os.path.join(scratch, f'cpu-{index}.json') for index in range(SHARDS)]
    for index, shard in enumerate(shards(files, SHARDS)):
      log = open(os.path.join(scratch, f'shard-{index}.log'), 'w+')
      command = pytest + [*args, f'--basetemp={scratch}/tmp-{index}', *shard]
      env = {**environ, 'MESHGIN_TEST_CPU_LOG': ledgers[index]}
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
        worst = max(worst, exit_status(process.returncode))
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
