#!/usr/bin/env python
"""Data-pipeline benchmark (not a test): preprocessing throughput, index build time, read time.

    python tools/bench_data.py --corpus-mb 300 --workers 2 --index-tokens 1e9

1. Preprocessing: a synthetic JSON-lines corpus of --corpus-mb MB (generated once into
   --workdir) through tools/preprocess_data.py's code path with the byte tokenizer, at 1 and
   --workers processes; baseline in the same run: reading and JSON-parsing the same file with
   no tokenization (the ceiling a tokenizer-free pass could reach). With `tokenizers`
   installed, also a BPE tokenizer.json trained here on the corpus (nothing downloaded).
2. Sample index for --index-tokens tokens: a synthetic .idx with that many tokens of
   document lengths (and a sparse .bin of the right size: nothing is written), then the
   vectorised build, the cached load, and a pure-Python loop reference on 1% of the documents,
   extrapolated, for the ratio.
3. Reading: one step's microbatches (load_microbatches) from the preprocessed corpus.
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megalite.data.indexed_dataset import IndexedDataset, write_index  # noqa: E402
from megalite.data.preprocess import preprocess_files  # noqa: E402
from megalite.data.sample_index import build_sample_index, cached_sample_index  # noqa: E402
from megalite.data.tokenizer import load_tokenizer  # noqa: E402
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402
from megalite.data import GlobalBatchSampler, build_gpt_datasets, load_microbatches


def generate_corpus(path: str, megabytes: float, seed: int = 0) -> None:
    """JSON lines of English-like text: documents of 5-100 sentences drawn from a fixed pool."""
    if os.path.exists(path) and os.path.getsize(path) >= megabytes * 1e6:
        return
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    freq = np.linspace(2.0, 0.1, 26) / np.linspace(2.0, 0.1, 26).sum()
    words = ["".join(rng.choice(letters, size=rng.integers(1, 10), p=freq)) for _ in range(20_000)]
    words += ["café", "naïve", "über", "€", "😀"]
    sentences = []
    for _ in range(20_000):
        ids = rng.zipf(1.3, size=rng.integers(5, 30)) % len(words)
        sentences.append(" ".join(words[i] for i in ids).capitalize() + ".")
    written = 0
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        while written < megabytes * 1e6:
            text = " ".join(sentences[i] for i in rng.integers(0, len(sentences), size=rng.integers(5, 100)))
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode())
    os.replace(path + ".tmp", path)


def read_parse_baseline(path: str) -> float:
    """Seconds to read and JSON-parse every line (no tokenization)."""
    start = time.perf_counter()
    with open(path, "rb") as f:
        for line in f:
            json.loads(line)["text"].encode()
    return time.perf_counter() - start


def bench_preprocess(args, corpus: str, baseline_s: float) -> str:
    size_mb = os.path.getsize(corpus) / 1e6
    print(f"\n== preprocessing {size_mb:.0f} MB of JSON lines ({corpus})")
    print(f"baseline  read + json.loads only          : {size_mb / baseline_s:8.1f} MB/s")
    prefix = None
    for workers in sorted({1, args.workers}):
        prefix = os.path.join(args.workdir, f"byte_w{workers}")
        stats = preprocess_files([corpus], prefix, "byte", ("text",), workers)
        print(f"byte tokenizer, {workers} worker(s)             : {size_mb / stats.seconds:8.1f} MB/s "
              f"{stats.tokens / stats.seconds / 1e6:7.1f} M tokens/s  ({stats.seconds:.2f} s, "
              f"{baseline_s / stats.seconds:.2f}x the read+parse baseline)")
    if args.hf_mb > 0:
        bench_hf(args, corpus)
    return prefix


def bench_hf(args, corpus: str) -> None:
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders  # optional: skipped without it
    except ImportError:
        print("(tokenizers not installed: BPE benchmark skipped)")
        return
    subset = os.path.join(args.workdir, f"subset_{args.hf_mb}mb.jsonl")
    if not os.path.exists(subset):
        with open(corpus, "rb") as src, open(subset, "wb") as dst:
            for line in src:
                dst.write(line)
                if dst.tell() >= args.hf_mb * 1e6:
                    break
    tokenizer_path = os.path.join(args.workdir, "bpe8k.json")
    if not os.path.exists(tokenizer_path):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        with open(corpus, encoding="utf-8") as f:
            sample = [json.loads(next(f))["text"] for _ in range(2000)]
        tok.train_from_iterator(sample, trainer)
        tok.save(tokenizer_path)
    size_mb = os.path.getsize(subset) / 1e6
    print(f"-- BPE (8k vocab, trained here) on the first {size_mb:.0f} MB")
    for workers in sorted({1, args.workers}):
        tokenizer = load_tokenizer(tokenizer_path)
        stats = preprocess_files([subset], os.path.join(args.workdir, f"bpe_w{workers}"), tokenizer, ("text",),
                                 workers)
        print(f"BPE tokenizer, {workers} worker(s)              : {size_mb / stats.seconds:8.1f} MB/s "
              f"{stats.tokens / stats.seconds / 1e6:7.2f} M tokens/s  ({stats.seconds:.2f} s)")


def naive_sample_index(doc_lengths: np.ndarray, seq_length: int) -> list[tuple[int, int]]:
    """Reference: walk documents in a Python loop (what a straightforward port would do)."""
    samples, doc, offset = [], 0, 0
    remaining = int(doc_lengths.sum()) - 1
    while remaining >= seq_length:
        samples.append((doc, offset))
        need = seq_length
        while need > 0:
            take = min(need, int(doc_lengths[doc]) - offset)
            need -= take
            offset += take
            if offset == doc_lengths[doc]:
                doc, offset = doc + 1, 0
        remaining -= seq_length
    return samples


def bench_index(args) -> None:
    target = int(float(args.index_tokens))
    print(f"\n== sample index for {target / 1e9:.2f}B tokens")
    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(6.0, 1.2, size=int(target / 500) + 1000).astype(np.int64), 1)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), target)) + 1]
    prefix = os.path.join(args.workdir, "synthetic_1b")
    write_index(prefix + ".idx", lengths, np.uint16, 257, 256)
    with open(prefix + ".bin", "wb") as f:  # sparse file of the right size: no token is written
        f.truncate(int(lengths.sum()) * 2)
    start = time.perf_counter()
    indexed = IndexedDataset(prefix)
    open_s = time.perf_counter() - start
    print(f"{len(indexed):,} documents, {indexed.num_tokens:,} tokens; open + validate .idx: {open_s:.3f} s")
    for seq_length in (2048, 512):
        start = time.perf_counter()
        index = build_sample_index(indexed.doc_lengths, seq_length, seed=1234)
        build_s = time.perf_counter() - start
        subset = indexed.doc_lengths[: len(indexed) // 100]
        start = time.perf_counter()
        naive_sample_index(subset, seq_length)
        naive_s = (time.perf_counter() - start) * indexed.num_tokens / max(int(subset.sum()), 1)
        print(f"seq {seq_length:5d}: {len(index):,} samples built in {build_s:.2f} s (vectorised); "
              f"Python-loop reference ~{naive_s:.1f} s (extrapolated from 1%) -> {naive_s / build_s:.0f}x")
    with tempfile.TemporaryDirectory(dir=args.workdir) as cache:
        lengths = indexed.doc_lengths
        start = time.perf_counter()
        cached_sample_index(lengths, 2048, 1234, 0, indexed.fingerprint(), cache)
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        cached_sample_index(lengths, 2048, 1234, 0, indexed.fingerprint(), cache)
        print(f"cached index (seq 2048): build + save {first_s:.2f} s, later load {time.perf_counter() - start:.3f} s")


def bench_reads(args, prefix: str) -> None:
    seq, mbs, gbs = 1024, 4, 32
    train, _, _ = build_gpt_datasets([prefix], "969,30,1", seq, 1234, "byte",
                                     cache_dir=os.path.join(args.workdir, "cache"))
    sampler = iter(GlobalBatchSampler(len(train), gbs, mbs, 0, 1))
    load_microbatches(train, next(sampler))
    steps, rounds = 20, []
    for _ in range(3):  # best of 3: the machine may be shared
        start = time.perf_counter()
        for _ in range(steps):
            load_microbatches(train, next(sampler))
        rounds.append((time.perf_counter() - start) / steps)
    per_step = min(rounds)
    print(f"\n== reading: {gbs} samples x {seq} tokens per step (dp=1, {gbs // mbs} microbatches): "
          f"{per_step * 1e3:.2f} ms/step (best of 3 x {steps} steps), {gbs * seq / per_step / 1e6:.1f} M tokens/s")


@reports_usage_errors
def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-mb", type=float, default=300)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)))
    parser.add_argument("--hf-mb", type=float, default=20, help="MB for the BPE run (0 skips it)")
    parser.add_argument("--index-tokens", default="1e9")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "megalite-bench-data"))
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"numpy {np.__version__}")
    corpus = os.path.join(args.workdir, f"corpus_{args.corpus_mb:g}mb.jsonl")
    start = time.perf_counter()
    generate_corpus(corpus, args.corpus_mb)
    print(f"corpus ready in {time.perf_counter() - start:.1f} s")
    baseline_s = min(read_parse_baseline(corpus) for _ in range(2))  # the 2nd pass has a warm page cache
    prefix = bench_preprocess(args, corpus, baseline_s)
    bench_index(args)
    bench_reads(args, prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
