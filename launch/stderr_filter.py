"""The quiet console's filter: a small process between TensorFlow and the real stderr.

`gin_flags.quiet_tensorflow` points the launcher's file descriptor 2 at a pipe
and starts this file as a child process (`python -I -S stderr_filter.py`, with
the pipe as its stdin and the real stderr as its stdout). It copies every line
except TensorFlow's info noise (`NOISE`):

    I0000 00:00:1795653199.51 7956 port.cc:153] oneDNN custom operations are on...   dropped
    W0000 00:00:1795653199.52 7956 some_op.cc:12] a warning                          kept
    F0000 00:00:1795653199.53 7956 check.cc:42] Check failed: ...                   kept

and the error lines every device's collective writes when a peer of a
multi-client run is lost (`ABORTS`: 'Aborting RingReduce with UNAVAILABLE',
gRPC's detail lines), a dozen per step; the launcher says what happened in
one paragraph instead (`plugins.training.PeerLost`), and --verbose shows them.

Why a process and not a thread in the launcher: a thread dies with the process,
so the fatal line TensorFlow writes just before it aborts could be left unread
in the pipe; and a thread that stopped (an exception) would leave fd 2 a pipe
nobody reads, so TensorFlow's next 64 KiB of log would block the trainer
forever. This process outlives an abort of the launcher, drains the pipe and
exits at end of file (every writer gone). If it cannot write (its stdout
closed), it goes on reading and discards, so writers never block; if it is
killed, writers get EPIPE instead of blocking (the launcher holds no read end).
It needs nothing outside the standard library (run with -S: quick to start).
"""

import os
import re
import signal

# Info lines of TensorFlow's C++ side ('I0000 00:00:... port.cc:153] ...') and
# its fixed start-up notes; warnings, errors and fatal lines pass.
NOISE = re.compile(rb'I\d{4} [^\]]*\.cc:\d+\] '
                   rb'|WARNING: All log messages before absl::InitializeLog'
                   rb'|To enable the following instructions|E\d{4} .*failed call to cuInit')
# A lost peer's collective aborts, logged by TensorFlow on every device, and
# the detail lines of those multi-line messages.
ABORTS = re.compile(rb'E\d{4} [^\]]*(base_collective_executor|ring_alg)\.cc:\d+\] '
                    rb'|Additional GRPC error information from remote target '
                    rb'|:UNKNOWN:Error received from peer '
                    rb'|The error could be from a previous operation\. Restart your program')


def _write_all(descriptor: int, data: bytes) -> None:
  while data:
    data = data[os.write(descriptor, data):]


def copy_lines(*, source: int, sink: int) -> None:
  """Copies the lines of `source` that are not NOISE to `sink` until end of
  file; once `sink` fails (closed), the rest is read and dropped."""
  sink_open = True
  with os.fdopen(source, 'rb', closefd=False) as lines:
    for line in lines:
      if not sink_open or NOISE.match(line) or ABORTS.match(line):
        continue
      try:
        _write_all(sink, line)
      except OSError:
        sink_open = False  # nobody reads the console: keep draining so writers never block


def main() -> None:
  # Signals meant for the launcher (Ctrl-C, a sweep's SIGTERM) are not for
  # this process: it ends when the launcher's last line has been copied.
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, signal.SIG_IGN)
  copy_lines(source=0, sink=1)


if __name__ == '__main__':
  main()
