"""The package says what it needs and installs as it says.

- setup.py's extras are the ones megalite/extras.py names in its refusals, `[dev]` holds them all;
- a flag whose optional package is missing stops with one line naming the extra (exit 2);
- a test skipped for a missing extra is named in the summary, and fails the run under CI=true
  (tests/conftest.py);
- (slow) the wheel, built from this tree and installed into a fresh venv, trains two steps with the
  `megalite-train` console script, and the other console scripts answer --help; the venv sees the
  site-packages of the interpreter running the tests (torch), whether that is a venv, a conda env or a
  system install, and the install takes no dependencies, so no network is needed.
"""
import ast
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from megalite import extras

ROOT = Path(__file__).resolve().parents[1]


def _setup_keywords() -> dict:
    """setup()'s keywords and the module-level EXTRAS, read from setup.py without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            found.update({k.arg: k.value for k in node.keywords})
    namespace: dict = {}
    for node in tree.body:  # EXTRAS = {...}; EXTRAS["dev"] = ...
        if isinstance(node, ast.Assign) and "EXTRAS" in ast.unparse(node.targets[0]):
            exec(compile(ast.Module([node], []), "setup.py", "exec"), namespace)
    return {"python_requires": ast.literal_eval(found["python_requires"]), "extras": namespace["EXTRAS"],
            "install_requires": ast.literal_eval(found["install_requires"])}


def test_setup_declares_every_extra_the_refusals_name():
    declared = _setup_keywords()
    assert declared["python_requires"] == ">=3.11"  # tomllib, enum.StrEnum
    assert not any(r.startswith("einops") for r in declared["install_requires"])  # imported nowhere
    for module, (extra, package) in extras.EXTRAS.items():
        assert package in declared["extras"][extra], (module, extra)
        assert package in declared["extras"]["dev"], package
    assert "pytest" in declared["extras"]["dev"]


def test_einops_is_imported_nowhere():
    for path in [*ROOT.glob("megalite/**/*.py"), *ROOT.glob("kernels/*.py"), *ROOT.glob("tools/*.py")]:
        assert "import einops" not in path.read_text() and "from einops" not in path.read_text(), path


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(extras.MissingExtraError) as caught:
        extras.require("wandb", "--wandb-project")
    message = str(caught.value)
    assert "\n" not in message and "--wandb-project" in message and "megalite[wandb]" in message
    assert not extras.available("wandb")


def test_skips_for_a_missing_package_name_its_extra():
    reasons = ["could not import 'transformers': No module named 'transformers'",
               "could not import 'matplotlib.pyplot': No module named 'matplotlib'",
               "could not import 'tokenizers': ...", "could not import 'einops': ...", "needs a GPU"]
    assert extras.extras_behind_skips(reasons) == {"hf": {"transformers", "tokenizers"}, "plot": {"matplotlib.pyplot"},
                                                   "": {"einops"}}


@pytest.mark.slow
def test_a_test_file_skipped_for_a_missing_extra_is_reported_and_fails_ci(tmp_path):
    """transformers hidden (a package that raises ModuleNotFoundError, first on the path): the file
    that importorskips it at module level, and the test that does so inside, are named with the [hf]
    extra; with CI=true the run fails."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("raise ModuleNotFoundError('hidden by the test')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/checkpoint/test_convert.py",
               "tests/test_progress.py"]
    for ci, code in (("", 0), ("true", 1)):
        run = subprocess.run(command, cwd=ROOT, env={**env, "CI": ci}, capture_output=True, text=True, timeout=300)
        assert run.returncode == code, run.stdout + run.stderr
        assert ("missing extra [hf] (transformers): 2 tests or files skipped (tests/checkpoint/test_convert.py, "
                "tests/test_progress.py::test_conversion_reads_with_a_bar_on_a_terminal)") in run.stdout, run.stdout


def test_train_refuses_a_sink_without_its_package(monkeypatch, tmp_path, capsys):
    from megalite.training.loop import main

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    code = main(["--train-iters", "1", "--tensorboard-dir", str(tmp_path / "tb")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "megalite[tensorboard]" in err[0], err
    assert not (tmp_path / "tb").exists()


@pytest.mark.filterwarnings("ignore:'megalite.training.loop' found in sys.modules")  # runpy, loop imported already
def test_python_dash_m_the_loop_is_the_training_entry_point(monkeypatch, capsys):
    """`python -m megalite.training.loop` runs main (it used to exit 0 having done nothing); run in process
    as runpy runs it (the wheel test runs the same main as megalite-train in a fresh interpreter)."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["megalite.training.loop", "--train-iters", "0"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("megalite.training.loop", run_name="__main__")
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and "--train-iters" in err[0], err


def test_wandb_settings_need_a_project():
    from megalite.config import RunConfig
    from megalite.training.metrics_sinks import sink_problems

    assert sink_problems(RunConfig.build(wandb_exp_name="run-1").logging) == [
        "--wandb-exp-name names a W&B run but no project: add --wandb-project NAME"]
    assert sink_problems(RunConfig().logging) == []


def _copy_sources(to: Path) -> None:
    """What the wheel is built from (setup.py and the three source trees), away from the checkout so
    the build leaves nothing in it."""
    for name in ("setup.py", "LICENSE", "README.md"):
        shutil.copy(ROOT / name, to / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "kernels")  # megalite/kernels: a link to kernels/
    shutil.copytree(ROOT / "megalite", to / "megalite", ignore=ignore)
    for name in ("kernels", "tools"):
        shutil.copytree(ROOT / name, to / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _builds_wheels_here() -> bool:
    """Whether this interpreter's setuptools builds a wheel by itself (bdist_wheel is built into setuptools
    70.1 and later; before, the `wheel` package adds it). A venv made by `python -m venv` on Python 3.11
    carries setuptools 65 without `wheel`: there the build runs isolated, setuptools from pip's index."""
    spec = importlib.util.find_spec("setuptools")
    if spec is None:
        return False
    version = next(importlib.metadata.distributions(name="setuptools", path=[str(Path(spec.origin).parents[1])]))
    major, minor = (int(part) for part in version.version.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def _outer_site_dirs() -> list[str]:
    """The site directories this interpreter imports from, in order: its own venv's, the ones a
    --system-site-packages venv reaches through its base (the venv chain), a conda env's, the user's."""
    return [p for p in dict.fromkeys(sys.path)
            if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def _see_this_interpreters_packages(python: Path) -> None:
    """Make the venv of `python` import what this interpreter imports (torch, numpy, triton), after its own
    site-packages: venv's system_site_packages would reach the *base* interpreter's, which has no torch
    when this one is itself a venv. A .pth of `site.addsitedir` lines also runs those directories' .pth files."""
    inner = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    lines = [f"import site; site.addsitedir({path!r})" for path in _outer_site_dirs() if path != inner]
    (Path(inner) / "_megalite_test_outer_site.pth").write_text("\n".join(lines) + "\n")


def test_the_inner_venv_sees_this_interpreters_torch(tmp_path):
    """The README's test command in a venv (or conda env, or a system install): the wheel's venv imports
    the torch this interpreter imports, and the wheel's own files before any other megalite."""
    venv.EnvBuilder(with_pip=False).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    _see_this_interpreters_packages(python)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    seen = subprocess.run([str(python), "-c", "import importlib.util, sys; print(importlib.util.find_spec('torch')"
                           ".origin); print(sys.path)"], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)  # found, not imported: the slow wheel test imports it
    torch_file = importlib.util.find_spec("torch").origin
    assert seen.returncode == 0 and seen.stdout.splitlines()[0] == torch_file, seen.stderr[-1000:]
    inner = str(tmp_path / "venv")
    paths = eval(seen.stdout.splitlines()[1])  # noqa: S307 - our own child's repr of sys.path
    first_outer = min(i for i, p in enumerate(paths) if p in _outer_site_dirs())
    assert any(p.startswith(inner) and p.endswith("site-packages") for p in paths[:first_outer]), paths


@pytest.mark.slow
def test_wheel_installs_and_trains_in_a_fresh_venv(tmp_path):
    source, env_dir, work = tmp_path / "src", tmp_path / "venv", tmp_path / "work"
    source.mkdir(), work.mkdir()
    _copy_sources(source)
    isolation = ["--no-build-isolation"] if _builds_wheels_here() else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", *isolation,
                    "-q", "-w", str(tmp_path / "dist")], check=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("megalite-*.whl"))
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python, bin_dir = env_dir / "bin" / "python", env_dir / "bin"
    _see_this_interpreters_packages(python)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--ignore-installed", "-q", str(wheel)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    where = subprocess.run([str(python), "-c", "import megalite, megalite.kernels, megalite.tools.plan; "
                            "print(megalite.__file__)"], cwd=work, env=env, capture_output=True, text=True)
    assert where.returncode == 0 and where.stdout.startswith(str(env_dir)), (where.stdout, where.stderr)
    run = subprocess.run([str(bin_dir / "megalite-train"), "--train-iters", "2", "--log-interval", "1",
                          "--eval-iters", "1"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "step 2/2" in run.stdout
    assert "a GPU profile's estimate, not this machine's" in run.stdout  # the CPU banner names whose figure
    dash_m = subprocess.run([str(python), "-m", "megalite.training.loop", "--train-iters", "0"], cwd=work, env=env,
                            capture_output=True, text=True, timeout=300)
    assert dash_m.returncode == 2 and "--train-iters" in dash_m.stderr, dash_m.stderr[-500:]
    for script in ("megalite-plan", "megalite-convert", "megalite-preprocess", "megalite-generate"):
        helped = subprocess.run([str(bin_dir / script), "--help"], cwd=work, env=env, capture_output=True,
                                text=True, timeout=120)
        assert helped.returncode == 0 and "usage" in helped.stdout, (script, helped.stderr[-500:])


def test_convert_without_transformers_is_one_line(monkeypatch, capsys, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert tool.main(["import", "--hf", str(tmp_path), "--output", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "megalite[hf]" in err[0], err
