"""Tensor / sequence parallel plans: which module is split how, what is rejected, and (on 2 gloo ranks) that
the split model computes what the whole model computes, with a vocab-parallel loss and layout-independent
weights and dropout."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from longspan.core.errors import ConfigError
from tests.parallel.harness import get_shared_pool, init_gloo


def small_provider(**overrides):
    """A 2-layer GQA model: 4 heads / 2 query groups, SwiGLU, RMSNorm, RoPE, vocab 256."""
    from longspan.models.gpt_provider import GPTModelProvider

    fields = dict(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
        seq_length=16, vocab_size=256, make_vocab_size_divisible_by=32, normalization="RMSNorm",
        position_embedding_type="rope", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        share_embeddings_and_output_weights=False, attention_dropout=0.0, hidden_dropout=0.0,
        init_method_std=0.02,
    )
    fields.update(overrides)
    provider = GPTModelProvider(**fields)
    provider.finalize()
    return provider


def meta_model(**overrides):
    from longspan.models.gpt import build_gpt_model

    return build_gpt_model(small_provider(**overrides), materialize=False)


# ------------------------------------------------------------------------------------------ plans (no processes)

def test_plan_splits_attention_mlp_and_vocab():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from longspan.parallel.tensor_parallel import tensor_parallel_plan

    plan = tensor_parallel_plan(meta_model())
    colwise = {"linear_q", "linear_k", "linear_v"}
    for i in (0, 1):
        for name in colwise:
            assert type(plan[f"decoder.layers.{i}.self_attention.{name}"]) is ColwiseParallel
        assert type(plan[f"decoder.layers.{i}.self_attention.linear_proj"]) is RowwiseParallel
        assert type(plan[f"decoder.layers.{i}.mlp.linear_fc1"]) is ColwiseParallel
        assert type(plan[f"decoder.layers.{i}.mlp.linear_fc1_gate"]) is ColwiseParallel
        assert type(plan[f"decoder.layers.{i}.mlp.linear_fc2"]) is RowwiseParallel
        assert plan[f"decoder.layers.{i}.mlp.linear_fc2"].output_layouts == (Replicate(),)
    emb = plan["embedding.word_embeddings"]
    assert type(emb) is RowwiseParallel and emb.input_layouts == (Replicate(),)
    out = plan["output_layer"]
    assert type(out) is ColwiseParallel and out.output_layouts == (Shard(-1),) and out.use_local_output is False
    assert not any("layernorm" in k for k in plan)  # norms stay plain without sequence parallel


def test_sequence_parallel_plan_shards_norms_and_reduce_scatters():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, SequenceParallel

    from longspan.parallel.tensor_parallel import tensor_parallel_plan

    plan = tensor_parallel_plan(meta_model(), sequence_parallel=True)
    for i in (0, 1):
        assert type(plan[f"decoder.layers.{i}.input_layernorm"]) is SequenceParallel
        assert type(plan[f"decoder.layers.{i}.pre_mlp_layernorm"]) is SequenceParallel
        assert plan[f"decoder.layers.{i}.self_attention.linear_proj"].output_layouts == (Shard(1),)
        assert plan[f"decoder.layers.{i}.mlp.linear_fc2"].output_layouts == (Shard(1),)
        attn = plan[f"decoder.layers.{i}.self_attention"]
        assert type(attn) is PrepareModuleInput and attn.desired_input_layouts == (Replicate(), None, None)
    assert type(plan["decoder.final_layernorm"]) is SequenceParallel
    assert type(plan["embedding"]) is PrepareModuleOutput
    assert plan["output_layer"].input_layouts == (Shard(1),)


def test_vision_language_models_cut_the_sequence_after_the_image_merge():
    """Under sequence parallel a vision-language model's language model keeps its embedding output whole (the
    images go into it) and cuts the decoder's input (the finetunes: tests/data/sft_vlm, tp2_sp). Cutting right
    after the lookup is a one-line error for them, as is the late cut with multi-token prediction."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    from longspan.config.rules.layout import check_sequence_scatter
    from longspan.core.errors import NotSupportedError
    from longspan.families.gemma_vl.provider import Gemma3VLModelProvider
    from longspan.families.qwen_vl.model import Qwen25VLModel
    from longspan.families.qwen_vl.provider import Qwen25VLModelProvider
    from longspan.parallel.tensor_parallel import tensor_parallel_plan

    layout = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    qwen = Qwen25VLModelProvider(num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                                 num_query_groups=2, vocab_size=256, seq_length=16, mrope_section=[2, 1, 1],
                                 vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                                                    out_hidden_size=32, fullatt_block_indexes=[0]), **layout)
    with torch.device("meta"):
        plan = tensor_parallel_plan(Qwen25VLModel(qwen).language_model, sequence_parallel=True)
    assert "embedding" not in plan
    assert plan["decoder"].input_layouts == (Replicate(), None, None)
    assert plan["decoder"].desired_input_layouts == (Shard(1), None, None)
    for provider in (qwen, Gemma3VLModelProvider(**layout)):
        check_sequence_scatter(provider)  # both default to False, as in Megatron Bridge
        provider.scatter_embedding_sequence_parallel = True
        with pytest.raises(ConfigError, match=rf"^model.scatter_embedding_sequence_parallel=True with "
                                              rf"model.sequence_parallel=True: {type(provider).__name__} puts"):
            check_sequence_scatter(provider)
    with pytest.raises(NotSupportedError, match="mtp_num_layers=1 is not supported yet"):
        check_sequence_scatter(small_provider(mtp_num_layers=1, scatter_embedding_sequence_parallel=False, **layout))


def test_plan_covers_only_the_modules_a_stage_holds():
    from longspan.models.gpt import build_gpt_model
    from longspan.parallel.tensor_parallel import tensor_parallel_plan

    stage = build_gpt_model(small_provider(), pre_process=False, post_process=True, materialize=False,
                            layer_numbers=[1])
    plan = tensor_parallel_plan(stage)
    assert "embedding.word_embeddings" not in plan and "output_layer" in plan
    assert not any(k.startswith("decoder.layers.0.") for k in plan)


def test_rejects_query_groups_not_divisible_by_tp():
    from longspan.parallel.tensor_parallel import check_tensor_parallel

    check_tensor_parallel(meta_model(), 2)  # 4 heads, 2 groups: fine
    with pytest.raises(ConfigError, match="num_query_groups=2"):
        check_tensor_parallel(meta_model(), 4)


def test_loss_context_is_null_without_vocab_parallel_output():
    import contextlib
    from types import SimpleNamespace

    from longspan.parallel.loss_parallel import parallel_loss_context, uses_loss_parallel

    assert isinstance(parallel_loss_context(meta_model()), contextlib.nullcontext)
    assert isinstance(parallel_loss_context(None), contextlib.nullcontext)
    assert uses_loss_parallel(SimpleNamespace(tp_size=2)) and not uses_loss_parallel(SimpleNamespace(tp_size=1))


# ------------------------------------------------------------------------------------------ on 2 gloo ranks

def _tp_checks(sequence_parallel: bool, hidden_dropout: float, scatter_embedding: bool = True) -> dict:
    """Split the small model over tp=2 and compare it with the whole model built in the same process."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.parallel.loss_parallel import parallel_loss_context
    from longspan.parallel.tensor_parallel import apply_tensor_parallel

    init_gloo(timeout_s=60)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    provider = small_provider(hidden_dropout=hidden_dropout, scatter_embedding_sequence_parallel=scatter_embedding)
    whole = build_gpt_model(provider, seed=5, device="cpu")
    split = apply_tensor_parallel(build_gpt_model(provider, materialize=False), mesh, sequence_parallel)
    init_weights(split, seed=5, device="cpu")
    out: dict = {}

    # weights: the same full tensors, split as the plan says
    whole_params = dict(whole.named_parameters())
    placements = {}
    for name, p in split.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert torch.equal(full, whole_params[name]), name
        placements[name] = tuple(p.placements) if isinstance(p, DTensor) else None
    attn = "decoder.layers.0.self_attention"
    assert placements[f"{attn}.linear_q.weight"] == (Shard(0),)
    assert placements[f"{attn}.linear_k.weight"] == (Shard(0),)
    assert placements[f"{attn}.linear_proj.weight"] == (Shard(1),)
    assert placements["decoder.layers.0.mlp.linear_fc2.weight"] == (Shard(1),)
    assert placements["embedding.word_embeddings.weight"] == (Shard(0),)
    assert placements["output_layer.weight"] == (Shard(0),)
    norm = placements["decoder.layers.0.input_layernorm.weight"]
    assert norm == ((Replicate(),) if sequence_parallel else None)
    # local kv heads: 2 groups / tp 2 = 1 group of head_dim 8 rows
    assert split.get_parameter(f"{attn}.linear_k.weight").to_local().shape == (8, 32)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 250, (2, 16), generator=g)
    labels = torch.randint(0, 250, (2, 16), generator=g)

    # logits without labels: gathered back to the full vocabulary
    with torch.no_grad():
        whole.eval(), split.eval()
        assert torch.allclose(split(tokens), whole(tokens), atol=1e-5)
    whole.train(), split.train()

    # per-token loss and gradients under the vocab-parallel loss; dropout seeded the same way
    captured = {}
    def capture(module, args, output):
        captured.setdefault("logits", output)  # returns None: the output is left alone

    split.output_layer.register_forward_hook(capture)
    # where the sequence is cut: the embedding's output and the first layer's input, as each rank holds them
    def record_shape(key):
        def hook(module, args, output=None):
            tensor = args[0] if output is None else output
            if key not in captured:
                captured[key] = tuple(tensor.shape)
        return hook

    split.embedding.register_forward_hook(record_shape("embedding_output_shape"))
    split.decoder.layers["0"].register_forward_pre_hook(record_shape("first_layer_input_shape"))
    torch.manual_seed(99)
    ref = whole(tokens, labels=labels)
    ref.mean().backward()
    torch.manual_seed(99)
    with CommDebugMode() as comm, parallel_loss_context(split):
        loss = split(tokens, labels=labels)
        loss.mean().backward()
    logits = captured["logits"]
    out["embedding_output_shape"] = captured["embedding_output_shape"]
    out["first_layer_input_shape"] = captured["first_layer_input_shape"]
    out["logits_local_shape"] = tuple(logits.to_local().shape)
    out["logits_placements"] = tuple(logits.placements)
    out["loss_is_plain_tensor"] = not isinstance(loss, DTensor)
    out["loss_max_diff"] = float((loss - ref).detach().abs().max())
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    out["all_gathers_with_loss_parallel"] = sum(v for k, v in counts.items() if "all_gather" in k)
    grad_diff = 0.0
    for name, p in split.named_parameters():
        g_full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grad_diff = max(grad_diff, float((g_full - whole_params[name].grad).abs().max()))
    out["grad_max_diff"] = grad_diff
    # outside the context (evaluation, a user's loop) the logits are gathered and the loss is still right;
    # the gather is visible to the counter used above
    with torch.no_grad(), CommDebugMode() as comm_outside:
        torch.manual_seed(99)
        outside = split(tokens, labels=labels)
    counts = {str(k): v for k, v in comm_outside.get_comm_counts().items()}
    out["all_gathers_without_loss_parallel"] = sum(v for k, v in counts.items() if "all_gather" in k)
    out["outside_loss_max_diff"] = float((outside - ref.detach()).abs().max())
    # nested contexts are fine and switch torch's handlers off at the outermost exit, even on errors
    from longspan.parallel.tensor_parallel import loss_parallel_enabled

    try:
        with parallel_loss_context(split):
            with parallel_loss_context(split):
                pass
            out["enabled_after_inner_exit"] = loss_parallel_enabled()
            raise KeyError("boom")
    except KeyError:
        pass
    out["enabled_after_error"] = loss_parallel_enabled()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("sequence_parallel", "scatter_embedding"), [(False, True), (True, True), (True, False)],
                         ids=["tp2", "tp2_sp", "tp2_sp_scatter_after_embedding_off"])
def test_split_model_matches_whole_model(sequence_parallel, scatter_embedding):
    # hidden dropout on: the masks must not depend on the layout either
    results = get_shared_pool(2).run(_tp_checks, sequence_parallel, 0.1, scatter_embedding, timeout=180)
    # scatter_embedding_sequence_parallel: the embedding's output is this rank's half of the sequence, or
    # (False) the whole sequence, cut before the first layer
    embedding_seq = 8 if sequence_parallel and scatter_embedding else 16
    for r in results:
        assert r["embedding_output_shape"] == (2, embedding_seq, 32), r
        assert r["first_layer_input_shape"] == (2, 8 if sequence_parallel else 16, 32), r
        assert r["loss_is_plain_tensor"]
        assert r["loss_max_diff"] < 1e-5, r
        assert r["grad_max_diff"] < 1e-5, r
        assert r["logits_local_shape"] == (2, 16, 128)  # half of the padded vocabulary of 256
        from torch.distributed.tensor import Shard

        assert r["logits_placements"] == (Shard(2),)  # vocab-sharded logits, never gathered
    if not sequence_parallel:
        # no full-vocabulary logits anywhere: tp without sp has no all-gather at all under loss_parallel
        assert results[0]["all_gathers_with_loss_parallel"] == 0
    assert results[0]["all_gathers_without_loss_parallel"] > 0
    assert results[0]["outside_loss_max_diff"] < 1e-5
    assert results[0]["enabled_after_inner_exit"] is True
    assert results[0]["enabled_after_error"] is False
