"""The one exception for a user's mistake.

`UsageError`: the configuration, a flag, a config file, the data or a checkpoint is not what
the run needs. Its message names each problem and what to change. Entry points print it
without a traceback and exit with code 2 (`megalite.training.loop.main`); every rank reaches
the same verdict before any collective, so nothing hangs.
"""


class UsageError(ValueError):
    """A user's mistake; the message says what to change (one line per problem)."""


class ConfigError(UsageError):
    """A configuration that cannot run: settings, layout, batch arithmetic, files it names."""
