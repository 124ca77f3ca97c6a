"""Every flag an advice line or a dry-run verdict names is a flag the run's parser takes, with that value.

Advice that names a flag which does not exist (it said `--schedule interleaved`; the flag is
`--pipeline-schedule`) sends a user to an error. The texts are generated, the flags parsed.
"""
import re

import pytest

from megalite.cli import build_parser
from megalite.config import RunConfig
from megalite.config.model import preset
from megalite.training import advice

FLAG = re.compile(r"(--[a-z][a-z0-9-]*)(?:[ =]([^\s;,():]+))?")


PLANNER = re.compile(r"`tools/plan.py ([^`]*)`")


def planner_parser():
    """tools/plan.py's parser (the planner's flags on top of the run's)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.planner_parser()


def named_flags(text: str, parser=None) -> list[list[str]]:
    """[flag] or [flag, value] for every --flag in `text` given as it would be typed; a
    `tools/plan.py ...` command quoted in the text is checked against the planner's parser instead."""
    parser = parser or build_parser()
    actions = parser._option_string_actions
    out = []
    for command in PLANNER.findall(text):
        for words in named_flags(command, planner_parser()):
            planner_parser().parse_args(words)
    for flag, value in FLAG.findall(PLANNER.sub("", text)):
        assert flag in actions, f"{flag} is not a flag of {parser.prog} (in: {text})"
        if actions[flag].nargs == 0:
            out.append([flag])
        elif value:  # a flag named without a value ("raise --tp/--pp") is only checked to exist
            out.append([flag, value])
    return out


def advice_texts() -> list[str]:
    from megalite.training.dry_run import memory_advice, verdict

    model = preset("llama-7b").replace(seq_length=8192)
    big = RunConfig.build(tp=2, pp=2, dp=2, micro_batch_size=4, global_batch_size=64, precision="bf16")
    return [advice.bubble_advice(0.3, 4), advice.exposed_dp_advice(0.3),
            memory_advice(model, big), verdict(model, big, 80e9, "an 80 GB GPU", "H100-SXM"),
            verdict(model, big.replace(zero=1, recompute="full", sequence_parallel=True), 80e9, "an 80 GB GPU",
                    "H100-SXM"),
            verdict(preset("llama-70b"), RunConfig.build(global_batch_size=8, precision="bf16"), 80e9, "an 80 GB GPU",
                    "H100-SXM")]


def test_a_layout_that_cannot_fit_points_at_the_planner():
    text = advice_texts()[-1]
    assert "does NOT fit" in text and "`tools/plan.py --suggest`" in text
    named_flags(text)


@pytest.mark.parametrize("index", range(6))
def test_every_flag_named_parses(index):
    text = advice_texts()[index]
    flags = named_flags(text)
    for words in flags:
        build_parser().parse_args(words)  # a flag or value the parser refuses exits with 2


def test_the_bubble_advice_names_the_schedule_flag():
    assert ["--pipeline-schedule", "interleaved"] in named_flags(advice.bubble_advice(0.3, 4))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--schedule", "interleaved"])


def test_a_dry_run_ends_with_its_verdict(capsys):
    from megalite.training.loop import main

    assert main(["--dry-run", "--model", "gpt2-124m", "--tp", "2", "--dp", "4", "--global-batch-size", "64"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("verdict: fits (") and " s/step on " in last and "; change: " in last
    named_flags(last)
