"""Document boundaries in a sample cut from the token stream: Megatron's --reset-position-ids,
--reset-attention-mask and --eod-mask-loss.

A sample of the indexed dataset runs across documents, each ended by the end-of-document token
(tools/preprocess_data.py appends it; the index records its id). With the flags a sample also
carries `position_ids` [s] restarting at 0 on the token after each end-of-document (the end token
belongs to the document it ends), from which the model builds the attention mask that keeps each
document to itself (kernels/attention_documents.py); with --eod-mask-loss the targets of the
end-of-document tokens (the next document's first token, which nothing in the sample predicts) are
ignored (-100). The loss is then the mean over the unmasked targets of the whole global batch
(training/step.py counts labels != -100 over every microbatch and dp rank): docs/documents.md.
"""
from __future__ import annotations

import dataclasses

import torch

from megalite.data.indexed_dataset import DataError


@dataclasses.dataclass(frozen=True)
class DocumentFields:
    """What a GPTDataset sample gains from its end-of-document tokens."""

    position_ids: bool = False  # --reset-position-ids (with --reset-attention-mask: the documents' mask)
    eod_mask_loss: bool = False  # --eod-mask-loss

    def apply(self, sample: dict[str, torch.Tensor], eod: int) -> dict[str, torch.Tensor]:
        """{"input_ids", "labels"} [s] -> the same with position_ids [s] and/or masked end-of-document targets."""
        ends = sample["input_ids"] == eod  # [s]
        if self.position_ids:
            sample["position_ids"] = document_position_ids(ends)
        if self.eod_mask_loss:
            sample["labels"] = sample["labels"].masked_fill(ends, -100)
        return sample


def document_position_ids(ends: torch.Tensor) -> torch.Tensor:
    """ends [s] bool (end-of-document tokens) -> positions [s] int64, 0 on the first token and after each end."""
    s = ends.shape[0]
    rows = torch.arange(s)
    starts = torch.zeros(s, dtype=torch.bool)
    starts[0] = True
    starts[1:] = ends[:-1]
    first = torch.where(starts, rows, 0).cummax(0).values  # each token's document start
    return rows - first


def check_position_ids(position_ids: torch.Tensor) -> None:
    """position_ids [b, s] on the host (the loader's): each row starts at 0 and each step is +1 or a
    restart at 0. Raises DataError naming the first offending sample and token."""
    if position_ids.dim() != 2:
        raise DataError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}")
    previous = torch.cat([torch.full_like(position_ids[:, :1], -1), position_ids[:, :-1]], dim=1)
    bad = (position_ids != 0) & (position_ids != previous + 1)
    if bool(bad.any()):
        sample, token = (int(i) for i in bad.nonzero()[0])
        raise DataError(f"position_ids of sample {sample} do not restart at 0 per document: token {token} has "
                        f"{int(position_ids[sample, token])} after {int(previous[sample, token])}; each document's "
                        f"positions run 0, 1, 2, ... (transformers' padding-free convention)")
