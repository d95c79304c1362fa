"""What a run reports: timers, the log line and its metric sinks (TensorBoard, W&B, MLflow, Comet), the
progress log, profiling, memory, throughput and MFU reports, energy counters.

May import: everything below training, and training's state and utils.
"""
