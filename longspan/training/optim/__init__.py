"""Optimizers and schedules: the optimizer built from ``OptimizerConfig`` (with its megatron-core names),
the precision-aware Adam, the loss/grad scaler and ``OptimizerParamScheduler`` (LR and weight decay).

May import: everything below training.
"""
