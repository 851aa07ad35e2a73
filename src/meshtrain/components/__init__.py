"""The training loop's collaborators: optimizer and learning-rate schedule, validation,
metrics, and the probes that measure one step (peak memory, the pipeline timeline)."""
