"""Context parallel for Mamba-2 mixers: an all-to-all from sequence chunks to heads and back (Megatron's way).

Under context parallel each rank holds two load-balanced chunks of every sequence
(``longspan.parallel.context_parallel``). The SSD scan and the causal conv run along the whole sequence, so a
mixer cannot work on chunks; but they are independent per head. So, as Megatron's ``MambaContextParallel``
does, each rank projects its own tokens (``in_proj`` over all of its heads), then an all-to-all hands rank
``j`` every rank's tokens of head share ``j``: each rank then holds the **whole sequence, in order, for
``1/cp`` of the heads** (and their groups' ``B`` / ``C`` channels), runs conv, scan and gated norm on them
with its slice of ``conv1d`` / ``A_log`` / ``D`` / ``dt_bias`` / norm weight, and a second all-to-all brings
each rank its own tokens of every head back before ``out_proj``. Nothing of the recurrence crosses ranks.

Each all-to-all's backward is the same exchange in reverse, so gradients are exact. A rank's slices of the
per-head parameters receive the gradient of its heads only (zero elsewhere); the data-parallel reduction over
``dp × cp`` sums those into the whole gradient, as it does every parameter's (see context_parallel.py for
why every cp rank's gradient is ``cp ×`` its share and the average over ``dp × cp`` is exact).

Composes with tensor parallel: the mixer's tensors are the rank's tensor-parallel shard already, and the
exchange splits that shard's heads further (``tp · cp`` must divide the heads and ``mamba_num_groups``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torch import nn

from longspan.core.errors import ConfigError
from longspan.parallel.heads_exchange import HeadsExchange
from longspan.parallel.mamba import is_mamba_mixer


class MambaContextParallel(HeadsExchange):
    """``MambaMixer.context_parallel``: the exchanges over a cp ``group`` (a plain object, no parameters)."""

    def heads_of(self, p: SimpleNamespace) -> SimpleNamespace:
        """The mixer's local parameters cut to this rank's share of the heads (``out_proj`` and ``in_proj``
        stay whole: they work on this rank's tokens of every head)."""
        cp, share = self.size, self.share
        return SimpleNamespace(
            in_proj=p.in_proj, out_proj=p.out_proj,
            conv_weight=tuple(share(t) for t in p.conv_weight), conv_bias=tuple(share(t) for t in p.conv_bias),
            A_log=share(p.A_log), D=share(p.D), dt_bias=share(p.dt_bias), norm=share(p.norm),
            d_inner=p.d_inner // cp, heads=p.heads // cp, groups=p.groups // cp,
        )

    def __repr__(self) -> str:
        return f"MambaContextParallel(all-to-all over {self.size} ranks)"


def apply_mamba_context_parallel(model: nn.Module, group: Any) -> int:
    """Give every Mamba mixer of ``model`` the exchange over ``group``; returns how many. The cp size must
    divide the heads and groups each mixer holds (a tensor-parallel rank's share, when tp is applied)."""
    mixers = [m for m in model.modules() if is_mamba_mixer(m)]
    exchange = MambaContextParallel(group)
    for mixer in mixers:
        local = mixer.local_parameters()
        if local.heads % exchange.size or local.groups % exchange.size:
            raise ConfigError(
                f"model.context_parallel_size={exchange.size} must divide the Mamba heads ({local.heads}) and "
                f"groups ({local.groups}) of each tensor-parallel rank (model.mamba_num_groups={mixer.groups})"
            )
    for mixer in mixers:
        mixer.context_parallel = exchange
    return len(mixers)
