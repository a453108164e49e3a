"""A client of a multi-client run that is lost mid-run (SIGKILL, a node gone)
is an expected fault: the survivors say so in one paragraph, with no traceback.

The paragraph names the lost client (its id and address, when TensorFlow's
error gives them) and the checkpoint a rerun resumes from; the exit status is
`run_status.EXIT_PEER_LOST` and client 0's run_status.json says `peer_lost`.
One real 2-client run (the 1-layer 2x2 model of tests/test_multi_client.py),
plus the message cleaner on TensorFlow's real error text.
"""

import os
import re
import signal

from plugins import run_status
from tests.test_multi_client import ARGS, Client, cleanup, free_cluster, steps

# What TensorFlow 2.21 raised in client 0 (`MeshCoordinator.gather`, a tiny
# all-reduce) once client 1, at localhost:58297, was SIGKILLed.
TF_LOST_PEER_ERROR = (
    '{{function_node __inference_<lambda>_1890__func_17916441523356718885_5542397561160443410'
    '_43}} Collective ops is aborted by: failed to connect to all addresses; last error: '
    'UNKNOWN: ipv4:127.0.0.1:58297: Failed to connect to remote host: Connection refused\n'
    'Additional GRPC error information from remote target /job:worker/replica:0/task:1 '
    'while calling /tensorflow.WorkerService/RecvBuf:\n'
    ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"failed to connect '
    'to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:58297: Failed to connect to '
    'remote host: Connection refused"}\n'
    'The error could be from a previous operation. Restart your program to reset.\n'
    '\t [[{{node Sum/DTensorAllReduceOp}}]]')
ADDRESSES = ('localhost:58296', 'localhost:58297')


def test_the_cleaner_keeps_the_first_line_without_tensorflows_function_names():
  line = run_status.one_line(TF_LOST_PEER_ERROR)
  assert line == ('Collective ops is aborted by: failed to connect to all addresses; last '
                  'error: UNKNOWN: ipv4:127.0.0.1:58297: Failed to connect to remote host: '
                  'Connection refused'), line
  assert run_status.one_line('{{function_node __inference_f_7}}\n\t [[{{node x}}]]\nboom') == (
      'boom')
  assert run_status.one_line('corrupted record at 12 [Op:IteratorGetNext] name: ') == (
      'corrupted record at 12')
  assert run_status.one_line('  \n') == ''


def test_the_lost_peer_and_the_resume_point_are_named():
  from plugins.training import PeerLost, lost_peer
  from layout_core.layout.cluster import ClusterSpec
  assert lost_peer(TF_LOST_PEER_ERROR, ADDRESSES, client_id=0) == 'client 1 (localhost:58297)'
  by_port = TF_LOST_PEER_ERROR.replace('task:1', 'task:?')
  assert lost_peer(by_port, ADDRESSES, client_id=0) == 'client 1 (localhost:58297)'
  assert lost_peer('Socket closed', ADDRESSES, client_id=0) == 'a peer'
  hung = ('Collective ops is aborted by: Error reported from /job:worker/task:0: The following '
          'tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:2\n')
  assert lost_peer(hung, (*ADDRESSES, 'localhost:58298'), client_id=1) == (
      'client 2 (localhost:58298)')
  assert lost_peer(TF_LOST_PEER_ERROR, ADDRESSES, client_id=1) == 'a peer'  # never itself
  cluster = ClusterSpec(client_id=0, addresses=ADDRESSES)
  fresh = PeerLost(cluster=cluster, lost='a peer', detail='UnavailableError: x', resume=None)
  assert 'no complete checkpoint yet: a rerun starts from step 0' in fresh.paragraph
  assert fresh.paragraph.startswith('Client 0 of 2 failed: lost a peer, ')
  assert '\n\n' not in fresh.paragraph and str(fresh).count('\n') == 0


def test_a_killed_peer_ends_the_other_client_with_one_paragraph(tmp_path):
  model_dir = str(tmp_path)
  cluster = free_cluster()
  clients = [Client(k, cluster, *ARGS, steps(1000), f'--model_dir={model_dir}')
             for k in (0, 1)]
  try:
    clients[0].wait_for(r'Saved checkpoint .*ckpt-2/ckpt', timeout=300)
    clients[0].wait_for(r'step 3/1000', timeout=60)
    clients[1].kill(signal.SIGKILL)
    clients[0].exit_seconds(timeout=60)
  finally:
    cleanup(clients)
  output = clients[0].output
  assert 'Traceback' not in output, output[-3000:]
  assert '__inference_' not in output, output[-3000:]
  assert 'Aborting RingReduce' not in output and 'GRPC error' not in output, output[-3000:]
  assert clients[0].process.returncode == run_status.EXIT_PEER_LOST, output[-3000:]
  peer = cluster.split(',')[1]
  assert re.search(r'Client 0 of 2 failed: lost (client 1 \(' + re.escape(peer) +
                   r'\)|a peer),', output), output[-3000:]
  newest = max(int(n.split('-')[1]) for n in os.listdir(os.path.join(model_dir, 'checkpoints'))
               if re.fullmatch(r'ckpt-\d+', n))
  resume = os.path.join(model_dir, 'checkpoints', f'ckpt-{newest}', 'ckpt')
  assert f'a rerun resumes from {resume} (step {newest})' in output, output[-3000:]
  record = run_status.read_run_status(model_dir)
  assert record.status == run_status.PEER_LOST, record
  assert record.exit_code == run_status.EXIT_PEER_LOST
  assert 'lost' in record.error and '__inference_' not in record.error, record.error
