"""Every command in the shell blocks of the README and the docs in DOCS runs as written.

Commands are read from the documents themselves, so a command that fails cannot ship:
- `python examples/pretrain_gpt.py ...` runs as written on one process (a training command with
  `--train-iters 1 --eval-iters 1` appended, to stay cheap), `--print-config > FILE` writes FILE for
  the next one;
- `torchrun ... examples/pretrain_gpt.py ...` runs as a dry run on the world torchrun names
  (WORLD_SIZE = nodes x processes per node): the configuration and the layout are checked exactly
  as every rank would check them, without launching; `...` in a command stands for other flags;
- `python tools/plan.py ...` runs as written; `--suggest` (a search of every layout, ~20 s for 64
  GPUs) only parses and validates its flags: tests/tools/test_plan.py runs the search;
- `python tools/plot_metrics.py ...` and `tools/plot_schedule.py ...` run as written (in process);
- a command needing an optional extra that is not installed (NEEDS: TensorBoard, W&B, matplotlib) is
  skipped, not failed: its refusal is tested where the extra is (tests/test_packaging.py, tests/tools);
- the few that need what this test cannot make cheaply are named in NOT_RUN, each with the test
  that covers it.
The placeholder inputs the commands name (my_corpus, tokenizer.json) are made in a scratch directory,
and the absolute paths they invent (/shared/ckpt) are taken inside it.
"""
import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

from megalite.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/launching.md", "docs/megatron.md", "docs/observability.md")
NEEDS = {"--tensorboard-dir": "tensorboard", "--wandb-project": "wandb", "tools/plot_metrics.py": "matplotlib",
         "--plot": "matplotlib", "--out zb-h1.png": "matplotlib"}  # skipped (not failed) without the extra
TOOLS_IN_PROCESS = ("tools/plot_metrics.py", "tools/plot_schedule.py")  # cheap: run their main as written
NOT_RUN = {  # a command starting with or running this -> why, and where it is tested
    "pip install": "installs the package",
    "python -m pytest": "the test suite itself",
    "export ": "sets the environment only",
    "torchrun --nproc_per_node 4 examples/pretrain_gpt.py --tp 2 --pp 2 --dp 2": (
        "resumes the 8-rank checkpoint on 4 ranks; tests/checkpoint/test_elastic_resize.py"),
    "tools/bench_comm.py": "a two-node benchmark; tests/tools/test_bench_comm.py",
}


def doc_commands() -> list[tuple[str, str]]:
    """(document, command) for every command of every bash block, continuation lines joined."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S):
            for command in block.replace("\\\n", " ").splitlines():
                command = " ".join(shlex.split(command, comments=True))
                if command:
                    found.append((doc, command))
    return list(dict.fromkeys(found))


def _launch(words: list[str]) -> tuple[int, list[str]]:
    """(world size, the script and its arguments) of a `torchrun ... script args` command."""
    nodes, per_node, i = 1, 1, 1
    while words[i].startswith("-"):
        option = words[i].replace("_", "-")
        value = words[i + 1] if "=" not in option else option.split("=", 1)[1]
        if option.startswith("--nnodes"):
            nodes = int(value.split(":")[-1])  # MIN:MAX: the most it runs on
        elif option.startswith("--nproc-per-node"):
            per_node = int(value)
        i += 1 if option == "--standalone" or "=" in option else 2
    return nodes * per_node, words[i:]


def _pretrain(argv: list[str], world: int) -> tuple[int, str]:
    from megalite.training.loop import main

    if world > 1:
        os.environ["WORLD_SIZE"] = str(world)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        os.environ.pop("WORLD_SIZE", None)
    return code, out.getvalue()


def _train_one_process(argv: list[str]) -> int:
    from megalite.training.loop import main

    return main(argv + ["--train-iters", "1", "--log-interval", "1", "--eval-iters", "1"])


def _plan(argv: list[str]) -> tuple[int, str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    if "--suggest" in argv:
        cfg, args = tool.parse_args(argv, tool.planner_parser())
        return (2 if tool.planner_problems(cfg, args) + tool._model_problems(cfg) else 0), ""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = tool.main(argv)
    return code, out.getvalue()


def _tool(script: str, argv: list[str]) -> tuple[int, str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = tool.main(argv)
    return code, out.getvalue()


def _missing_extra(command: str) -> bool:
    import importlib.util

    return any(marker in command and importlib.util.find_spec(module) is None for marker, module in NEEDS.items())


def _placeholders(directory: Path) -> None:
    """my_corpus.{bin,idx} and tokenizer.json, as a user would have them."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    from megalite.data import preprocess_files

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat"] * 4, trainers.BpeTrainer(
        vocab_size=40, special_tokens=["[UNK]", "<|endoftext|>"], show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "corpus.txt").write_text("the cat sat on the mat\n" * 20)
    preprocess_files([str(directory / "corpus.txt")], str(directory / "my_corpus"), str(directory / "tokenizer.json"))


def _run(command: str) -> tuple[int, str]:
    """Run one documented command the cheap way the module docstring says; (exit code, output)."""
    words = [w.removeprefix("/") if w.startswith("/shared/") else w for w in shlex.split(command) if w != "..."]
    redirect = None
    if ">" in words:
        words, redirect = words[:words.index(">")], words[words.index(">") + 1]
    world, words = _launch(words) if words[0] == "torchrun" else (1, words[1:])
    script, argv = words[0], words[1:]
    if script == "tools/plan.py":
        code, out = _plan(argv)
    elif script in TOOLS_IN_PROCESS:
        code, out = _tool(script, argv)
    elif script != "examples/pretrain_gpt.py":
        raise AssertionError(f"no way to run {script} here: add it to test_docs_commands.py or NOT_RUN")
    elif world == 1 and not {"--dry-run", "--print-config"} & set(argv):
        code, out = run_distributed(_train_one_process, 1, argv, timeout_s=120)[0], ""
    else:
        code, out = _pretrain(argv + ([] if world == 1 else ["--dry-run"]), world)
    if redirect:
        Path(redirect).write_text(out)
    return code, out


def test_every_documented_command_runs(tmp_path, monkeypatch, capsys):
    commands = doc_commands()
    assert len(commands) >= 15  # the reader found the blocks
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    os.symlink(ROOT / "examples", tmp_path / "examples")
    os.symlink(ROOT / "tools", tmp_path / "tools")
    _placeholders(tmp_path)
    failed, ran = [], 0
    for doc, command in commands:
        if any(command.startswith(start) or f" {start}" in command for start in NOT_RUN) or _missing_extra(command):
            continue
        code, _ = _run(command)
        ran += 1
        if code != 0:
            failed.append((doc, command, code, capsys.readouterr().err[-500:]))
    assert failed == []
    assert ran >= 12
