"""`launch.inspect --suggest`: candidates planned from the config's own plan, the output,
and trials that train the best few (`--measure`)."""
