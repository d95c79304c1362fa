"""User-facing errors.

Anything a user can fix (a config value, a data file, a checkpoint, a launch argument) raises a subclass of
``LongspanError`` with a one-line message naming the field or file, the value, and what would be valid. The
CLI prints such errors as one line on stderr and exits with code 2; every other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations


class LongspanError(Exception):
    """An error caused by user input; printed as one line, exit code 2."""

    exit_code = 2


class ConfigError(LongspanError, ValueError):
    """A configuration value is unknown, of the wrong type, out of range, or inconsistent with another."""


class NotSupportedError(ConfigError):
    """A configuration field is set to a value this version of longspan does not implement yet."""


class DataError(LongspanError):
    """A data file or dataset parameter is missing, damaged or inconsistent."""


class CheckpointError(LongspanError):
    """A checkpoint is missing, damaged, or does not fit the model."""


class LaunchError(LongspanError):
    """A launch argument or the process layout does not fit the configuration."""
