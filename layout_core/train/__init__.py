"""The training loop and what it drives: step engines, the optimizer,
summaries, profiling and preemption."""
