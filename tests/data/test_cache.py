"""Cache entries: built once when many processes ask at once; a lost rename race is harmless."""
import multiprocessing as mp
import os
import time

from megalite.data.cache import build_once, cache_root


def _build_entry(entry, log, queue):
    def build(tmp_dir):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.2)  # long enough that the other processes arrive while this one builds
        with open(os.path.join(tmp_dir, "data"), "w") as f:
            f.write("payload")

    queue.put(build_once(entry, build))


def test_concurrent_builders_build_once(tmp_path):
    entry, log = str(tmp_path / "entry"), str(tmp_path / "log")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_entry, args=(entry, log, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=30) for _ in procs]
    for p in procs:
        p.join()
    assert results == [entry] * 4
    assert len(open(log).read().split()) == 1  # the lock made the other three wait, not rebuild
    assert open(os.path.join(entry, "data")).read() == "payload"
    assert [e for e in os.listdir(tmp_path) if e.startswith(".tmp")] == []


def test_losing_the_rename_race_keeps_the_winner(tmp_path):
    entry = str(tmp_path / "entry")

    def build_while_someone_else_finishes(tmp_dir):
        os.makedirs(entry)  # a builder that could not lock (e.g. NFS) renamed its copy first
        with open(os.path.join(entry, "data"), "w") as f:
            f.write("winner")
        with open(os.path.join(tmp_dir, "data"), "w") as f:
            f.write("loser")

    assert build_once(entry, build_while_someone_else_finishes) == entry
    assert open(os.path.join(entry, "data")).read() == "winner"
    assert [e for e in os.listdir(tmp_path) if e.startswith(".tmp")] == []


def test_cache_root_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path / "env"))
    assert cache_root() == str(tmp_path / "env") and os.path.isdir(tmp_path / "env")
    assert cache_root(str(tmp_path / "explicit")) == str(tmp_path / "explicit")
    monkeypatch.delenv("MEGALITE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == str(tmp_path / "home" / ".cache" / "megalite")
