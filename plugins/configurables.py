"""Every gin configurable meshgin offers, registered in one place.

Library code in `layout_core/` knows nothing of gin; this file attaches gin to
it at the edge (as gin's own `external_configurables.py` does). All names live
in the `meshgin` module, so `mesh.shape` and `meshgin.mesh.shape` both work:

    mesh.shape = {'data': 2, 'model': 4}
    layout_rules.rules = [(r'.*/ffn/w_in', ('unsharded', 'model'))]
    transformer_lm.num_layers = 4
    train.num_steps = 300

| configurable     | builds                                    | reference |
|------------------|-------------------------------------------|-----------|
| `mesh`           | `layout_core.layout.mesh.MeshSpec`               | shape, device_type, device_memory_gb, peak_flops_per_device |
| `layout_rules`   | `layout_core.layout.rules.LayoutRules`           | rules, strict |
| `transformer_lm` | the LM Params tree                        | sizes |
| `transformer_block` | one Transformer cell's Params (for `transformer_lm.cells`) | num_heads, ffn_dim, activation |
| `moe_feed_forward` | a routed feed-forward layer's Params (for `transformer_lm.moe`; docs/moe.md) | num_experts, experts_per_token, capacity_factor, ... |
| `model`          | the Params tree to train (+ dotted overrides) | params, overrides |
| `pipeline`       | `layout_core.pipeline.PipelineConfig`     | num_stages, num_micro_batches, partition, ... |
| `data`           | `layout_core.tasks.lm.make_task`: the run's task | task, text_file, vocab_size, seq_len, ... |
| `markov_task`, `bytes_task` | the LM tasks (`MarkovTask`, `TextFileTask`), for `data.task` | vocab_size, seq_len, ... / path, seq_len |
| `tfrecord_task`  | `layout_core.tasks.TFRecordTask`: tf.train.Example files | train_files, eval_files, features, inputs, label, ... |
| `lm_corpus`      | `layout_core.tasks.corpus.LMCorpusTask`: token-id documents, packed | train_files, eval_files, vocab_size, seq_len, pack, ... |
| `instruct`       | `layout_core.tasks.instruct.InstructionTask`: JSON-lines chats, loss on responses only | train_files, eval_files, tokenizer, vocab_size, seq_len, pack, too_long, ... |
| `preference`     | `layout_core.tasks.preference.PreferenceTask`: JSON-lines pairs of a chosen and a rejected answer | train_files, eval_files, tokenizer, vocab_size, seq_len, too_long, objective, ... |
| `dpo`            | `layout_core.tasks.dpo.DPOConfig`: the preference loss, for `preference.objective` | beta, loss, label_smoothing |
| `keras_model`    | `layout_core.model.keras.KerasModel`, for `model.params` | build_fn, name |
| `sequential`, `feed_forward`, `softmax`, `layer_norm`, `embedding` | library layers' Params (via `plugins.registry.register_layer`) | their Params keys |
| `optimizer`      | `layout_core.optim.OptimizerConfig`            | learning_rate, warmup_steps, ... |
| `train`          | `layout_core.train.config.TrainConfig`         | num_steps, batch_size, ... |
| `lora`           | `layout_core.model.lora.LoraConfig`: low-rank adapters for fine-tuning | rank, alpha, dropout, targets |
| `checkpoint`     | `layout_core.checkpoint.config.CheckpointConfig` | every_steps, keep, async_save, init_from, ... |
"""

from __future__ import annotations

from typing import Any, Mapping

import gin

from layout_core.checkpoint import config as checkpoint_lib
from layout_core.tasks import lm as data_lib
from layout_core.model import keras as keras_models
from layout_core.model import lora as lora_lib
from layout_core import model as model_lib
from layout_core.layout import mesh as mesh_lib
from layout_core import optim as optimizer_lib
from layout_core import pipeline as pipeline_lib
from layout_core.layout import rules as rules_lib
from layout_core import tasks as tasks_lib
from layout_core.tasks import corpus as corpus_lib
from layout_core.tasks import instruct as instruct_lib
from layout_core.tasks import dpo as dpo_lib
from layout_core.tasks import preference as preference_lib
from layout_core.train import config as train_config
from layout_core.errors import ConfigError
from layout_core.params import Params
from plugins.registry import register_layer, register_task

MODULE = 'meshgin'

mesh = gin.external_configurable(mesh_lib.MeshSpec, name='mesh', module=MODULE)
layout_rules = gin.external_configurable(rules_lib.LayoutRules, name='layout_rules',
                                         module=MODULE)
transformer_lm = gin.external_configurable(model_lib.transformer_lm_params,
                                           name='transformer_lm', module=MODULE)
transformer_block = gin.external_configurable(model_lib.transformer_block_params,
                                              name='transformer_block', module=MODULE)
moe_feed_forward = gin.external_configurable(model_lib.moe_feed_forward_params,
                                             name='moe_feed_forward', module=MODULE)
pipeline = gin.external_configurable(pipeline_lib.PipelineConfig, name='pipeline',
                                     module=MODULE)
data = gin.external_configurable(data_lib.make_task, name='data', module=MODULE)
register_task(data_lib.MarkovTask, name='markov_task', module=MODULE)
register_task(data_lib.TextFileTask, name='bytes_task', module=MODULE)
register_task(tasks_lib.TFRecordTask, name='tfrecord_task', module=MODULE)
register_task(corpus_lib.LMCorpusTask, name='lm_corpus', module=MODULE)
register_task(instruct_lib.InstructionTask, name='instruct', module=MODULE)
register_task(preference_lib.PreferenceTask, name='preference', module=MODULE)
dpo = gin.external_configurable(dpo_lib.DPOConfig, name='dpo', module=MODULE)
keras_model = gin.external_configurable(keras_models.KerasModel, name='keras_model',
                                        module=MODULE)
for _layer in (model_lib.Sequential, model_lib.FeedForward, model_lib.Softmax, model_lib.LayerNorm,
               model_lib.Embedding):
  register_layer(_layer, module=MODULE)
optimizer = gin.external_configurable(optimizer_lib.OptimizerConfig,
                                      name='optimizer', module=MODULE)
train = gin.external_configurable(train_config.TrainConfig, name='train', module=MODULE)
lora = gin.external_configurable(lora_lib.LoraConfig, name='lora', module=MODULE)
checkpoint = gin.external_configurable(checkpoint_lib.CheckpointConfig, name='checkpoint',
                                       module=MODULE)


@gin.configurable('model', module=MODULE)
def model(params: Params | keras_models.KerasModel | None = None,
          overrides: Mapping[str, Any] | None = None) -> Params | keras_models.KerasModel:
  """The model to train: a Params tree `params` (default: `transformer_lm()`),
  then `overrides` applied as dotted Set calls, e.g.
  `model.overrides = {'stack.block.ffn_dim': 512}`; or a Keras model
  (`model.params = @keras_model()`).

  Args:
    params: The model: a Params tree (e.g. @transformer_lm(), @sequential()) or
      @keras_model(); None means transformer_lm() with its gin bindings.
    overrides: {dotted key: value} set in order on a copy of the Params tree,
      keys as in a run's params.txt (e.g. 'stack.block.ffn_dim', 'sub[1].repeat');
      None means no changes. Not allowed with a Keras model.
  """
  if params is gin.REQUIRED:
    raise ConfigError('model.params is required but not set',
                      where='model.params = %gin.REQUIRED (configs/runs/*.gin)',
                      fix="include a model file such as 'configs/models/lm_tiny.gin' "
                          'or bind model.params = @transformer_lm()')
  if isinstance(params, keras_models.KerasModel):
    if overrides:
      raise ConfigError('model.overrides applies to Params trees, not Keras models',
                        where='model.overrides',
                        fix="bind the Keras model function's own arguments instead")
    return params
  if params is not None and not isinstance(params, Params):
    raise ConfigError(f'model.params is {params!r}, not a Params tree',
                      where='model.params',
                      fix='bind a Params tree (e.g. @transformer_lm(), @sequential()) '
                          'or @keras_model()')
  if overrides is not None and not isinstance(overrides, Mapping):
    raise ConfigError(f'model.overrides is {overrides!r}, not a dict', where='model.overrides',
                      fix="write {'dotted.key': value}, e.g. {'sub[1].repeat': 4}")
  tree = (params if params is not None else transformer_lm()).Copy()
  for key, value in dict(overrides or {}).items():
    try:
      tree.Set(**{key: value})
    except ConfigError as e:
      raise ConfigError(f'model.overrides key {key!r}: {e} (the keys are the dotted '
                        "names in a run's params.txt)", where='model.overrides') from None
  return tree.Freeze()
