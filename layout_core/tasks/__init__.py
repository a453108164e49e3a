"""Tasks: what to train on. `Task` is the interface (batches, model inputs,
loss and metrics); built in: the LM tasks (`lm`) and TFRecord files.

    from layout_core.tasks import Task, accuracy, softmax_cross_entropy, split_rng
"""

from layout_core.tasks.base import (Task, TFRecordTask, accuracy, softmax_cross_entropy,
                                    split_rng)
from layout_core.tasks.tfrecords import read_tfrecords, write_tfrecords

__all__ = ['TFRecordTask', 'Task', 'accuracy', 'read_tfrecords', 'softmax_cross_entropy',
           'split_rng', 'write_tfrecords']
