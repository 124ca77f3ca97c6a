"""The style guide's countable habits, checked on the source (docs/architecture/decisions.md):

- every import at module top (megalite/, tools/ and kernels/): an import inside a function or class names its reason in a comment on
  its own line (an optional package such as triton, a probe of the device in a torch-free module);
  type-hint-only imports sit under `if TYPE_CHECKING:` and are not counted;
- no function over 60 lines outside the Triton kernels (kernels/);
- no file over 400 lines in megalite/ and kernels/ (a longer one holds two ideas: split it by idea);
- no import circle between megalite's modules, type-only imports (`if TYPE_CHECKING:`) included;
- the settings' choices (config/choices.py) compared as enums, never as their strings.

All read the files' syntax trees; nothing of what they check is imported.
"""
import ast
import io
import tokenize
from pathlib import Path

from megalite.config.choices import (CPCommType, ElasticBatch, Fp8Format, Fp8Scales, Fp8ScalingRecipe, GradCompression,
                                     LRDecay, MoEDispatcher, MoEDropPolicy, MoELoadBalancing, MoEScoreFunction,
                                     OnNonFinite, OptimizerKind, Precision, Recompute, Schedule)

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400


def _sources(*folders: str, kernels: bool = False) -> list[Path]:
    """The .py files under `folders`; megalite/kernels is a link to kernels/, so it is skipped there
    (kernels/ is named as a folder of its own where a check covers it)."""
    files = []
    for folder in folders:
        files += [p for p in sorted((ROOT / folder).rglob("*.py"))
                  if kernels or "kernels" not in p.relative_to(ROOT).parts]
    assert files, folders
    return files


def _commented_lines(source: str) -> set[int]:
    return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT}


def _inner_imports(tree: ast.AST, inside: bool = False):
    """Import nodes below a def or class, skipping `if TYPE_CHECKING:` blocks."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)) and inside:
            yield child
        nested = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        yield from _inner_imports(child, nested)


def test_imports_inside_functions_name_their_reason():
    unexplained = []
    for path in _sources("megalite", "tools") + _sources("kernels", kernels=True):
        source = path.read_text()
        commented = _commented_lines(source)
        for node in _inner_imports(ast.parse(source)):
            if node.lineno not in commented:
                unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not unexplained, ("move these imports to the module top, or say on the line why they wait "
                             "(an optional package, a real cycle, a torch-free module):\n" + "\n".join(unexplained))


def test_the_scan_sees_an_unexplained_inner_import():
    tree = ast.parse("import os\nif TYPE_CHECKING:\n    import x\ndef f():\n    import json\n    return json\n")
    assert [node.lineno for node in _inner_imports(tree)] == [5]


def test_no_function_is_over_60_lines_outside_the_kernels():
    long = []
    for path in _sources("megalite", "tools", "examples"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} has {lines} lines")
    assert not long, f"split these functions (at most {MAX_FUNCTION_LINES} lines):\n" + "\n".join(long)


def test_no_file_is_over_400_lines_in_the_package():
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path in _sources("megalite") + _sources("kernels", kernels=True)
            if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"split these files by idea (at most {MAX_FILE_LINES} lines):\n" + "\n".join(long)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(sources: dict[str, str], packages: set[str]) -> dict[str, set[str]]:
    """module -> the modules of `sources` it imports, every import statement counted (inside functions
    and `if TYPE_CHECKING:` too); `packages`: the modules that are packages (an __init__.py).
    `from pkg import name` is an edge to pkg.name when that is a module, else to pkg (its __init__)."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, source in sources.items():
        package = name if name in packages else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in sources}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level - 1` floors up
                    floors = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(floors + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    graph[name] |= {target} if target in sources else ({base} if base in sources else set())
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            child = next((e for e in edges if e in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_circle_type_only_imports_included():
    """A circle, even through `if TYPE_CHECKING:`, is a room on two floors: the lower one names the upper
    one's type (give it a Protocol, or the parts it reads) instead."""
    files = _sources("megalite")
    sources = {_module_name(path, ROOT): path.read_text() for path in files}
    packages = {_module_name(path, ROOT) for path in files if path.name == "__init__.py"}
    circles = _circles(_import_graph(sources, packages))
    assert not circles, "break these import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_scan_sees_a_type_only_circle():
    sources = {"pkg": "from pkg.b import f\n",
               "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import Thing\n",
               "pkg.c": "from . import b\n"}
    graph = _import_graph(sources, {"pkg"})
    assert graph == {"pkg": {"pkg.b"}, "pkg.b": {"pkg"}, "pkg.c": {"pkg.b"}}
    assert _circles(graph) == [["pkg", "pkg.b"]]


def _string_compares(tree: ast.AST, words: set[str]):
    """(line, word) of each `==`, `!=`, `in` or `not in` whose operand is a string literal in `words`
    (or a tuple of them)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                literals = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                for lit in literals:
                    if isinstance(lit, ast.Constant) and lit.value in words:
                        yield node.lineno, lit.value


CHOICES = (Fp8Format, Fp8ScalingRecipe, Fp8Scales, Schedule, Recompute, CPCommType, MoEDispatcher, MoEScoreFunction,
           GradCompression, MoELoadBalancing, MoEDropPolicy, OptimizerKind, OnNonFinite, LRDecay, ElasticBatch, Precision)
# Words that also name something else: "none" (a loss reduction, a run id), "adamw" (a kernel's measured rate).
SHARED_WORDS = {"none", "adamw"}
# megalite/config/moe.py validates MoEConfig's own fields against its string tuples (a user's MoEConfig may
# hold plain strings): its score-function tuples and two compares stay strings.
BELOW_THE_CHOICES = {"megalite/config/moe.py"}


def test_setting_choices_are_compared_as_enums():
    """Each setting's choices are declared once (megalite/config/choices.py); the code compares members,
    so a misspelt choice fails on import (AttributeError) instead of comparing false."""
    words = {str(c) for kind in CHOICES for c in kind} - SHARED_WORDS
    found = [f"{path.relative_to(ROOT)}:{line}: {word!r}" for path in _sources("megalite")
             if str(path.relative_to(ROOT)) not in BELOW_THE_CHOICES
             for line, word in _string_compares(ast.parse(path.read_text()), words)]
    assert not found, "compare with the enum member (megalite/config/choices.py):\n" + "\n".join(found)


def test_the_compare_scan_sees_a_string_choice():
    tree = ast.parse('if r == "rowwise" or s in ("1f1b", "x"):\n    pass\n')
    assert list(_string_compares(tree, {"rowwise", "1f1b"})) == [(1, "rowwise"), (1, "1f1b")]
