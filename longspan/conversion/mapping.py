"""Declarative weight mappings: one longspan parameter <-> the Hugging Face tensor(s) it is made of.

A ``WeightMap`` names a longspan parameter pattern and the HF tensor pattern it comes from, with the few
rules the supported families need:

- ``transpose``: HF stores the matrix as ``[in, out]`` (GPT-2's ``Conv1D``);
- ``split=(k, n)``: the longspan tensor is the k-th of n row blocks of the HF tensor (GPT-2's fused
  ``c_attn`` = [q | k | v]); the blocks are equal unless ``split_units`` gives their relative sizes (Phi-3's
  grouped-query ``qkv_proj`` = [q | k | v] in units of heads: (heads, groups, groups));
- ``per_expert``: the longspan tensor is a 3-D slab ``[num_experts, ...]`` stacked from one HF tensor per
  expert (``{e}`` in the HF pattern);
- ``vocab``: rows beyond the HF vocabulary are padding (added as zeros on import, stripped on export);
- ``buffer``: ours is a persistent buffer, not a parameter (the aux-loss-free routing bias
  ``router.expert_bias``, HF's ``e_score_correction_bias``): copied whole and bit-exactly, in its own dtype;
- ``copies``: HF also stores the same tensor under these names (the embedding and output head each
  multi-token-prediction layer of DeepSeek-V3 / GLM-4.5 repeats: ``with_mtp``).

``{i}`` is the global layer index in both names. The loader (``longspan.conversion.loader``) is shared by every
family: it only reads these tables.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WeightMap:
    """One longspan parameter pattern and the HF tensor pattern it maps to."""

    ours: str
    """longspan parameter name, ``{i}`` = layer index (e.g. ``decoder.layers.{i}.self_attention.linear_q.weight``)."""

    hf: str
    """HF tensor name, ``{i}`` = layer index, ``{e}`` = expert index (per_expert only)."""

    transpose: bool = False
    """HF holds the transpose (``Conv1D`` ``[in, out]``)."""

    split: tuple[int, int] | None = None
    """(k, n): ours is the k-th of n blocks of the HF tensor's rows (after ``transpose``)."""

    split_units: tuple[int, ...] | None = None
    """The n blocks' relative sizes (default: equal): block j has ``split_units[j]`` units of
    ``rows / split_units[k]`` rows each."""

    split_groups: int | None = None
    """The HF rows are this many equal groups, each ``[block 0 | block 1 | ...]`` (sizes by ``split_units``):
    ours is block k of every group, in group order (a projection fused and interleaved per head, e.g. a query
    projection doubled per head with its gate)."""

    per_expert: bool = False
    """ours is ``[num_experts, ...]``, stacked from one HF tensor per expert."""

    vocab: bool = False
    """Dim 0 is the vocabulary: padding rows beyond the HF vocabulary are zeros on import, dropped on export."""

    stacked: bool = False
    """ours is ``[num_experts, ...]`` and so is the one HF tensor (GPT-OSS's experts); with ``transpose`` HF
    holds each expert's matrix transposed (``[E, in, out]``); with ``split`` (k, n) ours' dim 1 is the k-th of
    n equal blocks of HF's (Gemma 4's ``gate_up_proj``: gate = (0, 2), up = (1, 2))."""

    interleave: tuple[int, int] | None = None
    """(k, n), stacked only: ours' dim 1 is every n-th row of HF's (after ``transpose``) from row k (GPT-OSS's
    ``gate_up_proj``: gate = (0, 2), up = (1, 2))."""

    mxfp4: bool = False
    """stacked only: the HF checkpoint may hold the tensor as MXFP4 ``{hf}_blocks`` / ``{hf}_scales`` (already
    ``[E, out, in]``), decoded on import."""
    buffer: bool = False
    """ours is a persistent buffer of the module (read and written whole, keeping its dtype)."""

    copies: tuple[str, ...] = ()
    """Other HF names holding the same tensor: export writes it under each; import checks each equals it bit for
    bit (one-line ``CheckpointError`` naming the first that differs)."""

    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pattern = re.escape(self.ours).replace(r"\{i\}", r"(?P<i>\d+)")
        object.__setattr__(self, "regex", re.compile(f"^{pattern}$"))

    def split_rows(self, rows: int) -> tuple[int, int]:
        """(first row of ours in the HF tensor, the HF tensor's rows) for ours of ``rows`` rows (split only)."""
        k, n = self.split
        units = self.split_units or (1,) * n
        unit_rows = rows // units[k]
        return sum(units[:k]) * unit_rows, sum(units) * unit_rows

    def hf_row_slices(self, start: int, stop: int, rows: int) -> list[slice]:
        """The HF rows (in order) of ours' rows ``[start, stop)`` for ours of ``rows`` rows (split only)."""
        first, total = self.split_rows(rows)
        groups = self.split_groups or 1
        ours_per_group, hf_per_group = rows // groups, total // groups
        offset = first // groups
        out = []
        for g in range(start // ours_per_group if ours_per_group else 0, groups):
            lo, hi = max(start, g * ours_per_group), min(stop, (g + 1) * ours_per_group)
            if lo >= hi:
                break
            base = g * hf_per_group + offset - g * ours_per_group
            out.append(slice(base + lo, base + hi))
        return out

    def hf_name(self, layer: int | None, expert: int | None = None) -> str:
        """The HF tensor name for a layer (and expert)."""
        return self.hf.format(i=layer, e=expert)


def layer_map(ours: str, hf: str, **kw) -> WeightMap:
    """One decoder-layer entry: ``decoder.layers.{i}.<ours>`` <-> ``model.layers.{i}.<hf>``."""
    return WeightMap(f"decoder.layers.{{i}}.{ours}", f"model.layers.{{i}}.{hf}", **kw)


# --------------------------------------------------------------------------------------------- Llama-like

DECODER_EMBEDDINGS = (
    WeightMap("embedding.word_embeddings.weight", "model.embed_tokens.weight", vocab=True),
    WeightMap("decoder.final_layernorm.weight", "model.norm.weight"),
    WeightMap("output_layer.weight", "lm_head.weight", vocab=True),
)

DECODER_ATTENTION = (
    layer_map("input_layernorm.weight", "input_layernorm.weight"),
    layer_map("self_attention.linear_q.weight", "self_attn.q_proj.weight"),
    layer_map("self_attention.linear_k.weight", "self_attn.k_proj.weight"),
    layer_map("self_attention.linear_v.weight", "self_attn.v_proj.weight"),
    layer_map("self_attention.linear_q.bias", "self_attn.q_proj.bias"),
    layer_map("self_attention.linear_k.bias", "self_attn.k_proj.bias"),
    layer_map("self_attention.linear_v.bias", "self_attn.v_proj.bias"),
    layer_map("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    layer_map("self_attention.linear_proj.bias", "self_attn.o_proj.bias"),
    layer_map("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    layer_map("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
    layer_map("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
)

# Dense SwiGLU MLP: longspan's linear_fc1_gate / linear_fc1 are HF's gate_proj / up_proj.
DECODER_MLP = (
    layer_map("mlp.linear_fc1_gate.weight", "mlp.gate_proj.weight"),
    layer_map("mlp.linear_fc1.weight", "mlp.up_proj.weight"),
    layer_map("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
    layer_map("mlp.linear_fc1_gate.bias", "mlp.gate_proj.bias"),
    layer_map("mlp.linear_fc1.bias", "mlp.up_proj.bias"),
    layer_map("mlp.linear_fc2.bias", "mlp.down_proj.bias"),
)

DECODER = DECODER_EMBEDDINGS + DECODER_ATTENTION + DECODER_MLP

# --------------------------------------------------------------------------------------------- post-norms

# Attention's projections and QK-norms without its pre-norm, for decoders that place their norms themselves.
DECODER_QKVO = tuple(e for e in DECODER_ATTENTION if ".self_attention." in e.ours)

# Norms after attention and the MLP: HF's post_attention_layernorm here is longspan's post_self_attn_layernorm
# (in the standard decoder it is the pre-MLP norm).
POST_SUBLAYER_NORMS = (
    layer_map("post_self_attn_layernorm.weight", "post_attention_layernorm.weight"),
    layer_map("post_mlp_layernorm.weight", "post_feedforward_layernorm.weight"),
)


def with_prefix(table: tuple[WeightMap, ...], old: str, new: str) -> tuple[WeightMap, ...]:
    """``table`` with the HF names starting ``old`` renamed to start ``new`` (a model nested in a bigger one)."""
    return tuple(dataclasses.replace(e, hf=new + e.hf[len(old):]) if e.hf.startswith(old) else e for e in table)


def with_ours_prefix(table: tuple[WeightMap, ...], prefix: str) -> tuple[WeightMap, ...]:
    """``table`` with every longspan name under ``prefix`` (a model that is a submodule of a bigger one)."""
    return tuple(dataclasses.replace(e, ours=prefix + e.ours) for e in table)


# --------------------------------------------------------------------------------------------- Mamba-2 mixer

def mamba_mixer(ours: str, hf: str, d_inner: int, bc_rows: int, heads: int) -> tuple[WeightMap, ...]:
    """One Mamba-2 mixer's tensors under prefixes ``ours`` / ``hf``: Megatron's names, which are also HF's,
    except that longspan keeps each segment of the fused ``in_proj`` (rows ``[z | x | B | C | dt]``: d_inner,
    d_inner, groups·state twice, heads) and ``conv1d`` (``[x | B | C]``) as its own parameter, so the
    tables split them on import and fuse them on export."""
    in_units = (d_inner, d_inner, bc_rows, bc_rows, heads)
    conv_units = (d_inner, bc_rows, bc_rows)
    table = [WeightMap(f"{ours}.in_proj.{k}.weight", f"{hf}.in_proj.weight", split=(j, 5), split_units=in_units)
             for j, k in enumerate(("z", "x", "B", "C", "dt"))]
    for j, k in enumerate(("x", "B", "C")):
        for p in ("weight", "bias"):
            table.append(WeightMap(f"{ours}.conv1d.{k}.{p}", f"{hf}.conv1d.{p}", split=(j, 3), split_units=conv_units))
    table += [WeightMap(f"{ours}.{p}", f"{hf}.{p}") for p in ("A_log", "D", "dt_bias", "norm.weight", "out_proj.weight")]
    return tuple(table)




# --------------------------------------------------------------------------------------------- multi-token prediction

# DeepSeek-V3 and GLM-4.5 store multi-token-prediction depth k (0-based) after the decoder, as decoder layer
# num_hidden_layers + k: its own norms and projection, a decoder layer under the decoder's names, and copies of
# the shared embedding and output head (longspan's depths use the shared ones: megatron-core's MTP block).
MTP_OWN = (
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("eh_proj.weight", "eh_proj.weight"),  # [h, 2h]: the first h input columns read the embedding, as ours
    ("final_layernorm.weight", "shared_head.norm.weight"),
)
MTP_SHARED_COPIES = {
    "embedding.word_embeddings.weight": "embed_tokens.weight",
    "output_layer.weight": "shared_head.head.weight",
}


def with_mtp(table: tuple[WeightMap, ...], num_layers: int, depths: int, tied: bool = False) -> tuple[WeightMap, ...]:
    """``table`` plus ``depths`` multi-token-prediction depths stored after ``num_layers`` decoder layers:
    ``mtp.layers.{k}.*`` <-> ``model.layers.{num_layers + k}.*``, each depth's ``transformer_layer`` with the
    table's decoder-layer entries, and the depths' embedding / head copies on the shared entries (with ``tied``
    embeddings the head copies are the embedding's too)."""
    if not depths:
        return table
    shared_of = {"output_layer.weight": "embedding.word_embeddings.weight"} if tied else {}
    copies: dict[str, tuple[str, ...]] = {}
    for ours, hf in MTP_SHARED_COPIES.items():
        owner = shared_of.get(ours, ours)
        copies[owner] = copies.get(owner, ()) + tuple(f"model.layers.{num_layers + k}.{hf}" for k in range(depths))
    out = [dataclasses.replace(e, copies=e.copies + copies[e.ours]) if e.ours in copies else e for e in table]
    decoder = "decoder.layers.{i}."
    for k in range(depths):
        hf_layer = f"model.layers.{num_layers + k}."
        out += [WeightMap(f"mtp.layers.{k}.{ours}", hf_layer + hf) for ours, hf in MTP_OWN]
        out += [dataclasses.replace(e, ours=f"mtp.layers.{k}.transformer_layer." + e.ours[len(decoder):],
                                    hf=hf_layer + e.hf[len("model.layers.{i}."):])
                for e in table if e.ours.startswith(decoder) and e.hf.startswith("model.layers.{i}.")]
    return tuple(out)


def match(table: tuple[WeightMap, ...], name: str) -> tuple[WeightMap, int | None] | None:
    """The entry of ``table`` for longspan parameter ``name`` and its layer index, or None."""
    for entry in table:
        found = entry.regex.match(name)
        if found:
            layer = found.groupdict().get("i")
            return entry, (int(layer) if layer is not None else None)
    return None
