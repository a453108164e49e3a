"""The training loop and what it drives: step engines, summaries, the memory
estimate, profiling and preemption (the optimizers: `layout_core.optim`)."""
