"""Test-suite settings shared by every directory under tests/.

The quick tier (`python -m pytest -q -m "not slow" tests`) is the inner loop and must stay
under three minutes on a 2-core machine; a test that needs more than a few seconds of CPU
(many-rank worlds, long training runs, wheel installs) is marked `@pytest.mark.slow` and runs
only in the full suite, which CI runs.

A test (or a whole file) that `pytest.importorskip`s an optional package skips when its pip extra
is not installed; the summary then names the extras and what they left untested, and with CI=true
the run fails (CI installs every extra: a skip there is a check that silently stopped running).
"""
import os

from megalite.extras import extras_behind_skips

_skips: list[tuple[str, str]] = []  # (test or file, skip reason) of every skipped test and module


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: takes more than a few seconds; left out of the quick tier (-m 'not slow')")


def _note_skip(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, reason)
        _skips.append((report.nodeid or report.longrepr[0], str(report.longrepr[2])))


def pytest_collectreport(report):  # a module-level importorskip skips the whole file at collection
    _note_skip(report)


def pytest_runtest_logreport(report):
    _note_skip(report)


def _missing_extras() -> dict[str, set[str]]:
    return extras_behind_skips([reason for _, reason in _skips])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    missing = _missing_extras()
    for extra, modules in sorted(missing.items()):
        skipped = [where for where, reason in _skips if any(f"'{m}'" in reason for m in modules)]
        install = f"pip install 'megalite[{extra}]'" if extra else "install them"
        terminalreporter.write_line(
            f"missing extra [{extra or 'none'}] ({', '.join(sorted(modules))}): {len(skipped)} tests or files skipped "
            f"({', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''}); {install}", yellow=True)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI", "").lower() == "true" and _missing_extras() and exitstatus == 0:
        session.exitstatus = 1  # CI installs every extra (setup.py's extras_require): a skip is a lost check
