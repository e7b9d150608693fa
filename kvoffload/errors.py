"""The one error type for bad input: raised before long work starts, printed to the user without a traceback."""


class ConfigError(ValueError):
    pass
