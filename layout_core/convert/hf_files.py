"""Safetensors weights on disk, read and written one tensor at a time.

    weights = SafetensorsReader('llama/')             # model.safetensors or its index
    weights.shapes['model.norm.weight']               # (64,), from the headers only
    weights.read('model.norm.weight')                 # np.ndarray: that tensor alone
    write_safetensors('out/', tensors(), sizes, max_shard_bytes=5 << 30)

Reading: a directory holds `model.safetensors`, or shards named by
`model.safetensors.index.json`. Every file is opened with
`safetensors.safe_open(framework='numpy')`, which memory-maps it and checks
its header against its size (a truncated file is refused on open), and a
tensor is copied out only when asked for, through a mapping of its own file
that is closed right after: an import holds one tensor (and its converted
copies) in host memory at a time. (A mapping kept open would keep every
page read so far resident in the process: the whole checkpoint by the end
of an import, measured in `bench/import_hf.py`.) bfloat16 tensors come back as
`ml_dtypes.bfloat16` arrays (safetensors 0.8 does this with numpy once
ml_dtypes is imported); the import widens each to float32 on its own.

Writing: the shards are planned from the tensors' sizes before anything is
written (names `model-00001-of-00003.safetensors`, an index when there is
more than one), then each is filled and saved in turn, so at most one
shard's tensors are in memory. The caller writes into a directory of its
own and renames it when complete.

Every problem with the files is a ConfigError naming the file (or tensor).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from layout_core.errors import ConfigError

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30   # transformers' own default shard size: 5 GB


class SafetensorsReader:
  """The tensors of a Hugging Face checkpoint directory (module doc).

  `shapes` and `dtypes` (name -> shape / safetensors dtype string) come from
  the headers; `read(name)` copies one tensor out."""

  def __init__(self, directory: str):
    self.directory = directory
    self.file_of: dict[str, str] = {}
    self.shapes: dict[str, tuple[int, ...]] = {}
    self.dtypes: dict[str, str] = {}
    # safetensors gives bfloat16 to numpy only once ml_dtypes (TensorFlow's own
    # dependency) is imported; without it, get_tensor raises TypeError.
    import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import
    single = os.path.join(directory, SINGLE_FILE)
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
      weight_map = _weight_map(index_path)
    elif os.path.isfile(single):
      weight_map = None
    else:
      others = sorted(n for n in os.listdir(directory)
                      if n.endswith(('.bin', '.pt', '.pth', '.h5', '.msgpack')))
      found = f' (it has {", ".join(others)}: not safetensors)' if others else ''
      raise ConfigError(f'{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}{found}',
                        where='--hf_dir', fix='give a directory with safetensors weights, as '
                        'save_pretrained writes them (transformers can convert a .bin '
                        'checkpoint: load it and save_pretrained(safe_serialization=True))')
    for name in sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]:
      path = os.path.join(directory, name)
      if not os.path.isfile(path):
        raise ConfigError(f'the shard {path} named by {index_path} does not exist',
                          where=index_path, fix='download every shard the index names')
      with _opened(path) as handle:
        for key in handle.keys():
          if weight_map is not None and weight_map.get(key) != name:
            if key not in weight_map:
              raise ConfigError(f'{path} holds {key!r}, which {index_path} does not list',
                                where=index_path, fix='give the index saved with these shards')
            continue  # listed under another shard: that shard's copy is the one read
          piece = handle.get_slice(key)
          self.file_of[key] = name
          self.shapes[key] = tuple(int(s) for s in piece.get_shape())
          self.dtypes[key] = piece.get_dtype()
    if weight_map is not None:
      lost = sorted(k for k in weight_map if k not in self.file_of)
      if lost:
        raise ConfigError(f'{len(lost)} tensor(s) listed in {index_path} are not in their '
                          f'shard: {", ".join(f"{k} ({weight_map[k]})" for k in lost[:4])}',
                          where=index_path, fix='download the shards again')

  def read(self, name: str) -> np.ndarray:
    """The tensor `name`, copied into host memory (its file mapped meanwhile)."""
    with _opened(os.path.join(self.directory, self.file_of[name])) as handle:
      return handle.get_tensor(name)


@contextlib.contextmanager
def _opened(path: str) -> Iterator:
  """`safe_open(path)`, its mapping closed on leaving; a file safetensors
  refuses (truncated, damaged) is a ConfigError naming it."""
  from safetensors import SafetensorError, safe_open  # pylint: disable=g-import-not-at-top
  try:
    handle = safe_open(path, framework='numpy')
  except (SafetensorError, OSError) as e:
    raise ConfigError(f'{path} is not a readable safetensors file ({e})', where=path,
                      fix='download the file again (it is truncated or damaged)') from None
  with handle as opened:
    yield opened


def _weight_map(index_path: str) -> dict[str, str]:
  try:
    with open(index_path) as f:
      weight_map = json.load(f)['weight_map']
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
      raise ValueError('weight_map is not {tensor name: file name}')
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ConfigError(f'{index_path} is not a safetensors index ({type(e).__name__}: {e})',
                      where=index_path, fix='give the index.json saved with the shards') from None
  return weight_map


def plan_shards(sizes: Sequence[tuple[str, int]], *, max_shard_bytes: int) -> list[list[str]]:
  """The tensor names of each shard, in order, each shard at most
  `max_shard_bytes` unless one tensor alone is larger (it gets its own)."""
  shards: list[list[str]] = [[]]
  total = 0
  for name, size in sizes:
    if shards[-1] and total + size > max_shard_bytes:
      shards.append([])
      total = 0
    shards[-1].append(name)
    total += size
  return shards


def shard_file_names(count: int) -> list[str]:
  """transformers' names: model.safetensors, or model-0000k-of-0000n.safetensors."""
  if count == 1:
    return [SINGLE_FILE]
  return [f'model-{k:05d}-of-{count:05d}.safetensors' for k in range(1, count + 1)]


def write_safetensors(directory: str, tensor: Callable[[str], np.ndarray],
                      sizes: Sequence[tuple[str, int]], *,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      metadata: Mapping[str, str] | None = None) -> list[str]:
  """Writes the tensors `sizes` names (name, bytes), each made by
  `tensor(name)` when its shard is written, into `directory` (which must
  exist), sharded as `plan_shards` says, with an index when sharded.
  Returns the files written."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  shards = plan_shards(sizes, max_shard_bytes=max_shard_bytes)
  names = shard_file_names(len(shards))
  weight_map = {}
  for file_name, members in zip(names, shards):
    save_file({name: np.ascontiguousarray(tensor(name)) for name in members},
              os.path.join(directory, file_name), metadata={'format': 'pt', **(metadata or {})})
    weight_map.update({name: file_name for name in members})
  if len(names) > 1:
    index = {'metadata': {'total_size': sum(size for _, size in sizes)},
             'weight_map': dict(sorted(weight_map.items()))}
    with open(os.path.join(directory, INDEX_FILE), 'w') as f:
      json.dump(index, f, indent=2)
    names.append(INDEX_FILE)
  return names


def read_config(directory: str, name: str = 'config.json') -> dict:
  """The JSON file `name` of a Hugging Face directory; ConfigError naming it."""
  path = os.path.join(directory, name)
  if not os.path.isdir(directory):
    raise ConfigError(f'--hf_dir {directory!r} is not a directory', where='--hf_dir',
                      fix='give the directory a Hugging Face model was downloaded to '
                          '(config.json and model.safetensors)')
  try:
    with open(path) as f:
      config = json.load(f)
  except FileNotFoundError:
    raise ConfigError(f'{path} does not exist', where='--hf_dir',
                      fix='give the directory holding the model\'s config.json') from None
  except (OSError, ValueError) as e:
    raise ConfigError(f'{path} is not JSON ({e})', where=path,
                      fix='download config.json again') from None
  if not isinstance(config, dict):
    raise ConfigError(f'{path} is not a JSON object', where=path,
                      fix='download config.json again')
  return config


def nbytes(shape: Iterable[int], dtype: np.dtype) -> int:
  return int(np.prod(tuple(shape), dtype=np.int64)) * np.dtype(dtype).itemsize
