"""Every repository path the README and the docs name exists, and every page they link to.

A path is a word starting with one of the repository's top-level directories (`megalite/plan/timing.py`,
`tools/plan.py`, `docs/architecture/pipeline.md`), or a relative markdown link from a doc
(`[pipeline](architecture/pipeline.md)`). `kernels/attention_dispatch.MEASURED_MS` names a module's
attribute: the module must exist. The few words that look like paths and are not are listed in
NOT_PATHS with what they are.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("megalite", "tools", "tests", "examples", "docs", "kernels")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(TOP))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
NOT_PATHS = {
    "megalite/forward": "a profiler range name (docs/launching.md)",
    "megalite/backward": "a profiler range name",
    "megalite/pipeline": "a profiler range name (also a real directory)",
    "megalite/optimizer": "a profiler range name",
    "megalite/data": "a profiler range name (also a real directory)",
    "examples/sc21/run_table_1.sh": "a script of Megatron-LM's repository, not this one",
    "examples/gpt3": "a directory of Megatron-LM's repository (docs/megatron.md)",
    "megalite/kernels": "the link a source-tree run makes to kernels/ (docs/gpu.md); absent in a clone",
}


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _exists(name: str) -> bool:
    if (ROOT / name).exists():
        return True
    module, _, attribute = name.rpartition(".")  # kernels/attention_dispatch.MEASURED_MS
    return bool(attribute) and attribute[0].isupper() and (ROOT / f"{module}.py").is_file()


def missing_paths() -> list[tuple[str, str]]:
    missing = []
    for doc in documents():
        text = doc.read_text()
        for name in PATH.findall(text):
            name = name.rstrip(".")
            if name not in NOT_PATHS and not _exists(name):
                missing.append((str(doc.relative_to(ROOT)), name))
        for link in LINK.findall(text):
            if "://" not in link and not link.startswith("mailto:") and not (doc.parent / link).exists():
                missing.append((str(doc.relative_to(ROOT)), link))
    return list(dict.fromkeys(missing))


def test_every_named_path_exists():
    assert len(documents()) >= 5  # README, launching, benchmarks, the architecture index and its pages
    assert missing_paths() == []


def test_the_architecture_index_links_every_part_and_each_part_is_short():
    index = (ROOT / "docs" / "architecture.md").read_text()
    pages = sorted((ROOT / "docs" / "architecture").glob("*.md"))
    assert len(pages) >= 10
    for page in pages:
        assert f"(architecture/{page.name})" in index, page.name
        assert len(page.read_text().splitlines()) <= 300, page.name
    assert len(index.splitlines()) <= 120


def test_the_checker_finds_a_missing_path(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("see `megalite/training/estimate.py` and [x](docs/nowhere.md)")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert missing_paths() == [("README.md", "megalite/training/estimate.py"), ("README.md", "docs/nowhere.md")]
