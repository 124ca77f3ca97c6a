"""The checkpoint's view of a DistributedOptimizer: this rank's state in model space, no gather.

`rank_state(optimizer)` returns, per parameter name, the fp32 master / exp_avg / exp_avg_sq of the
piece of that parameter's *flattened local tensor* (its tp shard) this rank owns, with the piece's
[start, end) range; `load_rank_state` is the inverse. Nothing here depends on the dp size, the
buckets or the zero stage, so a checkpoint written under one loads under another. A checkpoint
engineer maps flat local ranges to full-tensor slices with the parameter's shard spec
(`megalite.parameters.params.shard_spec`). torch's whole-tensor state dict is optim/state_dict.py.
"""
from __future__ import annotations


def rank_state(optimizer) -> dict:
    """This rank's optimizer state in model space, independent of dp/bucket layout.

    Returns {'step': int, 'loss_scaler': dict | None, 'params': {name: {
        'start', 'end': the range of the flattened local parameter tensor this rank owns,
        'numel', 'shape': of the local tensor (its tp shard),
        'master', 'exp_avg', 'exp_avg_sq': fp32 CPU tensors of length end - start}}}.
    Parameters of which this rank owns nothing are absent; over the dp group the ranges
    of one parameter tile [0, numel) exactly once (once per rank at zero_stage 0).
    """
    params = {}
    for piece in optimizer.pieces:
        p = optimizer.params[piece.param]
        sl = slice(piece.shard_start, piece.shard_end)
        params[optimizer.names[piece.param]] = {
            "start": piece.local_start, "end": piece.local_end, "numel": p.numel(), "shape": tuple(p.shape),
            "master": optimizer.master_range(sl.start, sl.stop).detach().cpu().clone(),
            "exp_avg": optimizer.exp_avg[sl].detach().cpu().clone(),
            "exp_avg_sq": optimizer.exp_avg_sq[sl].detach().cpu().clone(),
        }
    scaler = optimizer.loss_scaler
    return {"step": optimizer.step_count, "params": params,
            "loss_scaler": scaler.state_dict() if scaler is not None else None}


def load_rank_state(optimizer, state: dict) -> None:
    """Inverse of `rank_state`: this rank's owned pieces, the step count and the loss scaler are read
    from `state`; the caller then publishes the master weights into the parameters.

    Each entry's [start, end) must cover this rank's owned range of that parameter (an
    entry covering the whole local tensor, start=0, end=numel, always works), so a
    checkpoint written under another dp size or zero stage loads here.
    """
    for piece in optimizer.pieces:
        name = optimizer.names[piece.param]
        if name not in state["params"]:
            raise KeyError(f"optimizer state has no entry for parameter {name!r}")
        entry = state["params"][name]
        if entry["start"] > piece.local_start or entry["end"] < piece.local_end:
            raise ValueError(f"optimizer state for {name!r} covers [{entry['start']}, {entry['end']}) but this "
                             f"rank owns [{piece.local_start}, {piece.local_end}); provide the whole local tensor")
        src = slice(piece.local_start - entry["start"], piece.local_end - entry["start"])
        dst = slice(piece.shard_start, piece.shard_end)
        optimizer.master_range(dst.start, dst.stop).copy_(entry["master"][src])
        for key, tensor in (("exp_avg", optimizer.exp_avg), ("exp_avg_sq", optimizer.exp_avg_sq)):
            tensor[dst].copy_(entry[key][src])
    optimizer.step_count = int(state["step"])
    if optimizer.loss_scaler is not None and state.get("loss_scaler") is not None:
        optimizer.loss_scaler.load_state_dict(state["loss_scaler"])
