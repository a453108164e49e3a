r"""Train a model from gin config files.

  python -m launch.train --gin_file=configs/experiments/quickstart.gin \
      --model_dir=/tmp/quickstart [--gin_bindings='train.num_steps = 50']

Builds the mesh, the Params tree and the layout scope from the config, trains,
and writes to --model_dir: config.gin (operative config), params.txt,
layouts.txt, checkpoints and TensorBoard events (`tensorboard --logdir <model_dir>`).
Running the same command again resumes from the newest checkpoint.

--model_dir is required: there is no default directory that a forgotten flag
would quietly resume.

Exit status (docs/configuration.md#exit-statuses-and-run_statusjson):
  0    success; also when stopped by SIGTERM, SIGINT or SIGUSR1 (the current
       step finishes and a checkpoint is saved)
  1    a crash: a bug, with its traceback (single process), or a peer client
       lost or failed (multi-client; see below)
  2    a configuration error: one paragraph saying what, where (gin file and
       line) and how to fix it
  3    the loss became NaN or infinite (one line: 'Training diverged: ...')
  5    a data file turned out corrupt or truncated mid-run ('Data error: data
       file F cannot be read: ...'; the checkpoints written before it stay)
  143  under a scheduler (--cluster=slurm or tf_config): stopped by a signal,
       after saving; asks the scheduler to requeue the job, which resumes
  -9   a client killed by its start-up watchdog: the cluster did not form
       within --cluster_init_timeout (it names the peers that never joined)

Nothing in --model_dir is created or changed before the config, the machine
and any existing checkpoint have been checked, except its lock file: one run
per --model_dir (a second one exits 2 naming the first), and no checkpoint
holding a NaN or Inf is ever committed (exit 3 names the first bad step).

Several processes or hosts train one model as the clients of one global mesh
(every client: same flags, its own --client_id; see launch/local_cluster.py):

  python -m launch.train ... --cluster=h0:9000,h1:9000 --client_id=0   # on h0
  python -m launch.train ... --cluster=h0:9000,h1:9000 --client_id=1   # on h1

A client whose peer is lost mid-run (killed, hung, its host gone) exits 1
with one paragraph, no traceback: 'Client 0 of 2 failed: lost client 1
(host:port) ...' and the checkpoint a rerun resumes from (run_status.json:
peer_lost); any other failure of a peer also exits 1, naming this client.

Under a scheduler every task runs the same command, and the scheduler's
environment says who is who (docs/cluster.md):

  srun -n 2 python -m launch.train ... --cluster=slurm     # Slurm: srun / sbatch
  python -m launch.train ... --cluster=tf_config           # TF_CONFIG (Kubernetes)

There a run stopped by a signal saves and exits 143, which asks the scheduler
to run the job again; the requeued job resumes.

A run that seems stuck says where it is: `kill -USR2 <pid>` prints every
thread's Python stack to stderr, and the run goes on.
"""

from __future__ import annotations

if __name__ == '__main__':  # first, before the imports below take their time
  import launch
  launch.install_start_up_handlers()

import os
import sys
import traceback

from absl import app, flags, logging


from launch import gin_flags

flags.adopt_module_key_flags(gin_flags)  # show the gin flags in --help

MODEL_DIR = flags.DEFINE_string(
    'model_dir', None, 'Required. The run\'s directory: checkpoints, TensorBoard '
    'events and the run record (config.gin, params.txt, layouts.txt). A new directory '
    'starts a run; the directory of an earlier run resumes it (same config).')

CLIENT_ID = flags.DEFINE_integer(
    'client_id', None, 'This process\'s index in --cluster (default: $DTENSOR_CLIENT_ID or 0).')
NUM_CLIENTS = flags.DEFINE_integer(
    'num_clients', None, 'Number of clients; checked against --cluster when given.')
CLUSTER = flags.DEFINE_list(
    'cluster', [], 'Who the clients are: "slurm" (every task of the srun step is a '
    'client; Slurm\'s variables give hosts and ids), "tf_config" (the TF_CONFIG '
    'variable\'s chief and workers), or host:port of every client, in client order and '
    'sorted as strings (default: $DTENSOR_JOBS). Empty: a single process; anything else '
    'is an error (exit 2). Checkpoints and --model_dir must be on a filesystem every '
    'client shares.')
CLUSTER_PORT = flags.DEFINE_integer(
    'cluster_port', None, 'With --cluster=slurm: the port of each node\'s first task (the '
    'next tasks on a node take the next ports). Default: a block of 16 ports picked '
    'from the job id, in 12000..31999 (below the kernel\'s ephemeral ports).')
CLUSTER_INIT_TIMEOUT = flags.DEFINE_float(
    'cluster_init_timeout', 120.0, 'Seconds to wait for every client to join; after '
    'that this client exits, naming the peers that never started.')

DEVICES_PER_CLIENT = flags.DEFINE_integer(
    'devices_per_client', None, 'Devices each client brings to the mesh (default: '
    'the mesh size / the number of clients); checked against mesh.shape.')


def cluster_from_flags():
  from layout_core.layout.cluster import ClusterSpec  # pylint: disable=g-import-not-at-top
  return ClusterSpec.from_options(client_id=CLIENT_ID.value, num_clients=NUM_CLIENTS.value,
                                  cluster=CLUSTER.value, port=CLUSTER_PORT.value,
                                  init_timeout=CLUSTER_INIT_TIMEOUT.value)


def exit_client(cluster, error: BaseException | None, code: int | None = None) -> None:
  """Ends a multi-client process at once: TF's runtime can hang at interpreter
  exit once a peer is gone, so the client says why and leaves with os._exit."""
  if error is not None:
    from plugins.run_status import one_line  # pylint: disable=g-import-not-at-top
    traceback.print_exception(error)
    print(f'\nClient {cluster.client_id} of {cluster.num_clients} failed: '
          f'{type(error).__name__}: {one_line(str(error))}'
          '\n(a peer that died or hung makes the others fail like this; relaunch every '
          'client to resume from the last checkpoint)', file=sys.stderr)
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  if code is None:
    code = 1 if error is not None else 0
  os._exit(code)  # pylint: disable=protected-access


def final_metrics(result) -> dict[str, float]:
  """run_status.json's metrics: the evaluation at the final step (a run
  stopped early has none), the last train loss, the speed."""
  evaluated_last = result.eval_losses and result.eval_losses[-1][0] == result.final_step
  metrics = ({f'eval_{name}': value for name, value in result.eval_metrics.items()}
             if evaluated_last else {})
  if result.train_loss is not None:
    metrics['train_loss'] = result.train_loss
  metrics['steps_per_sec'] = result.steps_per_sec
  return metrics


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)

  held = []  # the model_dir lock, released however the run ends

  def release_lock():
    while held:
      held.pop().release()

  def leave(cluster, error, code=None):
    release_lock()
    exit_client(cluster, error, code)

  def body(watcher):
    # pylint: disable=g-import-not-at-top
    from layout_core.checkpoint.lock import DirectoryLock, LockedError
    from layout_core.errors import ConfigError
    from layout_core.layout import scheduler
    from plugins import plan, run_status
    gin_flags.require_model_dir(MODEL_DIR.value, 'a run')
    attempt = os.environ.get(run_status.ATTEMPT_VARIABLE)  # e.g. a sweep trial's
    record = run_status.RunStatusFile(MODEL_DIR.value, attempt=attempt)
    try:
      with gin_flags.parsed_config():
        cluster = cluster_from_flags()
        record = run_status.RunStatusFile(
            MODEL_DIR.value, enabled=cluster.client_id == 0,
            restart_count=scheduler.restart_count(os.environ) if cluster.source else None,
            attempt=attempt)
        run_plan = plan.make_plan()
        plan.check_model_dir(MODEL_DIR.value)
        plan.check_data_tokenizer(run_plan, model_dir=MODEL_DIR.value)
        if cluster.client_id == 0:  # one writer per model_dir, before anything else
          with watcher.uninterrupted():  # a lock taken is a lock released on the way out
            held.append(DirectoryLock.acquire(MODEL_DIR.value, purpose='launch.train'))
        join(run_plan, cluster, record)
        result = train(run_plan, cluster, watcher, record)
        final = run_status.PREEMPTED if result.stopped_early else run_status.COMPLETED
        # Stopped under a scheduler: ask it to run the job again (it resumes).
        code = (run_status.EXIT_REQUEUE if result.stopped_early and cluster.under_scheduler
                else run_status.EXIT_OK)
        record.write(final, step=result.final_step, exit_code=code,
                     metrics=final_metrics(result))
        if cluster.is_multi_client:
          leave(cluster, None, code)
        if code:
          sys.exit(code)  # the lock is released on the way out (finally, below)
    except LockedError:
      raise  # the directory is another run's: write nothing into it
    except ConfigError as e:
      release_lock()  # first: a directory the lock created goes with it
      record.write_rejection(e)
      raise
    finally:
      release_lock()

  def join(run_plan, cluster, record):
    """Joins the cluster; a peer that fails to agree (e.g. times out comparing
    settings) ends a multi-client process at once, as a failure in training does."""
    # pylint: disable=g-import-not-at-top
    from layout_core.errors import ConfigError
    from plugins import training
    try:
      training.join_cluster(run_plan, cluster, devices_per_client=DEVICES_PER_CLIENT.value)
    except ConfigError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      crashed(cluster, record, e)
      raise

  def crashed(cluster, record, error):
    """Records a crash; a multi-client process then ends at once (a single
    process raises on, with its traceback, exit 1)."""
    from plugins import run_status  # pylint: disable=g-import-not-at-top
    record.write(run_status.CRASHED, exit_code=1,
                 error=f'{type(error).__name__}: {run_status.one_line(str(error))}')
    if cluster.is_multi_client:
      leave(cluster, error)

  def train(run_plan, cluster, watcher, record):
    # pylint: disable=g-import-not-at-top
    from layout_core.errors import ConfigError
    from layout_core.tasks.streams import DataError
    from plugins import run_status, training
    try:
      return training.run_training(run_plan, model_dir=MODEL_DIR.value, watcher=watcher,
                                   cluster=cluster,
                                   on_start=lambda: record.write(run_status.RUNNING))
    except FloatingPointError as e:  # raised by the trainer on a non-finite loss
      record.write(run_status.DIVERGED, exit_code=run_status.EXIT_DIVERGED, error=str(e))
      if cluster.is_multi_client:
        print(f'\nTraining diverged: {e}', file=sys.stderr)
        leave(cluster, None, run_status.EXIT_DIVERGED)
      logging.error('Training diverged: %s', e)
      print(f'\nTraining diverged: {e}', file=sys.stderr)
      sys.exit(run_status.EXIT_DIVERGED)
    except ConfigError:
      raise
    except training.PeerLost as e:  # an expected fault: no traceback
      record.write(run_status.PEER_LOST, exit_code=run_status.EXIT_PEER_LOST, error=str(e))
      print(f'\n{e.paragraph}', file=sys.stderr)
      leave(cluster, None, run_status.EXIT_PEER_LOST)
    except DataError as e:  # a corrupt or truncated file, named
      record.write(run_status.DATA_ERROR, exit_code=run_status.EXIT_DATA_ERROR, error=str(e))
      print(f'\nData error: {run_status.one_line(str(e))}', file=sys.stderr)
      if cluster.is_multi_client:
        leave(cluster, None, run_status.EXIT_DATA_ERROR)
      logging.error('Data error: %s', e)
      sys.exit(run_status.EXIT_DATA_ERROR)
    except Exception as e:  # pylint: disable=broad-except
      crashed(cluster, record, e)
      raise

  gin_flags.run_guarded(body)


if __name__ == '__main__':
  app.run(main, flags_parser=launch.parse_flags)
