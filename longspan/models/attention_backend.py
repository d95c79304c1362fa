"""``model.attention_backend``: Megatron's attention implementations mapped onto torch SDPA's backends.

Megatron picks among Transformer Engine's flash and fused (cuDNN) kernels, its own unfused softmax
('unfused') and its local reference module ('local'). longspan's attention always calls
``torch.nn.functional.scaled_dot_product_attention``; the setting restricts which SDPA kernels it may use, for
the whole run (forward, backward and recomputation alike):

- 'auto': SDPA chooses (no restriction);
- 'flash': FLASH_ATTENTION (CUDA, and torch's CPU flash kernel);
- 'fused': EFFICIENT_ATTENTION or CUDNN_ATTENTION (CUDA only: elsewhere SDPA chooses and start-up lists the
  setting as not applicable);
- 'unfused' and 'local': MATH (scores and softmax materialized, as Megatron's unfused path).

A backend that cannot run a given call (a mask or head size a kernel does not take) fails with torch's own
"No available kernel" error naming the reasons.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION_BACKENDS: dict[str, Optional[list[SDPBackend]]] = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
    "unfused": [SDPBackend.MATH],
    "local": [SDPBackend.MATH],
}
CUDA_ONLY_BACKENDS = ("fused",)


def sdpa_backends(attention_backend: str, device: torch.device) -> Optional[list[SDPBackend]]:
    """The SDPA kernels ``attention_backend`` allows on ``device`` (None: SDPA chooses)."""
    if attention_backend in CUDA_ONLY_BACKENDS and device.type != "cuda":
        return None
    return ATTENTION_BACKENDS[attention_backend]


@contextlib.contextmanager
def attention_backend_context(attention_backend: str, device: torch.device) -> Iterator[None]:
    """Run the enclosed code with SDPA restricted to ``attention_backend``'s kernels on ``device``."""
    backends = sdpa_backends(attention_backend, device)
    if backends is None:
        yield
        return
    with sdpa_kernel(backends):
        yield
