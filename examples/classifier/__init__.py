"""A non-LM example: a classifier trained from TFRecord files of tf.train.Examples."""
