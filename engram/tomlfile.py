"""Reading a TOML file a user names (the config, auth.tenants_file): every way it can fail to be one is a
ConfigError naming it, which the CLI reports in one line with exit 4.

tomllib alone read a file to its end, however long (`-c /dev/zero` grew without bound until killed), and raised
RecursionError, not TOMLDecodeError, for arrays or inline tables nested some thousands deep (a traceback, exit 1).
A file is read as at most MAX_TOML_BYTES + 1 bytes, so a pipe (`-c <(...)`) is still read to its end, and
whatever holds more is refused unparsed.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from engram.errors import ConfigError

MAX_TOML_BYTES = 16 * 2**20  # a config is a few KiB; a tenants file of 100,000 tenants fits


def read_toml(path: str | Path, subject: str) -> dict[str, Any]:
    """The TOML document at `path`; `subject` names it in the errors ("config file PATH")."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_TOML_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{subject} does not exist") from None
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"{subject} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_TOML_BYTES:
        raise ConfigError(f"{subject} holds more than {MAX_TOML_BYTES // 2**20} MiB, read no further: no "
                          "configuration is that long (an endless file such as /dev/zero?); give the TOML file")
    try:
        return tomllib.loads(data.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{subject} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{subject} is not valid TOML: its arrays or inline tables nest too deeply") from None
