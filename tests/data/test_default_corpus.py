"""The stdlib default corpus: deterministic, same preprocessing path, safe to build from many ranks."""
import multiprocessing as mp
import os
import sysconfig

from megalite.data import ByteTokenizer, IndexedDataset, build_default_corpus, stdlib_documents

SMALL = 150_000  # bytes: enough documents to exercise the path, quick to tokenize


def _build(cache_dir, queue):
    queue.put(build_default_corpus(ByteTokenizer(), cache_dir=cache_dir, max_bytes=SMALL))


def test_stdlib_corpus_documents_and_concurrent_build(tmp_path):
    docs = stdlib_documents(SMALL)
    names = [name for name, _ in docs]
    assert names == sorted(names) and len(names) > 3
    assert not any("site-packages" in n or n.startswith("/") for n in names)
    assert sum(len(text.encode()) for _, text in docs) <= SMALL
    with open(os.path.join(sysconfig.get_paths()["stdlib"], names[0]), encoding="utf-8") as f:
        assert f.read() == docs[0][1]

    # 4 processes build the same entry at once: one wins the rename, all get the same prefix
    ctx, queue = mp.get_context("fork"), mp.get_context("fork").Queue()
    procs = [ctx.Process(target=_build, args=(str(tmp_path), queue)) for _ in range(4)]
    for p in procs:
        p.start()
    prefixes = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert len(set(prefixes)) == 1
    assert [e for e in os.listdir(tmp_path) if e.startswith(".tmp")] == []

    tokenizer, ds = ByteTokenizer(), IndexedDataset(prefixes[0])
    assert [tokenizer.decode(ds[i][:-1]) for i in range(len(ds))] == [text for _, text in docs]
    assert build_default_corpus(tokenizer, cache_dir=str(tmp_path), max_bytes=SMALL) == prefixes[0]  # cached
