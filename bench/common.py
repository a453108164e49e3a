"""What the limit benchmarks share: a measurement in a fresh Python process
(environment variables TensorFlow reads at import or compile time differ per
process) and the JSON they write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Mapping

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')


def run_child(code: str, *args: str, env: Mapping[str, str | None] = ()) -> Any:
  """Runs `python -c code args...` with `env` changes (None: unset) and
  returns the JSON it printed after 'RESULT '."""
  environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  for name, value in dict(env).items():
    if value is None:
      environ.pop(name, None)
    else:
      environ[name] = value
  done = subprocess.run([sys.executable, '-c', code, *args], env=environ,
                        capture_output=True, text=True, check=True)
  return json.loads(done.stdout.split('RESULT ', 1)[1])


def write_json(results: Any, path: str) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(results, f, indent=1)
  print(f'wrote {path}')
