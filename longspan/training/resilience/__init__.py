"""Resilience: small objects the training loop calls so long runs survive faults.

- ``non_persistent``: frequent cheap checkpoints (global DCP or per-rank local files), cleaned up as newer
  ones arrive; resume takes the newest complete checkpoint of any kind.
- ``rerun``: the rerun state machine (result validation, re-runs in place, error injection, exit 16/17).
- ``heartbeat``: per-rank heartbeats and the launcher-side monitor that kills hung ranks (``ft``).
- ``straggler``: per-rank compute-time scores (``straggler`` / ``nvrx_straggler``).
- ``supervisor`` / ``inprocess``: in-process restart: a supervisor replaces a failed rank's process while the
  others tear down their process groups, re-rendezvous and resume in the same process.
- ``events``: every resilience event as a log line, a progress.txt entry and a metrics.jsonl record.

See docs/resilience.md. May import: everything below training, and training's checkpointing and
observability.
"""
