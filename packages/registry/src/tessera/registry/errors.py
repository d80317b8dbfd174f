"""The one exception type for invalid configuration, shared by every tessera package."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value is invalid.

    Raised for every violation found while reading a configuration: the message names the
    offending key (as a dotted path where nested) and shows the arithmetic or the accepted
    values, so the user can fix the config without reading tessera's source. It subclasses
    ``ValueError`` so callers that already catch ``ValueError`` keep working.
    """
