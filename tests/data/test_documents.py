"""Megatron's document flags on GPT samples: position ids restarting after each end-of-document token,
the end tokens' targets masked, and the check that refuses position ids that do not restart."""
import pytest
import torch

from data_helpers import random_texts, write_byte_dataset
from megalite.data import GPTDataset, IndexedDataset
from megalite.data.documents import DocumentFields, check_position_ids, document_position_ids
from megalite.data.indexed_dataset import DataError

SEQ = 32


def test_samples_carry_restarting_positions_and_masked_end_of_document_targets(tmp_path):
    write_byte_dataset(str(tmp_path / "d"), random_texts(30, seed=1, max_len=20))  # several documents per sample
    indexed = IndexedDataset(str(tmp_path / "d"))
    plain = GPTDataset(indexed, 0, 30, SEQ, seed=3, cache_dir=str(tmp_path / "cache"))
    fields = GPTDataset(indexed, 0, 30, SEQ, seed=3, cache_dir=str(tmp_path / "cache"),
                        documents=DocumentFields(position_ids=True, eod_mask_loss=True))
    eod, restarts = indexed.eod, 0
    for i in range(len(plain)):
        a, b = plain[i], fields[i]
        assert torch.equal(a["input_ids"], b["input_ids"])
        ids, positions = b["input_ids"].tolist(), b["position_ids"].tolist()
        for t in range(SEQ):  # by hand: 0 at the start and after an end token, else one more
            expected = 0 if t == 0 or ids[t - 1] == eod else positions[t - 1] + 1
            assert positions[t] == expected
            assert b["labels"][t] == (-100 if ids[t] == eod else a["labels"][t])
        restarts += positions[1:].count(0)
    assert restarts > len(plain)  # the test saw many documents inside samples
    check_position_ids(torch.stack([fields[i]["position_ids"] for i in range(len(fields))]))


def test_position_ids_from_end_tokens():
    ends = torch.tensor([False, True, True, False, False, True])
    assert document_position_ids(ends).tolist() == [0, 1, 0, 0, 1, 2]  # a 1-token document in the middle


@pytest.mark.parametrize("row, where", [([1, 2, 3], "token 0 has 1 after -1"), ([0, 1, 3], "token 2 has 3 after 1")])
def test_position_ids_that_do_not_restart_at_zero_are_refused_in_one_line(row, where):
    with pytest.raises(DataError, match=f"sample 1 do not restart at 0 per document: {where}") as error:
        check_position_ids(torch.tensor([[0, 1, 0], row]))
    assert "\n" not in str(error.value)
