"""TensorFlow's private APIs and process-wide switches: every one meshgin uses.

TF 2.21 gets two things wrong for DTensor on CPU and lacks one public API;
the workaround for each lives here (one function each; the store needs two),
and nothing else in `layout_core`, `plugins` or `launch` imports
`tensorflow.python` or sets a variable TensorFlow reads at compile time.
(The DTENSOR_* variables `cluster.connect` sets once, before DTensor starts,
are DTensor's documented multi-client interface, not a workaround.)

    from layout_core import tf_internals
    tf_internals.keep_sums_whole()             # Grappler: sharded sums stay right
    tf_internals.trim_graph_passes('CPU')      # Grappler: only the passes that apply
    tf_internals.lower_gathers_once(True, reason='its first mesh is data=8')
    tf_internals.put_key_value('meshgin/plan/0', text)       # multi-client only
    tf_internals.get_key_value('meshgin/plan/1', timeout_s=60.0)

`layout_core.layout.mesh.build_mesh` makes the first three calls, before any
step compiles; `layout_core.layout.cluster.exchange` the last two. Each
docstring says what TensorFlow does, where it was measured and by which
bench/ script; tests/test_tf_internals.py shows each problem happening on
this machine without the workaround (a positive control), then gone with it.
A TensorFlow upgrade starts here: rerun those tests and scripts.
"""

from __future__ import annotations

import os

from layout_core.lazy import tf


def keep_sums_whole() -> None:
  """Switches off Grappler's memory optimizer for every function run after it.

  What TF does: under estimated memory pressure that pass rewrites a sum of
  three or more tensors (`AddN`: the gradient of a weight used in several
  places) into in-place adds to a temporary variable shaped from the graph's
  static shapes. In DTensor's per-device functions those are the *global*
  shapes, so with a sharded sum every add fails: "Parameters and update must
  be the same size". Measured on 8 virtual CPU devices, 2-core x86
  (`bench/limits/grappler_addn_limit.py`, bench/results/grappler_addn.json): one
  weight used four times fails from [4096, 4096] up when sharded 8 ways and
  works replicated; the SPMD pipeline engine failed on a 4x wider lm_small.
  Off, both are right. On CPU that rewrite is all this pass does (its
  swapping is GPU-only, its recomputation off by default), so nothing else
  is lost.

  Why private: TF 2.21 has no public switch for it
  (`tf.config.optimizer.set_experimental_options` lacks
  `memory_optimization`); it lives on the eager context's ConfigProto. A
  thread reads that proto into its function-call options when it first
  calls a function, and this resets the calling thread's copy only: call it
  before any other thread runs a function (`build_mesh` calls it first).
  Idempotent."""
  def off(rewrites):
    rewrites.memory_optimization = rewrites.NO_MEM_OPT
  _rewrite(off)


def trim_graph_passes(device_type: str) -> None:
  """On a CPU mesh, switches off the Grappler passes that rewrite nothing in
  meshgin's step functions, and runs the rest once instead of twice.

  What TF does: a DTensor function compiles one copy per device, and
  Grappler optimizes each copy on its own, so on 8 virtual CPU devices it
  runs 8 times per step function; it was most of a small run's compile.
  Switched off here: the layout optimizer (it converts convolutions' data
  formats), the implementation selector (it swaps Keras RNN implementations
  per device), the TFG pass (it sinks ops into the branches of
  conditionals) and the meta optimizer's second round (every pass again on
  its own output). Measured on the quickstart's model on `data=8` and on
  `data=2 x model=4`, 2-core x86 (`bench/grappler_passes.py`,
  bench/results/grappler_passes.json): the same losses bit for bit, a later
  step as fast (0.94x and 1.10x, within the +-10% those step times vary run
  to run on that machine), the first step and evaluation in 1/1.5 and 1/1.4
  of the CPU. Constant folding, arithmetic, remapping (op fusion) and the
  rest stay on. A GPU or TPU mesh keeps TensorFlow's passes: not measured
  there.

  Why private: `tf.config.optimizer.set_experimental_options` has no switch
  for the TFG pass or the number of rounds; they live on the eager
  context's ConfigProto, read as `keep_sums_whole` says (call it before any
  other thread runs a function; `build_mesh` does). Idempotent."""
  if device_type != 'CPU':
    return

  def trim(rewrites):
    rewrites.layout_optimizer = rewrites.OFF
    rewrites.implementation_selector = rewrites.OFF
    rewrites.disable_tfg_optimizer = True
    rewrites.meta_optimizer_iterations = rewrites.ONE
  _rewrite(trim)


def _rewrite(change) -> None:
  """Applies `change` to the Grappler options (RewriterConfig) of the eager
  context's ConfigProto, for the functions compiled after it (see
  `keep_sums_whole` for which threads see it)."""
  ctx = _eager_context()
  config = tf.compat.v1.ConfigProto()
  if ctx._config is not None:  # pylint: disable=protected-access
    config.CopyFrom(ctx._config)  # pylint: disable=protected-access
  before = tf.compat.v1.ConfigProto()
  before.CopyFrom(config)
  change(config.graph_options.rewrite_options)
  if config == before:
    return
  ctx._config = config  # pylint: disable=protected-access
  ctx._thread_local_data.function_call_options = None  # pylint: disable=protected-access


GATHER_LOWERING = 'LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2'
_gathers: tuple[bool, str] | None = None  # (CollectiveGatherV2?, why) once decided


def lower_gathers_once(collective_gather: bool, *, reason: str) -> tuple[bool, str]:
  """Decides, once per process, how DTensor compiles its all-gathers; returns
  the decision in force, (collective_gather, its reason). The first call
  decides; later calls change nothing, whatever they ask.

  What TF does: DTensor lowers an all-gather (a sharded -> replicated
  relayout: the gather back after a sharded optimizer update, FSDP's
  gathers) to a zero-padded all-reduce, which kept 2-3 replicated copies of
  every gathered tensor alive on CPU (`bench/all_gather_memory.py`).
  TensorFlow's CollectiveGatherV2 lowering moves only the shards, but on a
  mesh of two or more axes it fails to compile 96 of 144 relayouts of an
  [8, 8, 16] tensor on `data=2 x model=4` ('tf.Reshape' element-count
  errors; no wrong values seen), and all 9 on `data=8` work
  (`bench/limits/gather_lowering_limit.py`, bench/results/gather_lowering.json;
  8 virtual CPU devices, 2-core x86). It moves bytes, not values: the same
  numbers either way (quickstart's 20 losses bit-identical). TF applies it
  to int32, int64, float16, float32 and float64 only: a bfloat16 gather
  stays an all-reduce, as does every gather on a TPU mesh
  (collective_lowering.cc).

  Why process-wide: TF 2.21's only switch is this environment variable,
  read by C++ (`getenv` in dtensor_utils.cc) each time a function's
  all-gathers are lowered, i.e. when the function first compiles; a compiled
  function keeps its lowering. Setting it around a compile would race every
  other thread's compile in this multi-threaded process (and `setenv` is not
  thread-safe against `getenv`), so it is written once, here, before any
  step compiles, and never again: set for CollectiveGatherV2, removed
  otherwise (a value inherited from a parent process does not decide).

  What that means for a process that builds several meshes: the first
  `build_mesh` decides from its mesh (one axis: CollectiveGatherV2), and
  every later mesh, whatever its shape, compiles with that choice. A
  process that chose CollectiveGatherV2 cannot compile most relayouts on a
  mesh of two or more axes, so `build_mesh` refuses to build one there
  (ConfigError: build it in a fresh process); sub-meshes never add axes. A
  process that chose the default runs one-axis meshes correctly, with the
  all-reduce's memory cost. A process that builds meshes of several shapes
  decides up front with the default: the tests' shared 8-device process
  does (tests/conftest.py), so a test of the CollectiveGatherV2 lowering
  runs in a process of its own (tests/test_tf_internals.py)."""
  global _gathers
  if _gathers is None:
    if collective_gather:
      os.environ[GATHER_LOWERING] = '1'
    else:
      os.environ.pop(GATHER_LOWERING, None)
    _gathers = (bool(collective_gather), reason)
  return _gathers


def put_key_value(key: str, value: str) -> None:
  """Posts `value` under `key` in the key-value store of TF's coordination
  service, which DTensor's multi-client start runs on client 0 (only there:
  a single process has no store). What TF lacks: a public API to that store
  (TF 2.21 exports none); the eager context's methods are the only way. Used
  by `layout_core.layout.cluster.exchange`; the two-client runs of
  tests/test_multi_client.py and tests/test_tf_internals.py use it."""
  _eager_context().set_config_key_value(key, value)


def get_key_value(key: str, *, timeout_s: float) -> str:
  """The value posted under `key` (see `put_key_value`), waiting for it up
  to `timeout_s` seconds; tf.errors.OpError (DeadlineExceeded) after that."""
  return _eager_context().get_config_key_value(key, timeout_in_ms=int(timeout_s * 1000))


def _eager_context():
  """TF's eager context, from a private module; TensorFlow itself is first
  imported through `layout_core.lazy` (the collector paused), as everywhere."""
  tf.version  # pylint: disable=pointless-statement
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  return context.context()
