"""Pipeline parallel: stage splits, and model-level parity of the pipelined forward/backward.

The oracle for the splits is Megatron's rule written out in the test; the oracle for the numbers is the same
model on one process through ``forward_backward_no_pipelining`` (the trainer's non-pipelined path), computed
inside each worker: per-microbatch loss reports and every parameter gradient must match.
"""

from __future__ import annotations

import pytest

from longspan.core.errors import ConfigError
from longspan.parallel.pipeline import stage_layer_counts, stage_layer_numbers

SEQ = 16
MBS = 2


# ------------------------------------------------------------------------------------------ splits


def test_even_split_and_interleaving_order():
    # pp=2, vp=2, 8 layers: stage s = chunk * pp + rank holds layers [2s, 2s+2) (Megatron's interleaving:
    # rank 0 holds layers 0-1 and 4-5).
    counts = stage_layer_counts(8, 2, 2)
    assert counts == [2, 2, 2, 2]
    assert stage_layer_numbers(counts) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layer_counts(4, 2) == [2, 2]


def test_uneven_split_first_and_last():
    # Megatron: first/last stage counts fixed, the middle ranks share the rest evenly.
    assert stage_layer_counts(10, 4, first=1, last=3) == [1, 3, 3, 3]
    assert stage_layer_counts(7, 3, first=1) == [1, 3, 3]
    assert stage_layer_counts(7, 3, last=3) == [2, 2, 3]
    # with virtual stages each rank's count is split over its chunks: ranks get [2, 4, 4, 2] -> /2 each
    assert stage_layer_counts(12, 4, 2, first=2, last=2) == [1, 2, 2, 1, 1, 2, 2, 1]


def test_embedding_and_loss_counted_as_layers():
    # 6 layers + embedding + loss = 8 slots over 4 stages: 2 each, minus one on the first and the last.
    assert stage_layer_counts(6, 4, account_for_embedding=True, account_for_loss=True) == [1, 2, 2, 1]


@pytest.mark.parametrize(
    "args,kwargs,needle",
    [
        ((5, 2), {}, "cannot be split"),
        ((8, 2, 3), {}, "virtual_pipeline_model_parallel_size=3"),
        ((10, 4), {"first": 1, "last": 2}, "remaining 7 layers"),
        ((6, 4), {"account_for_embedding": True}, "not divisible"),
    ],
)
def test_bad_splits_are_one_line_config_errors(args, kwargs, needle):
    with pytest.raises(ConfigError) as err:
        stage_layer_counts(*args, **kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------ parity


def _cfg(pp: int, vp: int | None = None, tp: int = 1, num_layers: int = 4, tied: bool = False):
    import torch.nn.functional as F

    from longspan.models.gpt_provider import GPTModelProvider
    from longspan.recipes.tiny import tiny

    cfg = tiny()
    cfg.model = GPTModelProvider(
        num_layers=num_layers, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
        seq_length=SEQ, vocab_size=128, make_vocab_size_divisible_by=128, normalization="RMSNorm",
        position_embedding_type="rope", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        share_embeddings_and_output_weights=tied, attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
    )
    cfg.model.finalize()
    cfg.dist.distributed_backend = "gloo"
    cfg.dist.distributed_timeout_minutes = 1
    cfg.train.micro_batch_size = MBS
    return cfg


def _microbatches(n: int):
    import torch

    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 120, (MBS, SEQ + 1), generator=g)
        mask = (torch.rand(MBS, SEQ, generator=g) > 0.3).float()
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask})
    return out


def _forward_step(data_iterator, model):
    from functools import partial

    from longspan.training.step.forward_step import loss_func

    batch = next(data_iterator)
    output = model(batch["tokens"], labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _reference(cfg, n: int, per_token: bool):
    """One process: the full model through the trainer's non-pipelined schedule."""
    from longspan.models.gpt import build_gpt_model
    from longspan.training.step.schedules import forward_backward_no_pipelining

    model = build_gpt_model(cfg.model, seed=cfg.rng.seed, device="cpu")
    reports, tokens = forward_backward_no_pipelining(
        forward_step_func=_forward_step, data_iterator=iter(_microbatches(n)), model=[model],
        num_microbatches=n, calculate_per_token_loss=per_token,
    )
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return reports, tokens, grads


def _pipeline_case(pp: int, vp: int | None, tp: int, n: int, schedule: str, per_token: bool, tied: bool = False,
                   fsdp2: bool = False):

    from longspan.parallel.init import initialize_distributed
    from longspan.parallel.pipeline import build_pipeline_chunks, chunk_info, unwrap_chunk
    from longspan.training.step.pipeline_schedules import forward_backward_pipelining

    cfg = _cfg(pp, vp, tp, tied=tied)
    cfg.dist.use_torch_fsdp2 = fsdp2
    parallel = initialize_distributed(cfg.dist, cfg.model, device="cpu")
    chunks = build_pipeline_chunks(cfg, parallel, cfg.rng.seed)
    # Data-parallel rank d reads microbatches [d*n, (d+1)*n) of dp*n; DP averaging of the per-rank
    # gradients (each scaled by 1/n) equals one process over all dp*n microbatches (each scaled by 1/(dp*n)).
    dp, d = parallel.dp_size, parallel.dp_rank
    mine = _microbatches(dp * n)[d * n:(d + 1) * n]
    reports, tokens = forward_backward_pipelining(
        forward_step_func=_forward_step, data_iterator=iter(mine), model=chunks,
        num_microbatches=n, calculate_per_token_loss=per_token, schedule=schedule,
    )
    ref_reports, _, ref_grads = _reference(_cfg(1, tied=tied), dp * n, per_token)
    ref_reports = ref_reports[d * n:(d + 1) * n]
    ref_tokens = sum(int(r["lm loss"][1]) for r in ref_reports)
    worst = 0.0
    names = []
    for chunk in chunks:
        for name, param in unwrap_chunk(chunk).named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            ref = ref_grads["embedding.word_embeddings.weight" if name not in ref_grads else name]
            worst = max(worst, float((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-12)))
            names.append(name)
    losses = [float(r["lm loss"][0] / r["lm loss"][1]) for r in reports]
    ref_losses = [float(r["lm loss"][0] / r["lm loss"][1]) for r in ref_reports]
    return {"losses": losses, "ref_losses": ref_losses, "tokens": int(tokens), "ref_tokens": int(ref_tokens),
            "grad_rel_err": worst, "names": names, "stages": [chunk_info(c).stage_index for c in chunks]}


def _check(results, n_params_total: int | None = None):
    for res in results:
        assert len(res["losses"]) == len(res["ref_losses"])
        for got, want in zip(res["losses"], res["ref_losses"]):
            assert got == pytest.approx(want, rel=1e-5)
        assert res["tokens"] == res["ref_tokens"]
        assert res["grad_rel_err"] < 1e-5, res["grad_rel_err"]
    # every parameter of the full model lives on exactly one pipeline rank (tp replicas aside)
    names = [n for res in results for n in res["names"]]
    return names


@pytest.mark.parametrize("schedule,per_token", [("1f1b", False), ("gpipe", True)])
def test_pp2_matches_one_process(pool2, schedule, per_token):
    results = pool2.run(_pipeline_case, 2, None, 1, 4, schedule, per_token, timeout=120)
    names = _check(results)
    assert len(names) == len(set(names))
    assert [r["stages"] for r in results] == [[0], [1]]
    assert "embedding.word_embeddings.weight" in results[0]["names"]
    assert "output_layer.weight" in results[1]["names"]


def test_pp2_vp2_interleaved_matches_one_process(pool2):
    results = pool2.run(_pipeline_case, 2, 2, 1, 4, "auto", False, timeout=120)
    _check(results)
    # rank 0 holds stages 0 and 2 (layers 0 and 2), rank 1 stages 1 and 3
    assert [r["stages"] for r in results] == [[0, 2], [1, 3]]
    assert "decoder.layers.2.mlp.linear_fc2.weight" in results[0]["names"]


def test_pp2_tied_embeddings_sum_gradients(pool2):
    results = pool2.run(_pipeline_case, 2, None, 1, 2, "1f1b", False, True, timeout=120)
    _check(results)
    assert "output_layer.weight" in results[1]["names"]  # the copy, compared with the shared tensor's grad


def test_fp8_converts_the_linears_of_every_pipeline_stage(monkeypatch):
    """model.fp8 under PP2: each stage goes through the same materialize step as the whole model, so the
    transformer linears of every stage become torchao FP8 linears, drawn with the unpipelined model's
    weights. Emulated kernels stand in for a GPU; the stages are built in this process, one per pipeline
    rank, and compared with the whole model built by ``setup.build_model``."""
    from types import SimpleNamespace

    import torch
    from torchao.float8.float8_linear import Float8Linear

    from longspan.parallel import float8
    from longspan.parallel.pipeline import chunk_info
    from longspan.training.setup import build_model

    monkeypatch.setattr(float8, "check_fp8", lambda provider, device, mode=None: bool(provider.fp8))
    real_convert = float8.convert_to_fp8
    monkeypatch.setattr(float8, "convert_to_fp8", lambda *a, **k: real_convert(*a, **k, emulated=True))

    def build(pp: int, rank: int) -> torch.nn.Module:
        cfg = _cfg(pp)
        cfg.model.fp8, cfg.model.fp8_recipe = "hybrid", "tensorwise"
        parallel = SimpleNamespace(world_size=1, pp_size=pp, pp_rank=rank, tp_size=1, dp_size=1, cp_size=1,
                                   device=torch.device("cpu"), pp_group=None, tp_group=None, cp_group=None,
                                   dp_group=None)
        (model,) = build_model(cfg, parallel, cfg.rng.seed)
        return model

    whole = dict(build(1, 0).named_parameters())
    for rank in (0, 1):
        chunk = build(2, rank)
        linears = {name: type(m) for name, m in chunk.named_modules() if isinstance(m, torch.nn.Linear)}
        layers = {n: t for n, t in linears.items() if n.startswith("decoder.layers.")}
        assert chunk_info(chunk).stage_index == rank
        assert {n.split(".")[2] for n in layers} == {str(2 * rank), str(2 * rank + 1)}  # this stage's layers
        assert len(layers) >= 4 and set(layers.values()) == {Float8Linear}, linears
        assert all(t is not Float8Linear for n, t in linears.items() if n not in layers)  # output layer stays
        for name, param in chunk.named_parameters():
            assert torch.equal(param, whole[name]), name


# ------------------------------------------------------------------------------------------ validate()


def _validated(world: int, *overrides: str):
    from longspan.recipes.loading import load_config

    cfg = load_config("tiny", [], list(overrides))
    cfg.validate(world_size=world)
    return cfg


def test_validate_accepts_pipeline_layouts():
    cfg = _validated(4, "model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2")
    assert cfg.data_parallel_size == 2 and cfg.num_microbatches == 16 // (2 * 2)
    _validated(2, "model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=1")


@pytest.mark.parametrize(
    "world,overrides,error,needle",
    [
        # gbs 4 / (mbs 2 x dp 1) = 2 microbatches for 4 stages
        (4, ["model.pipeline_model_parallel_size=4", "train.global_batch_size=4"], ConfigError, "fewer than"),
        # interleaving needs a multiple of pp microbatches: gbs 6 gives 3 for pp 2
        (2, ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
             "train.global_batch_size=6"], ConfigError, "not a multiple"),
        (2, ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
             "model.microbatch_group_size_per_vp_stage=4"], "NotSupportedError", "microbatch_group_size_per_vp_stage=4"),
        (2, ["model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=5"], ConfigError,
         "num_layers_in_first_pipeline_stage=5"),
        (1, ["model.overlap_p2p_comm=true"], ConfigError, "batch_p2p_comm=False"),
        (2, ["model.pipeline_model_parallel_size=2", "model.pipeline_model_parallel_comm_backend=mpi"], ConfigError,
         "pipeline_model_parallel_comm_backend='mpi' is not valid"),
    ],
)
def test_validate_rejects_bad_pipeline_settings(world, overrides, error, needle):
    from longspan.core.errors import NotSupportedError

    error = NotSupportedError if error == "NotSupportedError" else error
    with pytest.raises(error) as err:
        _validated(world, *overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp2", [False, True])
def test_pp2_composes_with_data_parallel(pool4, fsdp2):
    # dp 2 x pp 2: each data-parallel rank reads its own microbatches; the DP-averaged gradients must equal
    # one process over all of them.
    results = pool4.run(_pipeline_case, 2, None, 1, 4, "1f1b", False, False, fsdp2, timeout=180)
    _check(results)
    assert [r["stages"] for r in results] == [[0], [0], [1], [1]]


def _tiny_vlm(kind: str, num_layers: int, **split):
    """A tiny Qwen2.5-VL or Gemma 3 VL provider under PP2 with the given pipeline split fields."""
    from longspan.models import Qwen25VLModelProvider
    from longspan.families.gemma_vl.provider import Gemma3VLModelProvider

    common = dict(num_layers=num_layers, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                  num_query_groups=2, vocab_size=80, seq_length=16, pipeline_model_parallel_size=2, **split)
    if kind == "qwen":
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0])
        return Qwen25VLModelProvider(mrope_section=[2, 1, 1], vision_config=vision, **common)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return Gemma3VLModelProvider(vision_config=vision, mm_tokens_per_image=1, image_token_id=79, **common)


# (language model layers, split fields, layers of each virtual stage): Megatron's GPT arithmetic
VLM_SPLITS = [
    (4, {}, [2, 2]),
    (4, {"num_layers_in_first_pipeline_stage": 1}, [1, 3]),
    (4, {"num_layers_in_last_pipeline_stage": 1}, [3, 1]),
    (5, {"account_for_embedding_in_pipeline_split": True}, [2, 3]),  # the embedding (not the encoder) is a layer
    (5, {"account_for_loss_in_pipeline_split": True}, [3, 2]),
    (4, {"virtual_pipeline_model_parallel_size": 2}, [1, 1, 1, 1]),
    (2, {"virtual_pipeline_model_parallel_size": 2, "account_for_embedding_in_pipeline_split": True,
         "account_for_loss_in_pipeline_split": True}, [0, 1, 1, 0]),
]


@pytest.mark.parametrize("kind", ["qwen", "gemma"])
def test_vision_language_stages_split_the_language_layers_and_keep_the_encoder_with_the_embedding(kind, tmp_path):
    """The split fields move the language model's layers as GPT's do; the vision encoder and its projection into
    the language model live on virtual stage 0 (with the embedding) and nowhere else; together the stages hold the
    one-process model's parameters, under its names (each rank's ``state_dict_module``: what checkpoints move
    between layouts by; Gemma's tied output copy named as the embedding); and validate() accepts each split."""
    from longspan.models.builder import build_meta_model
    from longspan.parallel.pipeline import layer_counts_for_config, state_dict_module
    from tests.training.pretrain_helpers import small_config

    encoder = ("vision.", "merger.") if kind == "qwen" else ("vision_tower.", "multi_modal_projector.")
    for num_layers, split, want in VLM_SPLITS:
        provider = _tiny_vlm(kind, num_layers, **split)
        counts = layer_counts_for_config(provider)
        assert counts == want, (split, counts)
        stages = []
        for stage, numbers in enumerate(stage_layer_numbers(counts)):
            model = build_meta_model(provider, pre_process=stage == 0, post_process=stage == len(counts) - 1,
                                     vp_stage=stage // 2 if len(counts) > 2 else None, layer_numbers=numbers)
            names = [n for n, _ in model.named_parameters()]
            assert any(n.startswith(encoder) for n in names) == (stage == 0), (split, stage)
            layers = {int(n.split(".")[3]) for n in names if n.startswith("language_model.decoder.layers.")}
            assert layers == set(numbers), (split, stage, layers)
            stages.append(model)
        whole = [n for n, _ in build_meta_model(provider).named_parameters()]
        # each pipeline rank's checkpoint names (its chunks: stages rank, rank + 2, ...); a tied output copy on
        # the last rank is saved under the embedding's name too
        held = [n for rank in (0, 1) for n, _ in state_dict_module(stages[rank::2]).named_parameters()]
        assert set(held) == set(whole) and len(held) == len(whole) + int(provider.share_embeddings_and_output_weights)
        cfg = small_config(tmp_path)
        cfg.model, cfg.dataset.sequence_length = provider, provider.seq_length
        cfg.validate(world_size=2)
