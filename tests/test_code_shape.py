"""The style guide's countable habits, checked on the source (docs/architecture/decisions.md):

- every import at module top (megalite/, tools/ and kernels/): an import inside a function or class names its reason in a comment on
  its own line (an optional package such as triton, a probe of the device in a torch-free module);
  type-hint-only imports sit under `if TYPE_CHECKING:` and are not counted;
- no function over 60 lines outside the Triton kernels (kernels/);
- no file over 400 lines in megalite/ and kernels/ (a longer one holds two ideas: split it by idea);
- the FP8 and pipeline-schedule choices compared as enums, never as their strings.

All read the files' syntax trees; nothing of what they check is imported.
"""
import ast
import io
import tokenize
from pathlib import Path

from megalite.config.choices import Fp8Format, Fp8Scales, Fp8ScalingRecipe, Schedule

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


def test_fp8_and_schedule_choices_are_compared_as_enums():
    """The FP8 vocabulary and the pipeline schedules are declared once (megalite/config/choices.py);
    the code compares members, so a misspelt choice fails on import instead of comparing false."""
    words = {str(c) for kind in (Fp8Format, Fp8ScalingRecipe, Fp8Scales, Schedule) for c in kind}
    found = [f"{path.relative_to(ROOT)}:{line}: {word!r}" for path in _sources("megalite")
             for line, word in _string_compares(ast.parse(path.read_text()), words)]
    assert not found, "compare with the enum member (megalite/config/choices.py):\n" + "\n".join(found)


def test_the_compare_scan_sees_a_string_choice():
    tree = ast.parse('if r == "rowwise" or s in ("1f1b", "x"):\n    pass\n')
    assert list(_string_compares(tree, {"rowwise", "1f1b"})) == [(1, "rowwise"), (1, "1f1b")]
