r"""Run N clients of one training on this machine, as a real cluster would.

  python -m launch.local_cluster --num_clients=2 --devices_per_client=4 -- \
      --gin_file=configs/experiments/lm_2d.gin --model_dir=/tmp/run2

Picks N free localhost ports, starts `python -m launch.train <train args>
--cluster=... --client_id=k --devices_per_client=D` for k = 0..N-1 (each in
its own process group), prints their output line by line prefixed with
`[client k]`, forwards SIGTERM / SIGINT to every client (so a preempted
cluster saves and exits together), and exits with the worst client status
(a client killed by signal S counts as 128 + S). If one client fails and the
others have not exited `--grace_seconds` later, they are killed: nothing is
left running.
"""

from __future__ import annotations

if __name__ == '__main__':  # first, before the imports below take their time
  import launch
  launch.install_start_up_handlers()

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from plugins.run_status import shell_status


NUM_CLIENTS = flags.DEFINE_integer('num_clients', 2, 'Clients to start.')
DEVICES_PER_CLIENT = flags.DEFINE_integer(
    'devices_per_client', 4, 'Virtual CPU devices per client; the config\'s mesh '
    'must have num_clients x devices_per_client devices.')
CLIENT_ARGS = flags.DEFINE_multi_string(
    'client_arg', [], 'K:ARG gives launch.train the extra argument ARG on client K only '
    '(e.g. 1:--gin_bindings=optimizer.learning_rate = 0.1, to see clients that '
    'disagree refused). Repeatable.')
GRACE_SECONDS = flags.DEFINE_float(
    'grace_seconds', 60.0, 'After a client fails, how long the others get to exit on '
    'their own before they are killed.')


def free_ports(count: int) -> list[int]:
  """`count` distinct free TCP ports, sorted so that their string order is their
  numeric order (DTensor numbers clients by the sorted address list)."""
  sockets = []
  try:
    while len(sockets) < count:
      s = socket.socket()
      s.bind(('localhost', 0))
      sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()
  if len({len(str(p)) for p in ports}) > 1:  # mixed digit counts: try again
    return free_ports(count)
  return sorted(ports)


class LocalCluster:
  """The client processes, their log pumps and signal forwarding."""

  def __init__(self, train_args: list[str], *, num_clients: int, devices_per_client: int,
               client_args: dict[int, list[str]] | None = None):
    ports = free_ports(num_clients)
    cluster = ','.join(f'localhost:{p}' for p in ports)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env['PYTHONPATH'] = repo + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
    for name in ('DTENSOR_CLIENT_ID', 'DTENSOR_JOBS', 'DTENSOR_JOB_NAME', 'DTENSOR_NUM_CLIENTS'):
      env.pop(name, None)
    self.processes = []
    self.pumps = []
    print(f'[cluster] {num_clients} clients x {devices_per_client} devices at {cluster}',
          flush=True)
    for client in range(num_clients):
      command = [sys.executable, '-u', '-m', 'launch.train', *train_args,
                 *(client_args or {}).get(client, []), f'--cluster={cluster}', f'--client_id={client}',
                 f'--devices_per_client={devices_per_client}']
      process = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
      self.processes.append(process)
      pump = threading.Thread(target=self._pump, args=(client, process), daemon=True)
      pump.start()
      self.pumps.append(pump)

  @staticmethod
  def _pump(client: int, process: subprocess.Popen) -> None:
    for line in iter(process.stdout.readline, b''):
      sys.stdout.write(f'[client {client}] {line.decode(errors="replace")}')
      sys.stdout.flush()

  def signal_all(self, signum: int) -> None:
    for process in self.processes:
      if process.poll() is None:
        try:
          os.killpg(process.pid, signum)
        except ProcessLookupError:
          pass

  def wait(self, grace_seconds: float) -> int:
    """Waits for every client; returns the worst exit status."""
    failed_at = None
    while any(p.poll() is None for p in self.processes):
      codes = [p.poll() for p in self.processes]
      if failed_at is None and any(c not in (None, 0) for c in codes):
        failed_at = time.monotonic()
      if failed_at is not None and time.monotonic() - failed_at > grace_seconds:
        stuck = [k for k, c in enumerate(codes) if c is None]
        print(f'[cluster] clients {stuck} still running {grace_seconds:g} s after a peer '
              'failed: killing them', flush=True)
        self.signal_all(signal.SIGKILL)
      time.sleep(0.2)
    for pump in self.pumps:
      pump.join(timeout=5)
    codes = [shell_status(p.returncode) for p in self.processes]
    print(f'[cluster] exit status per client: {codes}', flush=True)
    return max(codes)

  def kill_all(self) -> None:
    """Leaves nothing running (each client's process group, watchdog included)."""
    self.signal_all(signal.SIGKILL)
    for process in self.processes:
      process.wait()


def main(argv):
  train_args = argv[1:]
  client_args: dict[int, list[str]] = {}
  for text in CLIENT_ARGS.value:
    client, _, arg = text.partition(':')
    if not client.isdigit() or not 0 <= int(client) < NUM_CLIENTS.value or not arg:
      raise app.UsageError(f'--client_arg={text!r} is not K:ARG with K in '
                           f'0..{NUM_CLIENTS.value - 1}')
    client_args.setdefault(int(client), []).append(arg)
  cluster = LocalCluster(train_args, num_clients=NUM_CLIENTS.value,
                         devices_per_client=DEVICES_PER_CLIENT.value, client_args=client_args)
  forward = lambda signum, frame: cluster.signal_all(signum)  # noqa: E731
  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)
  try:
    status = cluster.wait(GRACE_SECONDS.value)
  finally:
    cluster.kill_all()
  sys.exit(status)


if __name__ == '__main__':
  app.run(main, flags_parser=launch.parse_flags)
