"""The style guide's two countable habits, checked on the source (docs/architecture/decisions.md):

- every import at module top: an import inside a function or class names its reason in a comment on
  its own line (an optional package such as triton, a probe of the device in a torch-free module);
  type-hint-only imports sit under `if TYPE_CHECKING:` and are not counted;
- no function over 60 lines outside the Triton kernels (kernels/).

Both read the files' syntax trees; nothing is imported.
"""
import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def _sources(*folders: str) -> list[Path]:
    files = []
    for folder in folders:
        files += [p for p in sorted((ROOT / folder).rglob("*.py")) if "kernels" not in p.relative_to(ROOT).parts]
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
    for path in _sources("megalite", "tools"):
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
