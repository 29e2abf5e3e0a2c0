"""Training: the TrainingSession (prepare, loop, checkpoints, resume, events) and the
per-micro-batch forward/loss step shared with the benchmark harness."""
