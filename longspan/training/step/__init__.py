"""One training step's pieces: forward steps (GPT, T5), forward/backward schedules over microbatches and
their pipeline-parallel counterparts, loss checks (NaN/Inf, spikes) and the microbatch calculator.

May import: everything below training, and training's own utils and observability.
"""
