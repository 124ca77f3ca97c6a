"""Test-suite settings shared by every directory under tests/.

The quick tier (`python -m pytest -q -m "not slow" tests`) is the inner loop and must stay
under three minutes on a 2-core machine; a test that needs more than a few seconds of CPU
(many-rank worlds, long training runs, wheel installs) is marked `@pytest.mark.slow` and runs
only in the full suite, which CI runs.
"""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: takes more than a few seconds; left out of the quick tier (-m 'not slow')")
