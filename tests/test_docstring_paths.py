"""Every file and module the docstrings of megalite/, kernels/ and tools/ name exists, as
tests/test_docs_paths.py keeps the docs' paths true.

A file is a word ending in .py, .md or .sh (`recipe.py`, `plan/timing.py`, `docs/fp8.md`): it must
exist beside the citing file or under one of its parent folders, or, named bare, somewhere in the
repository (`grouped.py` cited from plan/ is megalite/fp8/grouped.py). A module is a dotted name
under megalite, kernels or tools (`megalite.fp8.blockwise`, `megalite.plan.per_rank.Estimate`):
its longest prefix must be a module or package, and a name after it must be defined at that
module's top level (or exported by a package's lazy table). The few words that look like either
and are not are listed in NOT_OURS with what they are.
"""
import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|md|sh))\b")
MODULE = re.compile(r"(?<![\w.])((?:megalite|kernels|tools)(?:\.\w+)+)")
FOLDERS = ("megalite", "kernels", "tools")
SEARCHED = ("megalite", "kernels", "tools", "docs", "examples", "tests")
NOT_OURS = {
    "megalite.lock": "the lock file's name in a checkpoint directory (checkpoint/lock.py)",
    "agent/server/api.py": "torch.distributed.elastic's file (rendezvous.py)",
    "doc/PERFORMANCE.md": "nccl-tests' page (tools/bench_comm.py)",
    "examples/sc21/run_table_1.sh": "a script of Megatron-LM's repository (tools/bench_step_time.py)",
}


def sources(root: Path) -> list[Path]:
    """The .py files of megalite/, kernels/ and tools/ (megalite/kernels and megalite/tools are
    links a source-tree run makes to the top-level folders: read once, there)."""
    files = []
    for folder in FOLDERS:
        files += [p for p in sorted((root / folder).rglob("*.py"))
                  if folder != "megalite" or not {"kernels", "tools"} & set(p.relative_to(root).parts)]
    return files


def docstrings(path: Path):
    """The module's, its classes' and its functions' docstrings (statements only: no expression holds one)."""
    nodes = [ast.parse(path.read_text())]
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield text
        for field in ("body", "orelse", "finalbody", "handlers"):
            nodes += [child for child in getattr(node, field, ()) if isinstance(child, ast.AST)]


def _file_exists(root: Path, name: str, cited_in: Path) -> bool:
    folder = cited_in.parent
    while True:
        if (folder / name).exists():
            return True
        if folder == root:
            break
        folder = folder.parent
    return (root / "megalite" / name).exists() or Path(name).name in _file_names(root)


@functools.lru_cache(maxsize=4)
def _file_names(root: Path) -> frozenset[str]:
    """The name of every file in the repository's folders (a bare cite may live in any of them)."""
    return frozenset(p.name for d in SEARCHED for p in (root / d).rglob("*.*"))


@functools.lru_cache(maxsize=None)
def _top_level_names(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if module.name == "__init__.py":  # a package's lazy exports (megalite._lazy) are strings in a table
        names.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return names


def _module_exists(root: Path, dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[:1] == ["megalite"] and parts[1:2] in (["kernels"], ["tools"]):  # installed under megalite
        parts = parts[1:]
    folder, module, i = root, None, 0
    while i < len(parts):
        nxt = folder / parts[i]
        if nxt.with_suffix(".py").is_file():
            module, i = nxt.with_suffix(".py"), i + 1
            break
        if not nxt.is_dir():
            break
        folder, module, i = nxt, nxt / "__init__.py", i + 1
    if module is None:
        return False
    return i == len(parts) or (module.is_file() and parts[i] in _top_level_names(module))


def missing(root: Path = ROOT) -> list[tuple[str, str]]:
    found = []
    for path in sources(root):
        for text in docstrings(path):
            names = [n for n in FILE.findall(text) if not _file_exists(root, n, path)]
            names += [n for n in MODULE.findall(text) if not _module_exists(root, n)]
            found += [(str(path.relative_to(root)), n) for n in names if n not in NOT_OURS]
    return list(dict.fromkeys(found))


def test_every_file_and_module_a_docstring_names_exists():
    assert len(sources(ROOT)) > 200
    assert missing() == []


def test_the_checker_finds_a_stale_name(tmp_path):
    for folder in FOLDERS:
        (tmp_path / folder / "fp8").mkdir(parents=True)
    (tmp_path / "megalite" / "fp8" / "recipe.py").write_text("X = 1\n")
    (tmp_path / "megalite" / "fp8" / "__init__.py").write_text(
        '"""`recipe.py` and `convert.py`; megalite.fp8.recipe.X, megalite.fp8.recipe.Y, megalite.fp8.cast."""\n')
    assert missing(tmp_path) == [("megalite/fp8/__init__.py", "convert.py"),
                                 ("megalite/fp8/__init__.py", "megalite.fp8.recipe.Y"),
                                 ("megalite/fp8/__init__.py", "megalite.fp8.cast")]
