"""User-facing errors: raised before any work starts, printed without a traceback by the entry points."""


class ConfigError(ValueError):
    """A bad value in the configuration or the environment. The message names the value,
    what was expected, and the override that fixes it."""


class StoreError(ConfigError):
    """The MLflow store (or the experiment) cannot take runs: every job that logs there would be
    refused alike, so a sweep stops at the first instead of failing each of its jobs."""
