"""A trained model as a SavedModel on one device: no DTensor, no meshgin to load it.

A checkpoint holds every variable's global value whatever mesh wrote it
(each device wrote its slices of one ordinary `tf.train` checkpoint, and a
pipelined run wrote its stacked cells under the unstacked model's keys), so
the export reads those values straight from the checkpoint into plain
`tf.Variable`s on one device, runs the model's own layers over them, and
saves that:

    model = load_plain_model(params, task=task, prefix='runs/lm/checkpoints/ckpt-300/ckpt')
    signatures = lm_signatures(model, seq_len=64, prompt_len=32, max_new_tokens=32,
                               decoder=cached_decoder(model))
    export_saved_model(model, signatures, export_dir='exports/lm/1',
                       about={'checkpoint': 'runs/lm/checkpoints/ckpt-300/ckpt'})

    # anywhere, with TensorFlow alone:
    loaded = tf.saved_model.load('exports/lm/1')
    loaded.signatures['serving_default'](tokens=ids)['logits']   # [batch, 64, vocab]
    loaded.signatures['generate'](prompts=p, lengths=n)['tokens']   # [batch, 32]

Signatures: an LM (one int32 [batch, time] input, logits [batch, time,
vocab] out) gets `serving_default` (tokens -> logits) and `generate`
(prompts, lengths -> new tokens, the cached decoder's loop of
`layout_core.infer.decode.CachedLM` inside the graph); any other model gets
`serving_default` from the task's model inputs to the model's outputs
('predictions').

The directory appears whole or not at all: it is written beside the target
under a temporary name, checked (its graphs hold no DTensor op), then
renamed. `tflite_bytes` converts signatures with TensorFlow Lite.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from layout_core.checkpoint.frozen_base import CheckpointView, open_view
from layout_core.checkpoint.matching import check_fits, key_for_name, names_in
from layout_core.checkpoint.shard_io import VALUE_SUFFIX, CheckpointEntry, checkpoint_entries
from layout_core.durable import directory_aside
from layout_core.errors import ConfigError
from layout_core.infer.decode import CachedLM, lm_layers
from layout_core.infer.decode import check_fits as check_decoding_fits
from layout_core.infer.sampling import Sampling
from layout_core.layout.variables import VariableSpec, variable_creator
from layout_core.lazy import tf
from layout_core.model import frozen, lora, tuning
from layout_core.model.base import compute_params
from layout_core.model.built import traced_function
from layout_core.params import Params
from layout_core.tasks import Task

if TYPE_CHECKING:
  from layout_core.model.keras import KerasModel

# Op types that only DTensor's graphs hold; an export must have none.
DTENSOR_OP_MARKERS = ('DTensor', 'Relayout', 'CopyToMesh', 'Mesh')
EXPORT_INFO = os.path.join('assets.extra', 'meshgin_export.json')
TFLITE_FILE = 'model.tflite'


# -- the model on plain variables ------------------------------------------------------
@dataclasses.dataclass
class PlainModel:
  """A model on one device: plain `tf.Variable`s holding a checkpoint's values."""
  call: Callable[..., Any]            # (*model inputs) -> outputs, inference mode
  variables: dict[str, Any]           # variable path -> tf.Variable
  input_specs: tuple                  # ((shape with batch None, dtype), ...), the task's
  params: Params | None               # the Params tree (None: a Keras model)

  def is_lm(self) -> bool:
    """One int32 [batch, time] input and [batch, time, vocab] outputs."""
    if self.params is None or len(self.input_specs) != 1:
      return False
    shape, dtype = self.input_specs[0]
    if dtype != 'int32' or len(shape) != 2:
      return False
    [out] = self.params.cls.fprop_meta(self.params, (1, shape[1])).out_shapes
    return len(out) == 3 and tuple(out[:2]) == (1, shape[1])


def load_plain_model(model: Params | KerasModel, *, task: Task, prefix: str,
                     compute_dtype: str = 'float32',
                     moved_base: str | None = None) -> PlainModel:
  """`model` (a Params tree or a `layout_core.model.keras.KerasModel`) on
  plain variables, each assigned the global value the checkpoint at `prefix`
  holds under the key a training run of it saves (`checkpoint_entries`).
  A model with LoRA adapters is loaded as its base model, each adapted
  weight merged with its adapters (`lora.merged`): the same function, with
  no adapter path left to run. Frozen weights a fine-tuned run's checkpoint
  holds by reference are read from its base (`frozen_base`; `moved_base`:
  where it moved). ConfigError when the checkpoint is not this model's (keys
  or shapes), or its base is missing or changed."""
  view = open_view(prefix, moved_to=moved_base)
  specs = tuple(((None,) + tuple(shape[1:]), str(dtype)) for shape, dtype in task.input_specs(1))
  adapters = tuning.lora_of(model) if isinstance(model, Params) else None
  if isinstance(model, Params):
    params = compute_params(tuning.untuned(model) if adapters else model.Copy().Freeze(),
                            dtype=compute_dtype)
    variables: dict[str, Any] = {}

    def zeros(spec: VariableSpec):  # its value comes from the checkpoint
      variables[spec.path] = tf.Variable(tf.zeros(spec.shape, spec.dtype), trainable=False,
                                         name=spec.path.replace('/', '.'))
      return variables[spec.path]
    with variable_creator(zeros):
      module = params.Instantiate()
    root, call = module, module
  else:
    params, (root, call) = None, _keras_on_one_device(model, specs, compute_dtype)
    variables = dict(root.by_path)
  entries = checkpoint_entries({'model': root})
  values = read_values(view, entries, adapters=adapters is not None)
  for entry in entries:
    entry.variable.assign(values[entry.key])
  if adapters is not None:
    _merge_adapters(variables, view=view, scale=adapters.scale)
  return PlainModel(call=call, variables=variables, input_specs=specs, params=params)


def _merge_adapters(variables: dict[str, Any], *, view: CheckpointView, scale: float) -> None:
  """Each variable whose adapters the checkpoint `view` holds, merged with them."""
  by_name, reader = names_in(view.prefix, view.shapes), view
  for path, variable in variables.items():
    a, b = (key_for_name(path + suffix, by_name) for suffix in (lora.A_SUFFIX, lora.B_SUFFIX))
    if a is not None and b is not None:
      variable.assign(lora.merged(variable.numpy(), reader.get_tensor(a), reader.get_tensor(b),
                                  scale=scale))


def _keras_on_one_device(model: KerasModel, specs: tuple, compute_dtype: str):
  """(checkpoint root, call) of a Keras model built with plain variables:
  the root holds them by path, as `layout_core.model.keras.build` does, so
  its checkpoint keys are the training run's. Keras' automatic layer names
  restart with a cleared session, as there."""
  from layout_core.model.keras import import_keras  # pylint: disable=g-import-not-at-top
  keras = import_keras()
  keras.backend.clear_session()
  policy = keras.config.dtype_policy()
  if compute_dtype != 'float32':
    keras.config.set_dtype_policy(f'mixed_{compute_dtype}')
  try:
    built = model.build_fn()
    if not built.built:
      symbolic = [keras.KerasTensor((1,) + tuple(shape[1:]), dtype=dtype)
                  for shape, dtype in specs]
      built(symbolic[0] if len(symbolic) == 1 else symbolic)
  finally:
    keras.config.set_dtype_policy(policy)
  root = tf.Module(name=model.name)
  root.by_path = {weight.path: weight.value for weight in built.variables}

  def call(*inputs):
    return built(inputs[0] if len(inputs) == 1 else list(inputs), training=False)
  return root, call


def read_values(view: CheckpointView, entries: Sequence[CheckpointEntry], *,
                adapters: bool = False) -> dict[str, np.ndarray]:
  """{key: global value} of every entry's key, read from the checkpoint
  `view` (with its base's tensors; a sharded save's slices come back as one array). ConfigError
  listing the variables that differ (missing, other shapes, only in the
  checkpoint) when it is not this model's checkpoint; but for LoRA adapters
  with `adapters` (merged by the caller)."""
  # With the adapters merged the model is the base in float32: its weights
  # held in int8 are read with their scales (`frozen`), not beside them.
  unread = (lambda key: (lora.is_adapter(key.split(VALUE_SUFFIX)[0])
                         or frozen.is_scale(key.split(VALUE_SUFFIX)[0]))
            ) if adapters else None
  try:
    check_fits(view.prefix, entries, roots=['model/'], unread=unread, saved=view.shapes)
  except ConfigError as e:
    raise ConfigError(e.message, where='the config (--gin_file / --gin_bindings)',
                      fix="export with the config the checkpoint was trained with (its "
                          "config.gin, which launch.export reads first); the checkpoint was "
                          'left untouched') from None
  values = {}
  for entry in entries:
    value = view.get_tensor(entry.key)
    scale = entry.key.replace(VALUE_SUFFIX, frozen.SCALE_SUFFIX + VALUE_SUFFIX)
    if (value.dtype == np.int8 and scale in view.shapes
        and entry.variable.dtype != tf.int8):  # the merged base reads int8 as float32
      value = frozen.dequantized_np(value, view.get_tensor(scale))
    values[entry.key] = value.astype(entry.variable.dtype.as_numpy_dtype, copy=False)
  return values


# -- signatures ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Signature:
  """One signature: a function of named tensors, its inputs' specs and a note."""
  name: str
  function: Callable[..., dict]
  inputs: tuple                       # tf.TensorSpec, named
  note: str = ''


def task_signatures(model: PlainModel) -> list[Signature]:
  """`serving_default`: the task's model inputs ('inputs', or 'input_0',
  'input_1', ...) -> {'predictions': the model's output}, batch of any size."""
  names = (['inputs'] if len(model.input_specs) == 1
           else [f'input_{i}' for i in range(len(model.input_specs))])
  specs = tuple(tf.TensorSpec(shape, dtype, name=name)
                for name, (shape, dtype) in zip(names, model.input_specs))

  def serving(*inputs):
    return {'predictions': model.call(*inputs)}
  return [Signature('serving_default', serving, specs, 'model inputs -> predictions')]


def lm_signatures(model: PlainModel, *, seq_len: int, prompt_len: int | None, max_new_tokens: int,
                  sampling=None, decoder=None) -> list[Signature]:
  """An LM's signatures (module doc). `serving_default`: tokens int32 [batch,
  seq_len] -> logits float32 [batch, seq_len, vocab]; the model is causal
  (position t's logits depend on tokens 0..t only), so a shorter sequence
  padded on the right has its own logits in front. With a `decoder`
  (`CachedLM`, whose `logits` then serve too) also `generate`: prompts int32
  [batch, prompt_len] (None: seq_len - max_new_tokens) and lengths int32
  [batch] (1..prompt_len, checked by the graph: InvalidArgumentError) ->
  tokens int32 [batch, max_new_tokens], decoded with the KV cache inside the graph,
  picked by `sampling` (a `Sampling`; None: greedy), which, when it draws,
  takes a `seed` int64 scalar input too."""
  model.params.cls.fprop_meta(model.params, (1, seq_len))  # ConfigError past max_len
  logits = decoder.logits if decoder is not None else model.call

  def serving(tokens):
    return {'logits': logits(tokens)}
  signatures = [Signature('serving_default', serving,
                          (tf.TensorSpec([None, seq_len], tf.int32, name='tokens'),),
                          f'tokens [batch, {seq_len}] -> logits')]
  if decoder is None:
    return signatures
  sampling = sampling or Sampling()
  if prompt_len is None:
    prompt_len = seq_len - max_new_tokens
    if prompt_len < 1:
      raise ConfigError(
          f"generate's prompts would have seq_len - max_new_tokens = {seq_len} - "
          f'{max_new_tokens} = {prompt_len} positions', where='--prompt_len / --max_new_tokens',
          fix=f'give --prompt_len (at least 1), or at most {seq_len - 1} --max_new_tokens')
  check_decoding_fits(prompt_length=prompt_len, max_new_tokens=max_new_tokens,
                      max_len=decoder.max_len, where='--prompt_len / --max_new_tokens')
  inputs = (tf.TensorSpec([None, prompt_len], tf.int32, name='prompts'),
            tf.TensorSpec([None], tf.int32, name='lengths'))

  def generate(prompts, lengths, seed=0):
    lengths = checked_lengths(prompts, lengths)
    return {'tokens': decoder.generate(prompts, lengths, max_new_tokens=max_new_tokens,
                                       sampling=sampling, seed=seed)}
  if not sampling.greedy:
    inputs += (tf.TensorSpec([], tf.int64, name='seed'),)
  signatures.append(Signature(
      'generate', generate, inputs,
      f'prompts [batch, {prompt_len}], lengths [batch] -> {max_new_tokens} new tokens, '
      f'{sampling.describe()}'))
  return signatures


def checked_lengths(prompts, lengths):
  """`lengths` once the graph has checked them against `prompts` [B, P]: one
  per row, each in 1..P. Outside that a row would decode from an empty
  state (0) or gather past its prompt (> P: an error on CPU, zeros on GPU);
  the check raises InvalidArgumentError saying which. TensorFlow Lite drops
  the checks (it has no Assert op)."""
  rows, width = tf.shape(prompts)[0], tf.shape(prompts)[1]
  checks = [
      tf.debugging.assert_equal(tf.shape(lengths)[0], rows,
                                message='generate: lengths needs one entry per prompt row'),
      tf.debugging.assert_greater_equal(
          lengths, 1, message='generate: every length must be at least 1 (a prompt of no '
                              'tokens has nothing to continue)'),
      tf.debugging.assert_less_equal(
          lengths, width, message='generate: no length may exceed prompt_len, the width of the '
                                  'prompts')]
  with tf.control_dependencies(checks):
    return tf.identity(lengths)


def cached_decoder(model: PlainModel) -> CachedLM | None:
  """The cached decoder over the model's plain variables (the LM's own
  layers, no DTensor op); None for an LM that is not a Transformer LM of
  `layout_core.model.lm`, which then exports `serving_default` alone."""
  try:
    lm_layers(model.params)
  except ConfigError:
    return None
  return CachedLM(model.params, model.variables)


def describe(record: Mapping[str, Any], *, export_dir: str, checkpoint: str) -> str:
  """What an export holds, for the console: one line per signature."""
  def tensors(named):
    return ', '.join(f'{name} {dtype} {shape}'.replace('None', 'batch')
                     for name, (shape, dtype) in named.items())
  lines = [f"Exported step {record.get('step')} ({checkpoint}) to {export_dir}:"]
  for name, signature in record['signatures'].items():
    lines.append(f"  {name}: {tensors(signature['inputs'])} -> {tensors(signature['outputs'])}")
  if 'tflite' in record:
    lines.append(f"  TensorFlow Lite, the same signatures: "
                 f"{os.path.join(export_dir, record['tflite'])}")
  return '\n'.join(lines)


# -- writing ----------------------------------------------------------------------
def check_target(export_dir: str, *, overwrite: bool) -> None:
  """ConfigError unless `export_dir` can be written: absent (or, with
  `overwrite`, an earlier export to replace), its nearest existing parent a
  writable directory."""
  where = f'--export_dir={export_dir}'
  if os.path.lexists(export_dir) and not overwrite:
    raise ConfigError(f'{export_dir} already exists; it was left untouched', where=where,
                      fix='give a new --export_dir (e.g. the next version number), or '
                          'add --overwrite to replace it')
  if os.path.lexists(export_dir) and not os.path.isfile(os.path.join(export_dir,
                                                                     'saved_model.pb')):
    raise ConfigError(f'{export_dir} exists and is not a SavedModel; --overwrite replaces '
                      'only an earlier export', where=where, fix='give another --export_dir')
  existing = os.path.dirname(os.path.abspath(export_dir))
  while not os.path.isdir(existing):  # the parents are created when the export is written
    if os.path.lexists(existing):
      raise ConfigError(f'{existing} is not a directory', where=where,
                        fix='give a path whose parents are directories')
    existing = os.path.dirname(existing)
  if not os.access(existing, os.W_OK):
    raise ConfigError(f'{existing} is not writable', where=where,
                      fix='choose a directory you can write to')


def export_saved_model(model: PlainModel, signatures: Sequence[Signature], *, export_dir: str,
                       overwrite: bool = False, about: Mapping[str, Any] | None = None,
                       tflite: bool = False) -> dict:
  """Writes the SavedModel of `model` with `signatures` to `export_dir`, whole
  or not at all (module doc), with `assets.extra/meshgin_export.json` (what
  it was made from, `about`, and each signature's tensors). `tflite`: every
  signature converted for TensorFlow Lite too (`model.tflite`). Returns
  that record."""
  check_target(export_dir, overwrite=overwrite)
  with directory_aside(export_dir, replace=overwrite,
                       check=lambda: check_target(export_dir, overwrite=overwrite)) as temporary:
    root = tf.Module(name='exported')
    root.by_path = dict(model.variables)  # every captured variable is tracked
    concrete = {}
    for signature in signatures:
      function, concrete[signature.name] = traced_function(signature.function,
                                                           input_signature=signature.inputs)
      setattr(root, signature.name, function)
    tf.saved_model.save(root, temporary, signatures=concrete)
    ops = graph_op_types(temporary)
    dtensor_ops = sorted(op for op in ops if any(m in op for m in DTENSOR_OP_MARKERS))
    if dtensor_ops:
      raise RuntimeError(f'the exported graph holds DTensor ops {dtensor_ops}')
    record = {**(about or {}), 'signatures': {
        s.name: {'note': s.note, 'inputs': _tensors(s.inputs),
                 'outputs': _tensors(concrete[s.name].structured_outputs)}
        for s in signatures}}
    if tflite:
      with open(os.path.join(temporary, TFLITE_FILE), 'wb') as f:
        f.write(tflite_bytes(temporary, [s.name for s in signatures]))
      record['tflite'] = TFLITE_FILE
    os.makedirs(os.path.join(temporary, 'assets.extra'), exist_ok=True)
    with open(os.path.join(temporary, EXPORT_INFO), 'w') as f:
      json.dump(record, f, indent=1)
  return record


def _tensors(tensors) -> dict[str, list]:
  """{name: [shape, dtype]} of named TensorSpecs, or of a {name: tensor} dict."""
  named = tensors.items() if isinstance(tensors, Mapping) else [(t.name, t) for t in tensors]
  return {name: [t.shape.as_list(), t.dtype.name] for name, t in named}


def graph_op_types(export_dir: str) -> set[str]:
  """Every op type in a SavedModel's graphs and their function library."""
  from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=g-import-not-at-top
  saved = saved_model_pb2.SavedModel()
  with open(os.path.join(export_dir, 'saved_model.pb'), 'rb') as f:
    saved.ParseFromString(f.read())
  ops = set()
  for graph in saved.meta_graphs:
    ops.update(node.op for node in graph.graph_def.node)
    for function in graph.graph_def.library.function:
      ops.update(node.op for node in function.node_def)
  return ops


def tflite_bytes(export_dir: str, signatures: Sequence[str]) -> bytes:
  """One TensorFlow Lite flatbuffer holding `signatures` of a SavedModel,
  with TFLite's built-in ops only. A model the converter refuses (an op
  TFLite lacks) is a ConfigError with the converter's reason."""
  converter = tf.lite.TFLiteConverter.from_saved_model(export_dir,
                                                       signature_keys=list(signatures))
  try:
    return converter.convert()
  except Exception as e:  # pylint: disable=broad-except
    # The converter's ConverterError lives in a private module: known by name.
    if type(e).__name__ != 'ConverterError':
      raise
    reason = ' '.join(str(e).split())[:600]
    raise ConfigError(f'TensorFlow Lite cannot convert the signatures {list(signatures)}: '
                      f'{reason}', where='--tflite',
                      fix='export without --tflite; the SavedModel serves with TensorFlow '
                          '(docs/use-your-model.md, "Export a SavedModel")') from e
