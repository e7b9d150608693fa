"""Token counts as the command line spells them (4096, 32k, 128k, 1m): one parser for the runner, the preflight and
the plots, which read the seqlen back from a record's overrides."""

from __future__ import annotations

import re

from kvoffload.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_tokens(value: int | str, what: str = "seqlen") -> int:
    """4096, '4096', '4k', '128K', '1m' -> tokens (k = 1024, m = 1024**2)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(f"{what}={value!r}: expected a token count such as 4096, 32k, 128k or 1m")
        n = int(float(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()])
    if n < 1:
        raise ConfigError(f"{what}={value!r} must be at least 1 token")
    return n


def tokens_text(n: int) -> str:
    """The short spelling of a token count, parse_tokens' inverse: 4096 -> '4k', 1048576 -> '1m', 7680 -> '7680'."""
    for unit, size in (("m", 1024**2), ("k", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
