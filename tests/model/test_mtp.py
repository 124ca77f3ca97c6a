"""DeepSeek-V3's multi-token prediction (megalite/model/mtp.py) against a hand-written single-process
reference that follows the report (each depth on the T-k positions that have both tokens, the loss
1/T * sum, lambda/D times their sum added), and under tp + SP and dp against the single process."""
import pytest
import torch
import torch.nn.functional as F

from megalite.parameters import params as P
from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.context_parallel.zigzag import split_sequence
from megalite.distributed import comm
from megalite.config import RunConfig
from megalite.distributed.mesh import init_mesh, single_process_mesh
from megalite.kernels import DocumentMask
from megalite.model.gpt import GPTModel
from megalite.plan.params import stage_params
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.launch_checks import launch_problems
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

SEQ, VOCAB = 16, 257


def _cfg(tp=1, dp=1, **kw):
    settings = dict(model="deepseek-tiny", num_layers=2, moe_layer_freq=(0, 1), hidden_size=64, ffn_hidden_size=96,
                    seq_length=SEQ, mtp_num_layers=2, mtp_loss_scaling_factor=0.3, micro_batch_size=2,
                    global_batch_size=4, lr=1e-3, seed=11,
                    moe_aux_loss_coeff=0.0)  # an MTP block's balancing loss counts its k rolled-in positions too
    return RunConfig.build(tp=tp, dp=dp, **{**settings, **kw})


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference(model: GPTModel, ids, labels, window=None):
    """(loss the report trains on, the language model's loss, [each depth's summed cross entropy]), all / T.
    window: every block, the depths' included, attends over its own sequence's last `window` positions
    (Mistral's window, proven against transformers in test_sliding_window.py)."""
    config, (b, t) = model.config, ids.shape
    eps, weight = config.norm_eps, model.word_embeddings.weight[:VOCAB]
    head = model.head_weight()[:VOCAB]
    rope = (model.rope_cos, model.rope_sin)

    def embed(tokens):  # [b, n] -> [n, b, h]
        return F.embedding(tokens, weight).transpose(0, 1)

    def cross_entropy(hidden, norm, targets):  # hidden [n, b, h], targets [b, n]; summed over the targets
        logits = _rms(hidden, norm.weight, eps) @ head.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.t().reshape(-1), ignore_index=-100, reduction="sum")

    def masked(n):  # the window over n positions, or plain causal attention
        return (DocumentMask.sliding_window(b, n, window),) if window is not None and window < n else ()

    hidden = embed(ids)
    for block in model.layers:
        hidden = block(hidden, (rope[0][:t], rope[1][:t]), model.rng, *masked(t))
    main = cross_entropy(hidden, model.final_norm, labels)
    depths = []
    for k, depth in enumerate(model.mtp.depths, start=1):
        n = t - k  # positions i with t_{i+k} and t_{i+k+1}
        combined = torch.cat([_rms(embed(ids[:, k:]), depth.enorm.weight, eps),
                              _rms(hidden[:n], depth.hnorm.weight, eps)], dim=-1)
        hidden = depth.block(combined @ depth.eh_proj.weight.t(), (rope[0][:n], rope[1][:n]), model.rng, *masked(n))
        depths.append(cross_entropy(hidden, depth.final_norm, labels[:, k:]))  # target t_{i+k+1} = labels[i+k]
    count = (labels != -100).sum()
    lam, d = config.mtp_loss_scaling_factor, config.mtp_num_layers
    return (main + lam / d * sum(depths)) / count, main / count, [x / count for x in depths]


@pytest.mark.parametrize("window", [None, 5])
def test_mtp_equals_the_reports_formulation(window):
    """window 5: a sliding window over the blocks and the depths (DeepSeek's latent attention here); depth
    k's position i sees positions i-4..i of its own input, as the report's T-k positions under the window."""
    config = _cfg(window_size=window).gpt_config()
    model = GPTModel(config, single_process_mesh("cpu")).train()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    labels = torch.roll(ids, -1, 1)
    labels[0, :3], labels[:, -1] = -100, -100  # a masked prefix, no target after the end
    count = (labels != -100).sum()
    loss = model(ids, labels, reduction="sum") / count
    got_depths = [x / float(count) for x in model.mtp.take_step_sums()]
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    objective, main, depths = _reference(model, ids, labels, window)
    objective.backward()
    torch.testing.assert_close(loss, main, rtol=1e-6, atol=0)  # the reported loss is the language model's
    torch.testing.assert_close(torch.tensor(got_depths, dtype=torch.float64), torch.stack(depths).detach().double(),
                               rtol=1e-5, atol=0)
    assert len(ours) == len([p for p in model.parameters() if p.grad is not None])
    for name, param in model.named_parameters():
        if param.grad is not None:
            assert_tensor_close(ours[name], param.grad, rtol=1e-5, what=name)
    assert ours["mtp.depths.1.eh_proj.weight"].abs().sum() > 0  # the deepest depth was trained


def test_mtp_on_packed_documents_equals_each_document_alone():
    """--reset-attention-mask: the depths attend within documents and no depth reads a token of the next
    document, so three packed documents give the losses (main and per depth) and every gradient of the three
    run one by one, each with its labels (the last one of a document still predicting the next's first token,
    as the main loss does)."""
    cfg = RunConfig.build(model="tiny-llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, seq_length=SEQ,
                          mtp_num_layers=2, mtp_loss_scaling_factor=0.3, vocab_size=VOCAB)  # latent attention
    # takes no documents yet; MTP does
    model = GPTModel(cfg.gpt_config(), single_process_mesh("cpu")).train()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(8))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    bounds = [(0, 5), (5, 11), (11, SEQ)]
    position_ids = torch.cat([torch.arange(b - a) for a, b in bounds]).unsqueeze(0)

    def run(pieces):
        model.zero_grad()
        loss = sum(model(ids[:, a:b], labels[:, a:b], reduction="sum", **extra) for a, b, extra in pieces)
        loss.backward()
        return loss.detach(), model.mtp.take_step_sums(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                           if p.grad is not None}
    packed = run([(0, SEQ, {"position_ids": position_ids})])
    alone = run([(a, b, {}) for a, b in bounds])
    assert packed[0].item() == pytest.approx(alone[0].item(), rel=1e-6)
    assert packed[1] == pytest.approx(alone[1], rel=1e-5)
    assert packed[2].keys() == alone[2].keys()
    for name, grad in packed[2].items():
        assert_tensor_close(grad, alone[2][name], rtol=1e-5, what=name)
    assert run([(0, SEQ, {})])[1] != pytest.approx(alone[1], rel=1e-3)  # the documents matter to the depths


def _batches(dp, dp_rank, steps=2, micro=2):  # two steps: the second runs on the first's update
    out = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(60 + step))
        mine = ids[dp_rank * 4 // dp:(dp_rank + 1) * 4 // dp]
        out.append([{"input_ids": i[:, :-1], "labels": i[:, 1:]} for i in mine.split(micro)])
    return out


def _train(m, cfg, reference=None, steps=2):
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    assert sum(p.numel() for p in optimizer.model.params) == stage_params(cfg.gpt_config(), cfg, m.pp_rank)
    results = [train_step(optimizer.model, optimizer, b, m, cfg, lr=1e-3)
               for b in _batches(m.dp_size, m.dp_rank, steps, cfg.training.micro_batch_size)]
    final = {}
    with optimizer.model.gathered():
        for name, p in chunks[0].logical_parameters():
            if reference is None:
                final[name] = P.shard_spec(p).assemble([p.detach()])
            elif not P.info(p).expert_parallel or name in reference:
                assert_tensor_close(p, P.shard_spec(p).shard(reference[name]), rtol=1e-5, what=name)
    return [(r.loss, r.grad_norm, r.mtp) for r in results], final


QUICK = [(2, 1, dict(sequence_parallel=True, mtp_num_layers=1))]
LAYOUTS = [(2, 1, dict(sequence_parallel=True)), (1, 2, dict(zero=1)), (2, 1, dict(recompute="full"))]
# pp 2: the last stage runs the depths with its copy of the word embedding, summed with stage 0's
PIPELINE_QUICK = [(1, 1, dict(pp=2, mtp_num_layers=1))]
PIPELINE = [(2, 1, dict(pp=2, sequence_parallel=True)), (1, 2, dict(pp=2, zero=1, micro_batch_size=1))]
PIPELINE_TIED = [(1, 1, dict(pp=2, untie_embeddings_and_output_weights=False))]  # the copy is the head too
# ZeRO 3: the depths are units; they borrow the embedding and the head. (The expert bias is off: a meta-built
# router's bias buffers stay on the meta device, with or without MTP.)
_Z3 = dict(zero=3, moe_router_enable_expert_bias=False)
ZERO3 = [(1, 2, dict(_Z3, micro_batch_size=1))]
PIPELINE_ZERO3 = [(1, 2, dict(_Z3, pp=2, micro_batch_size=1)), (2, 1, dict(_Z3, pp=2, sequence_parallel=True))]
PIPELINE_VP = [(1, 1, dict(pp=2, virtual_stages=2, num_layers=4, moe_layer_freq=(0, 1, 0, 1)))]


def _world(reference, layouts, steps):
    out = []
    for tp, dp, settings in layouts:
        cfg = _cfg(tp, dp, **settings)
        world = tp * dp * cfg.parallel.pp
        assert launch_problems(cfg.resolved(world), world) == []
        moe = cfg.gpt_config().moe  # the mesh's expert groups are built for the model's experts
        mesh = init_mesh(tp=tp, dp=dp, pp=cfg.parallel.pp, num_experts=moe.num_experts if moe is not None else 0,
                         replace=True)
        out.append(_train(mesh, cfg, reference, steps)[0])
    return out


@pytest.mark.parametrize("layouts, steps, world", [
    pytest.param(QUICK, 1, 2, marks=pytest.mark.slow),  # ~4 s
    pytest.param(LAYOUTS, 2, 2, marks=pytest.mark.slow),
    pytest.param(PIPELINE_QUICK, 2, 2),
    pytest.param(PIPELINE, 2, 4, marks=pytest.mark.slow),
    pytest.param(PIPELINE_TIED, 2, 2, marks=pytest.mark.slow),
    pytest.param(PIPELINE_VP, 2, 2, marks=pytest.mark.slow),
    pytest.param(ZERO3, 2, 2, marks=pytest.mark.slow),
    pytest.param(PIPELINE_ZERO3, 2, 4, marks=pytest.mark.slow)],
    ids=["tp-sp", "tp-dp", "pp", "pp-tp-dp", "pp-tied", "pp-vp", "zero3", "pp-zero3"])
def test_mtp_layouts_equal_the_single_process(layouts, steps, world):
    depths = layouts[0][2].get("mtp_num_layers", 2)  # the layouts of one world share the model's shape
    shape = {k: v for k, v in layouts[0][2].items() if k in ("untie_embeddings_and_output_weights", "num_layers",
                                                             "moe_layer_freq", "moe_router_enable_expert_bias")}
    results, final = _train(single_process_mesh("cpu"), _cfg(mtp_num_layers=depths, **shape), steps=steps)
    assert set(results[0][2]) == {f"mtp_loss_{k + 1}" for k in range(depths)}
    for rank in run_distributed(_world, world, final, layouts, steps, timeout_s=300):
        for (tp, dp, settings), got in zip(layouts, rank):
            for (loss, norm, mtp), (ref_loss, ref_norm, ref_mtp) in zip(got, results):
                assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
                assert mtp == pytest.approx(ref_mtp, rel=1e-5), settings


@pytest.mark.parametrize("settings, message", [
    (dict(pp=2, model="tiny", num_layers=2, moe_layer_freq=None, moe_aux_loss_coeff=None),
     "not the learned position table"),
    (dict(cuda_graph=True), "--mtp-num-layers runs without --cuda-graph"),
])
def test_mtp_layouts_not_built_are_refused_in_one_line(settings, message):
    cfg = _cfg(**settings)
    world = cfg.parallel.pp * cfg.parallel.cp
    problems = launch_problems(cfg.resolved(world), world)
    assert any(message in p for p in problems), problems


@pytest.mark.slow  # ~3 s: an optimizer and a checkpoint round trip
def test_a_checkpoint_carries_the_mtp_depths_and_the_expert_biases(tmp_path):
    cfg = _cfg(mtp_num_layers=1, moe_router_bias_update_rate=0.05)
    m = single_process_mesh("cpu")
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    train_step(optimizer.model, optimizer, _batches(1, 0, 1)[0], m, cfg, lr=1e-3)
    Checkpointer(tmp_path, m, log=lambda *_: None).save(1, chunks, optimizer, consumed_samples=4,
                                                        model_config=chunks[0].config)
    fresh = build_model_chunks(cfg.gpt_config(), cfg, m)
    fresh_optimizer = build_optimizer(build_data_parallel(fresh, cfg, m), cfg)
    assert load_checkpoint(tmp_path, fresh, fresh_optimizer, m, log=lambda *_: None).step == 1
    saved = dict(chunks[0].state_dict())
    assert any(name.startswith("mtp.depths.0.") for name in saved)
    assert any(name.endswith("expert_bias") and saved[name].abs().sum() > 0 for name in saved)
    for name, tensor in fresh[0].state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def _resume_at_pp2(saved, resaved, reference, cfg_settings):
    """pp 2: load the pp-1 checkpoint, train its second step (equal to the uninterrupted run), save."""
    cfg = _cfg(pp=2, **cfg_settings)
    m = init_mesh(pp=2, num_experts=cfg.gpt_config().moe.num_experts, replace=True)
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    assert load_checkpoint(saved, chunks, optimizer, m, log=lambda *_: None).step == 1
    result = train_step(optimizer.model, optimizer, _batches(1, 0)[1], m, cfg, lr=1e-3)
    for name, p in chunks[0].logical_parameters():  # the last stage's embedding copy included
        assert_tensor_close(p, P.shard_spec(p).shard(reference[name]), rtol=1e-5, what=name)
    Checkpointer(resaved, m, log=lambda *_: None).save(2, chunks, optimizer, consumed_samples=8,
                                                       model_config=chunks[0].config)
    return result.loss, result.mtp


@pytest.mark.slow  # ~15 s: two steps at pp 1, one at pp 2, three checkpoint reads and writes
def test_an_mtp_checkpoint_resumes_across_pp_1_and_2(tmp_path):
    """pp 1 -> 2 -> 1: the depths, the embedding (one tensor, though the last stage holds a copy) and the
    optimizer state travel; the pp-2 step equals the uninterrupted run's second step."""
    settings = dict(mtp_num_layers=1)
    cfg, m = _cfg(**settings), single_process_mesh("cpu")
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    batches = _batches(1, 0)
    train_step(optimizer.model, optimizer, batches[0], m, cfg, lr=1e-3)
    Checkpointer(tmp_path / "pp1", m, log=lambda *_: None).save(1, chunks, optimizer, consumed_samples=4,
                                                                model_config=chunks[0].config)
    second = train_step(optimizer.model, optimizer, batches[1], m, cfg, lr=1e-3)
    reference = {name: P.shard_spec(p).assemble([p.detach()]) for name, p in chunks[0].logical_parameters()}
    for loss, mtp in run_distributed(_resume_at_pp2, 2, tmp_path / "pp1", tmp_path / "pp2", reference, settings):
        assert loss == pytest.approx(second.loss, rel=1e-5) and mtp == pytest.approx(second.mtp, rel=1e-5)
    fresh = build_model_chunks(cfg.gpt_config(), cfg, m)
    fresh_optimizer = build_optimizer(build_data_parallel(fresh, cfg, m), cfg)
    assert load_checkpoint(tmp_path / "pp2", fresh, fresh_optimizer, m, log=lambda *_: None).step == 2
    for name, p in fresh[0].logical_parameters():
        assert_tensor_close(p, P.shard_spec(p).shard(reference[name]), rtol=1e-5, what=name)


_DENSE = dict(model="tiny-llama", moe_layer_freq=None, moe_aux_loss_coeff=None)  # latent attention under cp: refused


def _forward_backward(model, ids, labels):
    """(loss sum, each depth's summed loss, every gradient) of one training forward and backward."""
    model.train()
    loss = model(ids, labels, reduction="sum")
    loss.backward()
    return loss.detach(), torch.tensor(model.mtp.take_step_sums()), {n: p.grad for n, p in model.named_parameters()}


def _cp_world(ids, labels, cp_comm_type):
    cfg = _cfg(cp=2, cp_comm_type=cp_comm_type, **_DENSE)
    assert launch_problems(cfg.resolved(2), 2) == []
    m = init_mesh(cp=2, replace=True)
    model = GPTModel(cfg.gpt_config(), m, cp_comm_type=cp_comm_type)
    mine = [split_sequence(t, m.cp_rank, 2) for t in (ids, labels)]  # this rank's zigzag chunks
    out = _forward_backward(model, *mine)
    for tensor in (out[0], out[1], *out[2].values()):  # each cp rank's share of the sums
        comm.all_reduce(tensor, m.cp_group)
    return out


@pytest.mark.parametrize("cp_comm_type", ["p2p", pytest.param("a2a", marks=pytest.mark.slow)])
def test_mtp_under_context_parallelism_equals_the_single_process(cp_comm_type):
    """cp 2: the tokens k ahead of a rank's last positions live on the other rank; the depths read them
    from the gathered whole sequence. Loss, per-depth losses and every gradient equal the single process
    (a gradient comparison: after an Adam step one element of a depth's eh_proj with a gradient near 5e-7
    moves by Adam's epsilon, 1.2e-5 of the matrix's norm)."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    labels = torch.roll(ids, -1, 1)
    labels[0, :3], labels[:, -1] = -100, -100
    expected = _forward_backward(GPTModel(_cfg(**_DENSE).gpt_config(), single_process_mesh("cpu")), ids, labels)
    loss, depths, grads = run_distributed(_cp_world, 2, ids, labels, cp_comm_type)[0]
    assert loss.item() == pytest.approx(expected[0].item(), rel=1e-6)
    torch.testing.assert_close(depths, expected[1], rtol=1e-5, atol=0)
    for name, grad in expected[2].items():
        assert_tensor_close(grads[name], grad, rtol=1e-5, what=name)


def _flops_added(config, depths_params: int, scores_width: int) -> float:
    """What the depths add to the MFU's FLOPs per token: 6 x (their parameters a token passes through + one
    more output layer each) and each depth's attention."""
    d = config.mtp_num_layers
    return 6 * (depths_params + d * config.vocab_size * config.hidden_size) + 6 * d * scores_width * SEQ


def test_mtp_flops_count_each_depths_block_and_output_layer():
    """The MFU's model FLOPs count each depth's block, M_k and its pass through the output layer; an MoE
    depth its topk experts only (DeepSeek-shaped: the depth's block has experts, as the last block)."""
    moe = _cfg(mtp_num_layers=1).gpt_config()
    assert moe.is_moe_block(moe.num_layers)
    inactive = moe.moe_mlp_params(active=False) - moe.moe_mlp_params(active=True)
    extra = moe.num_params(include_embedding=False) - moe.replace(mtp_num_layers=0).num_params(include_embedding=False)
    scores = moe.num_attention_heads * (moe.mla.qk_dim + moe.mla.v_head_dim)
    added = _flops_added(moe, extra - inactive, scores)
    assert moe.flops_per_token() - moe.replace(mtp_num_layers=0).flops_per_token() == pytest.approx(added)


@pytest.mark.slow  # ~2-7 s: torch's FLOP counter over two forward + backward passes
def test_mtp_flops_counted_by_torch():
    """torch's FlopCounterMode over a forward + backward sees exactly 6 x (the depths' matrices + D x the
    padded head) more per token; the count adds 6 x (their parameters, norms included by the 6N convention,
    + D x the true vocabulary's head) and the depths' attention (12 h s each; megalite's attention core runs
    outside torch's counted ops)."""
    from torch.utils.flop_counter import FlopCounterMode

    def counted(depths):
        cfg = RunConfig.build(**_DENSE, num_layers=2, hidden_size=64, seq_length=SEQ, mtp_num_layers=depths)
        model = GPTModel(cfg.gpt_config(), single_process_mesh("cpu")).train()
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
        with FlopCounterMode(display=False) as counter:
            model(ids, ids).backward()
        return counter.get_total_flops(), model

    (base, _), (total, model) = counted(0), counted(2)
    config, tokens = model.config, 2 * SEQ
    matrices = sum(p.numel() for p in model.mtp.parameters() if p.dim() == 2)
    assert total - base == 6 * (matrices + 2 * config.padded_vocab_size(1) * config.hidden_size) * tokens
    added = _flops_added(config, sum(p.numel() for p in model.mtp.parameters()), 2 * config.hidden_size)
    assert config.flops_per_token() - config.replace(mtp_num_layers=0).flops_per_token() == pytest.approx(added)
