"""One training run from a typed plan: the path `launch.train` takes.

    plan = make_plan()
    with PreemptionWatcher(immediate=True) as watcher:
      result = run_training(plan, model_dir='/tmp/run', watcher=watcher)

In order, and nothing is written to `model_dir` before step 4:

  1. the mesh is built (are there enough devices?) and the model is created
     in the layout scope, every variable directly sharded;
  2. the newest undamaged checkpoint in `model_dir`, if any, is checked to
     fit the model (read-only);
  3. the first train and eval batches are read on the host: one in which
     the loss trains no token (a task's mask, `layout_core.train.
     trained_tokens`) is a ConfigError; then one forward and backward pass
     runs on a real batch, updating nothing, so a layout DTensor cannot run
     is a ConfigError here, not at step 1;
  4. from here a stop signal finishes the current step and saves: the run
     record is written (`plugins.record`), the checkpoint restored, and the
     model trained, with checkpoints and TensorBoard summaries.

In a multi-client run, a client lost on the way (killed, hung, its host gone)
makes the others' next collective fail; they raise `PeerLost`, which names
it and the checkpoint a rerun resumes from, for launch.train to print.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from absl import logging

from layout_core.layout import cluster as cluster_lib
from layout_core.layout import mesh as mesh_lib
from layout_core.checkpoint.files import latest_valid
from layout_core.checkpoint.manager import Checkpointer
from layout_core.errors import ConfigError
from layout_core.infer.text_samples import text_samples_for
from layout_core.lazy import tf
from layout_core.layout.variables import to_numpy
from layout_core.model import frozen
from layout_core.model.lora import B_SUFFIX, is_adapter
from layout_core.train.preemption import PreemptionWatcher
from layout_core.train.summaries import NullWriter, SummaryWriter
from layout_core.train.config import TrainResult
from layout_core.train.engine import check_step_compiles
from layout_core.train.reference_logps import attach_reference
from layout_core.train.trained_tokens import check_first_batches
from layout_core.run import make_trainer
from layout_core.train.loop import Trainer
from layout_core.train.memory import model_flops_per_step
from plugins.agreement import check_clients_agree
from plugins.plan import RunPlan
from plugins.record import checkpoint_event_recorder, record_resume_changes, record_run
from plugins.run_status import one_line


def join_cluster(plan: RunPlan, cluster: cluster_lib.ClusterSpec, *,
                 devices_per_client: int | None = None) -> None:
  """Makes this process one client of the global mesh (no-op for one client).

  Each client brings mesh.num_devices / num_clients devices of its own; once
  joined, the clients check that they all resolved the same run
  (`plugins.agreement`)."""
  if not cluster.is_multi_client:
    return
  spec = plan.mesh_spec
  per_client = devices_per_client or spec.num_devices // cluster.num_clients
  if per_client * cluster.num_clients != spec.num_devices:
    given = (f'{cluster.source} gave {cluster.num_clients} tasks '
             f'({", ".join(cluster.addresses)}), and '
             if cluster.source else '')
    raise ConfigError(
        f'{spec.describe()} needs {spec.num_devices} devices but {given}{cluster.num_clients} '
        f'clients x {per_client} devices give {per_client * cluster.num_clients}',
        where='mesh.shape',
        fix=('start a number of tasks that divides the mesh, each bringing mesh size / tasks '
             'devices (e.g. srun -n 2 for 8 devices as 2 x 4), or change mesh.shape'
             if cluster.source else 'make the mesh size num_clients x devices_per_client'))
  problem = plan.clients_problem(cluster.num_clients)
  if problem:
    raise ConfigError(f'{problem} ({cluster.num_clients} clients)', where='pipeline.num_stages',
                      fix=f'run on a number of clients whose devices each split '
                          f'{plan.pipeline.num_stages} ways, or use pipeline.engine = \'spmd\'')
  logging.info('Joining the cluster as %s', cluster.describe())
  cluster_lib.connect(cluster, device_type=spec.device_type, num_local_devices=per_client)
  logging.info('Joined: client %d of %d, with %d of the mesh\'s %d devices',
               cluster.client_id, cluster.num_clients, per_client, spec.num_devices)
  check_clients_agree(plan, cluster)  # before any client builds, steps or saves


def build_trainer(plan: RunPlan, *, watcher: PreemptionWatcher | None = None,
                  writer=None, profile_dir: str | None = None,
                  weights_only: bool = False) -> Trainer:
  """Builds the mesh, the step engine the plan asks for (model and optimizer,
  every variable laid out) and the training loop around it. `weights_only`:
  the model's variables alone, started as zeros for a caller that assigns
  every one (an import), no optimizer."""
  mesh = mesh_lib.build_mesh(plan.mesh_spec)
  if watcher is not None:
    watcher.reinstall()  # TF took SIGTERM/SIGINT while initialising its devices
  logging.info('Mesh: %s', plan.mesh_spec.describe())
  logging.info('Data: %s', plan.task.describe())
  trainer = make_trainer(model=plan.params, mesh=mesh, rules=plan.rules, task=plan.task,
                         optimizer=plan.optimizer, config=plan.train,
                         pipeline=plan.pipeline_config if plan.pipeline else None,
                         pipeline_plan=plan.pipeline, writer=writer, profile_dir=profile_dir,
                         text_samples=text_samples_for(config=plan.train, params=plan.params,
                                                       task=plan.task),
                         weights_only=weights_only, **flop_figures(plan))
  variables = trainer.engine.variables
  total = sum(math.prod(v.shape) for v in variables.values())
  logging.info('Model: %s parameters in %d variables', f'{total:,}', len(variables))
  trained = [v for v in variables.values() if v.trainable]
  if len(trained) < len(variables):  # lora.* / train.trainable
    count = sum(math.prod(v.shape) for v in trained)
    logging.info('Training %s of them (%.2f%%) in %d variables; the other %d are frozen: no '
                 'gradients, no optimizer state', f'{count:,}', 100 * count / total,
                 len(trained), len(variables) - len(trained))
  return trainer


def flop_figures(plan: RunPlan) -> dict[str, float | None]:
  """The trainer's `model_flops_per_step` and `peak_flops` (the whole mesh's;
  None unless mesh.peak_flops_per_device is declared)."""
  spec = plan.mesh_spec
  tokens = plan.train.batch_size * plan.task.tokens_per_example
  peak = spec.peak_flops_per_device
  return {'model_flops_per_step': model_flops_per_step(
              meta=plan.meta, num_parameters=plan.num_parameters, tokens_per_step=tokens),
          'peak_flops': peak * spec.num_devices if peak else None}


class PeerLost(Exception):
  """Another client of this multi-client run was lost: an expected fault,
  whose message (`paragraph`) says who and where a rerun resumes."""

  def __init__(self, *, cluster: cluster_lib.ClusterSpec, lost: str, detail: str,
               resume: tuple[int, str] | None):
    self.lost, self.detail, self.resume = lost, detail, resume
    self.resume_text = (f'a rerun resumes from {resume[1]} (step {resume[0]})' if resume
                        else 'no complete checkpoint yet: a rerun starts from step 0')
    # str(): one line, for run_status.json's `error`.
    super().__init__(f'lost {lost}; {self.resume_text}')
    self.paragraph = (
        f'Client {cluster.client_id} of {cluster.num_clients} failed: lost {lost}, '
        'killed, hung or its host gone; this client stops too.\n'
        f'TensorFlow said: {detail}\n'
        f'The checkpoints stay: {self.resume_text}. Relaunch every client with the '
        'same command.')


# Client-to-client failures: a collective or RPC to a client that is gone.
_PEER_MARKERS = ('collective ops is aborted', 'failed to connect to all addresses',
                 'socket closed', 'connection reset', 'heartbeat', 'unhealthy')


def lost_peer_error(error: BaseException) -> 'tf.errors.OpError | None':
  """The TensorFlow error in `error`'s chain (itself, its cause or the error it
  was raised while handling: meshgin rewords some) that says a peer is gone."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError,
                          tf.errors.DeadlineExceededError)) or (
        isinstance(error, tf.errors.OpError) and
        any(marker in str(error).lower() for marker in _PEER_MARKERS)):
      return error
    error = error.__cause__ or error.__context__
  return None


def lost_peer(text: str, addresses: Sequence[str], *, client_id: int) -> str:
  """'client k (host:port)' when TensorFlow's error `text` names the lost
  client (its task number, or its port), else 'a peer'."""
  # A heartbeat timeout lists the unhealthy tasks after the task reporting it.
  unhealthy = text[text.find('unhealthy'):] if 'unhealthy' in text else ''
  named = [int(task) for task in re.findall(r'/job:[^/\s]+(?:/replica:\d+)?/task:(\d+)',
                                            unhealthy + '\n' + text)]
  ports = set(re.findall(r'ipv[46]:\S*:(\d+)\b', text))  # gRPC's ipv4:127.0.0.1:9000
  named += [k for k, address in enumerate(addresses)
            if address in text or address.rsplit(':', 1)[-1] in ports]
  for k in named:
    if k != client_id and k < len(addresses):
      return f'client {k} ({addresses[k]})'
  return 'a peer'


def as_peer_lost(error: BaseException, *, cluster: cluster_lib.ClusterSpec,
              model_dir: str) -> PeerLost | None:
  """The PeerLost that `error` means in a multi-client run, or None."""
  found = lost_peer_error(error) if cluster.is_multi_client else None
  if found is None:
    return None
  return PeerLost(
      cluster=cluster, lost=lost_peer(str(found), cluster.addresses,
                                      client_id=cluster.client_id),
      detail=f'{type(found).__name__}: {one_line(found.message)}',
      resume=latest_valid(os.path.join(model_dir, 'checkpoints')))


def check_reference_is_the_start(variables: Mapping[str, Any], *, init_from: str) -> None:
  """The in-step reference of a preference run is the model with its LoRA
  adapters off: the model it starts from only if it starts with adapters
  that do nothing (lora_b zero). Adapters trained by an earlier LoRA run
  (a LoRA SFT) would make the reference the base without them."""
  trained = [path for path, v in variables.items()
             if path.endswith(B_SUFFIX) and np.any(to_numpy(v))]
  if trained:
    raise ConfigError(
        f'checkpoint.init_from {init_from!r} holds trained LoRA adapters ({trained[0]}, ...), '
        'and the reference a preference run compares with is the model with its adapters '
        'off: the base, not the tuned model it starts from',
        where='checkpoint.init_from',
        fix='merge the adapters first (launch.export --format=hf, then launch.import_hf, '
            'and start from that run), or set dpo.precompute_reference = True (the '
            'reference computed once from the starting model, adapters included)')


def run_training(plan: RunPlan, *, model_dir: str, watcher: PreemptionWatcher,
                 cluster: cluster_lib.ClusterSpec | None = None,
                 on_start: Callable[[], None] | None = None) -> TrainResult:
  """Trains as planned, resuming from `model_dir`'s checkpoints (see module doc).

  With a multi-client `cluster` (joined with `join_cluster`), every client
  runs this with the same plan and model_dir (a shared filesystem); client 0
  writes the run record and TensorBoard events; a lost client is PeerLost
  on the others. `on_start` is called once the run is validated, right
  before anything is written (launch.train records the run as running there)."""
  try:
    return _run_training(plan, model_dir=model_dir, watcher=watcher, cluster=cluster,
                         on_start=on_start)
  except Exception as e:  # pylint: disable=broad-except
    lost = as_peer_lost(e, cluster=cluster, model_dir=model_dir) if cluster else None
    if lost is None:
      raise
    raise lost from None  # TF's traceback says nothing about where the peer went


def _run_training(plan: RunPlan, *, model_dir: str, watcher: PreemptionWatcher,
                  cluster: cluster_lib.ClusterSpec | None,
                  on_start: Callable[[], None] | None) -> TrainResult:
  chief = cluster is None or cluster.client_id == 0
  for warning in plan.unsplit_axis_warnings():  # a config that runs, but wastes devices
    logging.warning('%s', warning)
  # Created now, written only after validation (SummaryWriter opens its file
  # at the first write).
  writer = SummaryWriter(model_dir) if chief else NullWriter()
  trainer = build_trainer(plan, watcher=watcher, writer=writer,
                          profile_dir=model_dir if chief else None)
  coordinator = cluster_lib.coordinator_for(trainer.engine.mesh, cluster)
  checkpointer = Checkpointer(
      directory=os.path.join(model_dir, 'checkpoints'), state=trainer.state(),
      config=plan.checkpoint, extra_files={'config.gin': plan.operative_config},
      on_event=checkpoint_event_recorder(writer), coordinator=coordinator,
      check_state=trainer.check_finite, data_state=trainer.data_state)
  checkpointer.check_latest_fits()
  check_first_batches(plan.task, batch_size=plan.train.batch_size)
  check_step_compiles(trainer.engine, plan.task, plan.train)

  watcher.reinstall()
  watcher.defer()  # writing starts: a signal now finishes the step and saves
  if chief:
    os.makedirs(model_dir, exist_ok=True)
  if on_start is not None:
    on_start()
  if chief:
    record_run(trainer, plan, model_dir=model_dir)
  restored = checkpointer.restore_latest()
  trainer.resume_data_state = checkpointer.restored_data_state
  if restored is None and plan.checkpoint.init_from:
    variables = trainer.engine.variables
    checkpointer.init_from(plan.checkpoint.init_from, variables,
                           new=[path for path in variables
                                if is_adapter(path) or frozen.is_scale(path)],
                           frozen=[path for path, v in variables.items() if not v.trainable])
    if plan.task.needs_reference:
      check_reference_is_the_start(variables, init_from=plan.checkpoint.init_from)
  elif restored is not None and chief:
    try:  # a report: it must never stop the run it reports on
      record_resume_changes(plan, writer=writer, step=restored, checkpoint_dir=os.path.join(
          model_dir, 'checkpoints', f'ckpt-{restored}'))
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('Could not compare the settings with the checkpoint\'s: %s: %s',
                      type(e).__name__, e)

  if plan.task.reference_pending:  # dpo.precompute_reference
    attach_reference(plan.task, trainer.engine, model_dir=model_dir,
                     batch_size=plan.train.batch_size, resumed=restored is not None, chief=chief)

  def after_step(step: int) -> bool:
    requested = watcher.requested
    if coordinator.num_clients > 1:  # all clients stop at the same step
      requested = any(coordinator.gather(requested))
      watcher.signal_name = watcher.signal_name or 'a signal to another client'
    if requested:
      path = checkpointer.save(step, reason='preemption')
      checkpointer.wait()
      message = (f'Preempted by {watcher.signal_name} at step {step}: saved '
                 f'{path or "(already saved)"}. Run the same command to resume.')
      logging.warning(message)
      print(message, flush=True)
      return True
    checkpointer.maybe_save(step)
    return False

  try:
    result = trainer.train(after_step=after_step)
    if plan.checkpoint.save_at_end and result.final_step == plan.train.num_steps:
      checkpointer.save(result.final_step, reason='final')
  finally:
    checkpointer.wait()
  if result.eval_losses:
    (first_step, first), (last_step, last) = result.eval_losses[0], result.eval_losses[-1]
    ratio = f' ({100 * last / first:.0f}%)' if first > 0 else ''  # 0: nothing evaluated
    versus = f' vs {first:.4f} at step {first_step}{ratio}' if first_step != last_step else ''
    logging.info('Done at step %d: eval loss %.4f at step %d%s; this process trained steps '
                 '%d..%d at %.2f steps/s', result.final_step, last, last_step, versus,
                 result.start_step, result.final_step, result.steps_per_sec)
  writer.close()
  if coordinator.num_clients > 1:
    logging.info('Training done; waiting for every client to finish')
    coordinator.barrier()  # no client leaves while another still needs it
  return result
