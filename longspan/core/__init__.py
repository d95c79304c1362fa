"""The base every other package stands on: error types for people (``errors``), rank-aware logging
(``logging``), ``ModelParallelConfig`` (``model_parallel_config``) and vocabulary padding (``vocab``).

May import: nothing from longspan (torch and the standard library only).
"""
