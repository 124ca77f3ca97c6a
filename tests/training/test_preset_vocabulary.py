"""A preset's vocabulary is its own (issue 49, item 3): planning actions size the embedding, output layer
and logits by the preset's vocabulary, and a training run whose tokenizer differs from a preset named
with --model pads up to it in one line, or is refused when the tokenizer is larger."""
import contextlib
import io

import pytest

from megalite.cli import parse_args
from megalite.errors import ConfigError
from megalite.training import loop
from megalite.training.configure import training_vocabulary


def _cfg(*flags):
    return parse_args(list(flags))[0]


def test_a_smaller_tokenizer_pads_up_to_the_presets_vocabulary_in_one_line():
    vocab, note = training_vocabulary(_cfg("--model", "llama-7b"), 257, preset_given=True)
    assert vocab == 32000
    assert note == ("megalite: --model llama-7b keeps its vocabulary of 32000: the tokenizer's 257 ids use its first "
                    "rows, the other 31743 are never a target (give --vocab-size 257 for a table of the tokenizer's "
                    "size)")


def test_a_larger_tokenizer_than_the_presets_vocabulary_is_refused():
    with pytest.raises(ConfigError, match="--model tiny has a vocabulary of 257 but the tokenizer has 50257 ids"):
        training_vocabulary(_cfg("--model", "tiny"), 50257, preset_given=True)


@pytest.mark.parametrize("flags,given,tokenizer,expected", [
    ((), False, 50257, 50257),  # the default preset: the tokenizer's vocabulary, as before
    (("--model", "llama-7b", "--vocab-size", "300"), True, 257, 257),  # --vocab-size decides (configure keeps it)
    (("--model", "llama-7b"), True, None, None),  # mock data: the model's own
    (("--model", "tiny"), True, 257, 257),
])
def test_the_rest_is_unchanged(flags, given, tokenizer, expected):
    assert training_vocabulary(_cfg(*flags), tokenizer, preset_given=given) == (expected, None)


@pytest.mark.parametrize("action,needle", [
    ("--print-config", "vocab_size = 32000"),
    ("--dry-run", "parameters           26.954 GB"),  # 6.74B fp32 parameters with 32000 rows (257: 6.48B)
])
def test_planning_actions_use_the_presets_vocabulary(action, needle):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = loop.main(["--model", "llama-7b", action])
    assert code == 0 and needle in out.getvalue(), out.getvalue()[-3000:]
