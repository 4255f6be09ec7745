"""User-facing errors: raised before any work starts, printed without a traceback by the entry points."""


class ConfigError(ValueError):
    """A bad value in the configuration or the environment. The message names the value,
    what was expected, and the override that fixes it."""
