"""The layout suggester's models, TensorFlow-free: the candidate space, the cost model,
its calibrated rates, and the search (`launch.inspect --suggest`)."""
