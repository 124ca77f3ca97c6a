"""The masked attention work each cp rank does under the zigzag split and the per-document (THD)
split (context_parallel/balance.py), against a brute-force count of the visible pairs of a dense
[s, s] mask built from the documents' lengths alone (key j visible to query i when both lie in one
document, j <= i and i - j < window)."""
import pytest
import torch

from megalite.context_parallel.balance import document_split_positions, document_split_shares, imbalance, \
    padded_lengths, token_work, zigzag_shares
from megalite.context_parallel.zigzag import position_ids


def _dense_pairs(lengths, window):
    """Visible keys per query [s] from a dense mask (independent of balance.py)."""
    seq = sum(lengths)
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    mask = (document[:, None] == document[None, :]) & (j <= i)
    if window is not None:
        mask &= i - j < window
    return mask.sum(1)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [None, 3])
def test_shares_equal_brute_force(cp, window):
    lengths = padded_lengths([1, 5, 13, 2, 9, 24, 3], 2 * cp)
    pairs = _dense_pairs(lengths, window)
    assert torch.equal(token_work(lengths, window=window), pairs)
    total, seq = float(pairs.sum()), sum(lengths)
    zigzag = [float(pairs[position_ids(seq, r, cp)].sum()) / total for r in range(cp)]
    split = [float(pairs[document_split_positions(lengths, r, cp)].sum()) / total for r in range(cp)]
    assert zigzag_shares(lengths, cp, window=window) == pytest.approx(zigzag, abs=1e-12)
    assert document_split_shares(lengths, cp, window=window) == pytest.approx(split, abs=1e-12)
    held = torch.cat([document_split_positions(lengths, r, cp) for r in range(cp)])
    assert torch.equal(held.sort().values, torch.arange(seq))  # every token on exactly one rank


@pytest.mark.parametrize("cp", [2, 4])
def test_document_split_balances_causal_documents(cp):
    lengths = padded_lengths([3, 40, 7, 1, 90, 12], 2 * cp)
    assert document_split_shares(lengths, cp) == pytest.approx([1 / cp] * cp, abs=1e-12)
    assert imbalance(zigzag_shares(lengths, cp)) > 1.1  # the zigzag split is uneven here (the test can fail)
    assert zigzag_shares([sum(lengths)], cp) == pytest.approx([1 / cp] * cp, abs=1e-12)  # one causal sequence


def test_document_split_takes_any_lengths_of_a_sequence_that_2cp_divides():
    """Lengths that are not multiples of 2cp split too (their ends dealt as one zigzag sequence, so not
    exactly even); a sequence that 2cp does not divide is refused as the zigzag split refuses it."""
    shares = document_split_shares([5, 7], 2)
    assert sum(shares) == pytest.approx(1.0) and imbalance(shares) < imbalance(zigzag_shares([5, 7], 2))
    assert [len(document_split_positions([5, 7], r, 2)) for r in range(2)] == [6, 6]
    with pytest.raises(ValueError, match="not divisible by 2\\*cp = 4"):
        document_split_positions([4, 6], 0, 2)
