"""A Megatron-LM GPT-3-style command line (examples/gpt3's argument groups, scaled down) runs unedited.

The Megatron spelling must mean exactly what megalite's own spelling means: the two command lines
below parse to the same RunConfig, and the Megatron one trains (tp 2 x pp 2 with virtual stages).
"""
import pytest

from megalite.cli import parse_args
from megalite.config import RunConfig
from megalite.testing import run_distributed

# Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh's groups, scaled down (the ramp-up
# is tests/training/test_rampup.py's; the default byte tokenizer instead of --vocab-file/--merge-file, which
# test_gpt2_bpe_files_become_the_same_tokenizer covers)
GPT_MODEL_ARGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                  "--max-position-embeddings 64 --attention-backend auto")
TRAINING_ARGS = ("--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --weight-decay 0.1 --adam-beta1 0.9 "
                 "--adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --lr 6.0e-4 --lr-decay-style cosine "
                 "--min-lr 6.0e-5 --lr-warmup-fraction .25 --lr-decay-iters 8")
MODEL_PARALLEL_ARGS = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                       "--num-layers-per-virtual-pipeline-stage 1 --use-distributed-optimizer "
                       "--sequence-parallel --use-flash-attn --overlap-grad-reduce --recompute-granularity selective")
DATA_ARGS = "--split 949,50,1"
EVAL_AND_LOGGING_ARGS = "--log-interval 1 --eval-interval 1000 --eval-iters 1"
MEGATRON_LINE = " ".join([GPT_MODEL_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS, DATA_ARGS, EVAL_AND_LOGGING_ARGS])

MEGALITE_LINE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                 "--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --weight-decay 0.1 --adam-beta1 0.9 "
                 "--adam-beta2 0.95 --clip-grad 1.0 --lr 6.0e-4 --lr-decay-style cosine --min-lr 6.0e-5 "
                 "--tp 2 --pp 2 --virtual-stages 2 --zero 1 --sequence-parallel --recompute selective "
                 "--split 949,50,1 --log-interval 1 --eval-interval 1000 --eval-iters 1")


def test_megatron_line_means_the_megalite_line():
    megatron, _ = parse_args(MEGATRON_LINE.split())
    megalite, _ = parse_args(MEGALITE_LINE.split())
    # the Megatron-only settings, as megalite's model and schedule see them
    assert megatron.gpt_config().init_std == 0.006 and megalite.gpt_config().init_std == 0.02
    assert megatron.lr_schedule_iters == (2, 8)  # warm-up = 0.25 x decay steps; megalite's: (30, 2)
    same = megatron.replace(init_method_std=None, max_position_embeddings=None, lr_warmup_fraction=None,
                            lr_decay_iters=None)
    assert same == megalite
    assert megalite.gpt_config().replace(init_std=0.006) == megatron.gpt_config()


@pytest.mark.parametrize("argv, needle", [
    (["--rampup-batch-size", "16", "16", "5859375", "--global-batch-size", "64", "--micro-batch-size", "32"],
     "the ramp's global batch 16 is not a multiple of micro_batch_size*dp"),
    (["--vocab-file", "gpt2-vocab.json"], "GPT2BPETokenizer needs both --vocab-file (vocab.json) and --merge-file"),
    (["--use-torch-fsdp2"], "--use-torch-fsdp2 is a Megatron-LM flag for torch FSDP2"),
    (["--num-layers-per-virtual-pipeline-stage", "3", "--pp", "2"], "do not split into pp 2"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--pp", "2", "--virtual-stages", "3"], "give one of the two"),
    (["--max-position-embeddings", "64", "--seq-length", "128"], "raise it to at least 128"),
    (["--position-embedding-type", "rope", "--normalization", "LayerNorm"], "mix the two model flavours"),
    (["--lr-warmup-fraction", "1.5"], "lr-warmup-fraction"),
    (["--kv-channels", "0"], "--kv-channels"),
])
def test_megatron_mistakes_are_one_line(argv, needle, capsys):
    from megalite.training.loop import main

    try:
        code = main(argv + ["--dry-run"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_megatron_architecture_flags_choose_the_flavour():
    llama, _ = parse_args("--position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention "
                          "--untie-embeddings-and-output-weights --disable-bias-linear --norm-epsilon 1e-6 "
                          "--rotary-base 500000 --make-vocab-size-divisible-by 64".split())
    model = llama.gpt_config()
    assert (model.flavour, model.num_query_groups, model.tie_embeddings, model.add_bias) == ("llama", 1, False, False)
    assert (model.norm_eps, model.rope_theta, model.make_vocab_size_divisible_by) == (1e-6, 500000.0, 64)
    gpt2, _ = parse_args("--position-embedding-type learned_absolute --normalization LayerNorm --no-swiglu".split())
    assert gpt2.gpt_config() == RunConfig().gpt_config()


def test_megatron_attention_shape_flags_reach_the_model():
    from megalite.model import GPTModel

    base, _ = parse_args("--num-layers 1 --disable-bias-linear".split())
    qwen, _ = parse_args("--num-layers 1 --disable-bias-linear --add-qkv-bias --qk-layernorm --kv-channels 48".split())
    before, after = base.gpt_config(), qwen.gpt_config()
    assert (after.qkv_bias, after.proj_bias, after.mlp_bias) == (True, False, False)
    assert (after.qk_layernorm, after.kv_channels, after.head_dim) == (True, 48, 48)
    assert (before.qkv_bias, before.qk_layernorm, before.kv_channels, before.head_dim) == (False, False, None, 32)
    h, heads, groups = after.hidden_size, after.num_attention_heads, after.num_query_groups
    # one block: q/k/v [h, (heads + 2 groups) * d] and output [heads * d, h] widen by 16 per head, plus the
    # q/k/v biases and the two [d] head norms
    widened = h * (heads + 2 * groups) * 16 + heads * 16 * h + (heads + 2 * groups) * 48 + 2 * 48

    def count(cfg):
        return sum(p.numel() for p in GPTModel(cfg, seed=0).parameters())

    assert count(after) - count(before) == widened


def _train(argv):
    from megalite.training.loop import main

    return main(argv)


@pytest.mark.slow
def test_megatron_line_trains_under_four_ranks():
    codes = run_distributed(_train, 4, MEGATRON_LINE.split(), timeout_s=300)
    assert codes == [0, 0, 0, 0]


def test_gpt2_bpe_files_become_the_same_tokenizer(tmp_path, monkeypatch):
    """--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file: a tokenizer.json encoding exactly as the
    byte-level BPE the files came from."""
    tokenizers = pytest.importorskip("tokenizers")
    from megalite.data.tokenizer import load_tokenizer

    monkeypatch.setenv("HOME", str(tmp_path))  # the converted file's cache
    source = tokenizers.Tokenizer(tokenizers.models.BPE())
    source.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    source.decoder = tokenizers.decoders.ByteLevel()
    source.train_from_iterator(["the cat sat on the mat, ünïcode too"] * 8, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    vocab, merges = source.model.save(str(tmp_path))
    argv = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    cfg, _ = parse_args(argv)
    assert cfg.data.tokenizer.startswith(str(tmp_path / ".cache" / "megalite" / "tokenizers"))
    assert parse_args(argv)[0].data.tokenizer == cfg.data.tokenizer  # written once per pair of files
    loaded = load_tokenizer(cfg.data.tokenizer)
    text = "the mat sat on the cat, ünïcode"
    assert loaded.encode(text) == source.encode(text).ids and loaded.eod == source.token_to_id("<|endoftext|>")
    with pytest.raises(Exception, match="needs both --vocab-file"):
        parse_args(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab])
