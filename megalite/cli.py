"""The command line and config files of a run, generated from RunConfig's declarations.

    cfg, actions = parse_args(argv)          # flags (Megatron-LM's names) over an optional --config file
    print(to_toml(cfg))                      # what --print-config prints; loadable with --config

Precedence: each setting's declared default, then `--config FILE`, then the flags given on the
command line. A config file is TOML (or JSON when it ends in .json); its keys are the flag
names without the dashes (`hidden-size = 64` or `hidden_size = 64`), flat or grouped in tables
named after the parts (`[parallel]`, `[optimizer]`, ...); a flag's synonym is a key too
(`expert-model-parallel-size = 2` sets ep). An unknown key, a key in the wrong
table or a value of the wrong type is an error that names it. Besides the settings, three
actions exist only on the command line: --config, --print-config, --dry-run.
"""
from __future__ import annotations

import argparse
import difflib
import enum
import json
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

from megalite.config import megatron
from megalite.config import PARTS, RunConfig, Setting, coerce, settings
from megalite.errors import USAGE_EXIT_CODE, ConfigError, UsageError
from megalite.data.tokenizer import TokenizerKind, parse_tokenizer_spec
from megalite.paths import output_file_problem

ACTIONS = ("config", "print_config", "dry_run", "simulate", "simulate_ranks", "simulate_json")  # flags that are not settings


class ConfigFileError(UsageError, ValueError):
    """A config file that cannot be read or holds a key/value no setting takes."""


def _add_setting(group, spec: Setting) -> None:
    kind, kwargs = spec.type, {"dest": spec.name, "help": spec.help, "default": argparse.SUPPRESS}
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    if kind is bool:
        if spec.flag.startswith("--no-"):  # BooleanOptionalAction would read --no-load-optim as False
            group.add_argument(spec.flag, *spec.synonyms, action="store_const", const=True, **kwargs)
            group.add_argument("--" + spec.flag[len("--no-"):], dest=spec.name, action="store_const", const=False,
                               default=argparse.SUPPRESS, help=f"undo {spec.flag} (e.g. from a config file)")
            return
        group.add_argument(spec.flag, *spec.synonyms, action=argparse.BooleanOptionalAction, **kwargs)
        return
    if typing.get_origin(kind) is tuple:
        args = typing.get_args(kind)
        kwargs["nargs"] = "+" if args[-1] is Ellipsis else len(args)
        kind = args[0]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        kwargs["choices"] = [c.value for c in kind] + list(getattr(kind, "synonyms", tuple)())
        kind = str
    elif spec.choices is not None:
        kwargs["choices"] = list(spec.choices)
    kwargs["help"] += f" (default: {_shown(spec.default)})" if spec.default is not None else ""
    if spec.aliases:
        exclusive = group.add_mutually_exclusive_group()
        exclusive.add_argument(spec.flag, *spec.synonyms, type=kind, **kwargs)
        for flag, value in spec.aliases.items():
            exclusive.add_argument(flag, dest=spec.name, action="store_const", const=_shown(value),
                                   default=argparse.SUPPRESS, help=f"same as {spec.flag} {_shown(value)}")
        return
    group.add_argument(spec.flag, *spec.synonyms, type=kind, **kwargs)


def _shown(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake on the command line is one line naming the flag (not the usage of
    every setting), exit code 2, and no abbreviations: a prefix (`--loss-scale` for
    `--loss-scale-window`) is an unknown flag, never silently another one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(USAGE_EXIT_CODE, f"megalite: {self.prog}: {message} (see --help)\n")


def build_parser(description: str = "Train a GPT with tensor x pipeline x data parallelism.") -> argparse.ArgumentParser:
    """The parser of every declared setting (one argument group per part) and the three actions."""
    parser = OneLineParser(description=description)
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML (or .json) file of settings; flags on the command line override it")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration (and what is derived from it) as TOML, and exit")
    parser.add_argument("--dry-run", action="store_true", help="validate, print the plan, and exit")
    parser.add_argument("--simulate", action="store_true",
                        help="set up and run one step of the layout's ranks in this process on a fake process group "
                             "with data-less tensors; report each rank beside the planner (docs/simulate.md)")
    parser.add_argument("--simulate-ranks", metavar="all|representatives|R,R,...", default=None,
                        help="which ranks --simulate runs (default representatives: one of each role; every rank's "
                             "groups are checked)")
    parser.add_argument("--simulate-json", metavar="FILE", default=None, help="write --simulate's report as JSON")
    groups = {part: parser.add_argument_group(cls.__doc__.strip().splitlines()[0]) for part, cls in PARTS.items()}
    for spec in settings().values():
        _add_setting(groups[spec.part], spec)
    megatron.add_megatron_flags(parser)  # Megatron flags that are not settings (config/megatron.py)
    return parser


def _canonical(key: str) -> str:
    return key.replace("-", "_")


def _synonym_setting(key: str) -> str | None:
    """A config key that is a flag synonym (`expert_model_parallel_size = 2`) -> the setting's name."""
    for spec in settings().values():
        if any(_canonical(flag.lstrip("-")) == key for flag in spec.synonyms):
            return spec.name
    return None


def _alias_setting(key: str) -> tuple[str, Any] | None:
    """A config key that is a flag alias (`bf16 = true`) -> (setting, value)."""
    for spec in settings().values():
        for flag, value in spec.aliases.items():
            if _canonical(flag.lstrip("-")) == key:
                return spec.name, value
    return None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """{setting name: value} from a TOML or JSON file; ConfigFileError naming any bad key or value."""
    path = Path(path)
    try:
        text = path.read_text()
        raw = json.loads(text, object_pairs_hook=_no_repeated_keys) if path.suffix == ".json" else tomllib.loads(text)
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigFileError(f"--config {path}: not a text file (a TOML or .json config is UTF-8 text)") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigFileError(f"--config {path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'} ({exc})") \
            from None
    except ValueError as exc:  # a key repeated in one JSON object
        raise ConfigFileError(f"--config {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigFileError(f"--config {path}: the top level must be an object of settings "
                              f"({{\"hidden-size\": 64, ...}}), not a {type(raw).__name__}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if _canonical(key) in PARTS and isinstance(value, dict):
            for inner, inner_value in value.items():
                _take(values, path, inner, inner_value, part=_canonical(key))
        else:
            _take(values, path, key, value, part=None)
    return values


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names no key twice (json.loads would keep the last silently)."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"key {repeated[0]!r} appears twice; keep one")
    return dict(pairs)


def _take(values: dict[str, Any], path: Path, key: str, value: Any, part: str | None) -> None:
    name, specs = _canonical(key), settings()
    alias = _alias_setting(name)
    if alias is not None and value is True:
        name, value = alias
    name = _synonym_setting(name) or name
    if name not in specs:
        close = difflib.get_close_matches(name, list(specs), n=1)
        hint = f"; did you mean {close[0].replace('_', '-')!r}?" if close else ""
        raise ConfigFileError(f"--config {path}: unknown key {key!r}{hint} (keys are the flag names without the "
                              f"dashes; `--help` lists them)")
    if part is not None and specs[name].part != part:
        raise ConfigFileError(f"--config {path}: {key!r} is a [{specs[name].part}] setting, not [{part}]")
    if name in values:  # hidden_size and hidden-size, or bf16 = true and precision = ...: which one is meant?
        raise ConfigFileError(f"--config {path}: {specs[name].flag.lstrip('-')} is set twice ({key!r} and "
                              f"another spelling or alias of it); keep one")
    try:
        values[name] = coerce(specs[name], value)
    except ValueError as exc:
        raise ConfigFileError(f"--config {path}: {exc}") from None


def parse_args(argv: list[str] | None = None,
               parser: argparse.ArgumentParser | None = None) -> tuple[RunConfig, dict[str, Any]]:
    """(the configuration, {every other flag: value}) from the command line; argparse exits (2) on a
    bad flag, ConfigFileError on a bad config file, ConfigError on a value outside its setting's
    declared bounds. `parser`: build_parser() with a tool's own
    flags added (tools/plan.py)."""
    parser = parser or build_parser()
    lacking = megatron.lacks_problem(sys.argv[1:] if argv is None else argv, set(parser._option_string_actions))
    if lacking:  # a Megatron flag for a feature megalite lacks: named as such, not "unrecognized"
        parser.error(lacking)
    args = vars(parser.parse_args(argv))
    megatron_only = {name: args.pop(name) for name in megatron.non_setting_dests() if name in args}
    others = {name: args.pop(name) for name in list(args) if name not in settings()}
    _check_simulate_flags(others)
    values = read_config_file(others["config"]) if others.get("config") else {}
    values.update(args)  # only the settings actually given (their argparse default is SUPPRESS)
    cfg = RunConfig.build(**values)
    cfg = _virtual_stages_from_layers(cfg, megatron_only.get("num_layers_per_virtual_pipeline_stage"))
    if megatron_only.get("profile"):  # Megatron's --profile: steps START .. END-1 (its defaults 10 and 12)
        start = megatron_only.get("profile_step_start") or 10
        cfg = cfg.replace(profile_steps=(start, max(start, (megatron_only.get("profile_step_end") or 12) - 1)))
    if megatron_only.get("recompute_method") == "uniform":  # every block recomputed (N only sized the groups)
        cfg = cfg.replace(recompute_num_layers=None)
    try:  # --tokenizer-type/--vocab-file/--merge-file: Megatron's tokenizer as a tokenizer.json
        tokenizer = megatron.tokenizer_from_megatron(
            megatron_only.get("tokenizer_type"), megatron_only.get("vocab_file"), megatron_only.get("merge_file"),
            cfg.data.tokenizer, vocab_size=cfg.model.vocab_size,
            tiktoken_pattern=megatron_only.get("tiktoken_pattern") or "v2",
            tiktoken_num_special_tokens=megatron_only.get("tiktoken_num_special_tokens") or 1000)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if tokenizer is not None and parse_tokenizer_spec(tokenizer)[0] is TokenizerKind.NULL:  # --vocab-size: its ids
        cfg = cfg.replace(tokenizer=tokenizer, vocab_size=None)
    elif tokenizer is not None:
        cfg = cfg.replace(tokenizer=tokenizer)
    problems = cfg.bound_problems()  # on every rank, before anything divides by a degree or allocates
    if problems:
        raise ConfigError.listing(problems)
    return cfg, others


def _check_simulate_flags(others: dict[str, Any]) -> None:
    """--simulate-ranks and --simulate-json only mean something with --simulate (ignored, they hid a mistake);
    the JSON's path is checked before the simulation runs. Fills --simulate-ranks' default."""
    given = [flag for flag, name in (("--simulate-ranks", "simulate_ranks"), ("--simulate-json", "simulate_json"))
             if others.get(name) is not None]
    if given and not others.get("simulate"):
        raise ConfigError(f"{' and '.join(given)}: only used by --simulate; add --simulate, or drop "
                          f"{' and '.join(given)}")
    if others.get("simulate_json") is not None:
        problem = output_file_problem("--simulate-json", others["simulate_json"])
        if problem:
            raise ConfigError(problem)
    if "simulate_ranks" in others and others["simulate_ranks"] is None:
        others["simulate_ranks"] = "representatives"


def _virtual_stages_from_layers(cfg: RunConfig, layers_per_stage: int | None) -> RunConfig:
    """Megatron's --num-layers-per-virtual-pipeline-stage N as megalite's --virtual-stages."""
    if layers_per_stage is None:
        return cfg
    try:
        stages = megatron.virtual_stages_from(layers_per_stage, cfg.gpt_config().num_layers, cfg.parallel.pp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.parallel.virtual_stages not in (1, stages):
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {layers_per_stage} means {stages} virtual "
                          f"stages, not --virtual-stages {cfg.parallel.virtual_stages}: give one of the two")
    return cfg.replace(virtual_stages=stages)


def given_settings(argv: list[str] | None = None) -> frozenset[str]:
    """The settings `argv` sets, on the command line or in its --config file (the rest are defaults):
    what an elastic resume may take from the checkpoint instead (megalite.checkpoint.elastic)."""
    args = vars(build_parser().parse_args(argv))
    names = {name for name in args if name in settings()}
    if args.get("config"):
        names |= set(read_config_file(args["config"]))
    return frozenset(names)


def to_toml(cfg: RunConfig, derived: dict[str, Any] | None = None) -> str:
    """The configuration as a TOML file `--config` reads back; unset optional settings appear as
    comments, and `derived` (what the run computes from the settings) as a commented table."""
    lines = ["# megalite run configuration (read back with --config FILE)"]
    for part, values in cfg.to_dict().items():
        lines.append(f"\n[{part.replace('_', '-')}]")
        for name, value in values.items():
            key = name.replace("_", "-")
            lines.append(f"# {key} = (unset)" if value is None else f"{key} = {json.dumps(_shown(value))}")
    if derived:
        lines.append("\n# derived from the settings above (not settings themselves):")
        lines += [f"#   {key} = {json.dumps(value)}" for key, value in derived.items()]
    return "\n".join(lines) + "\n"
