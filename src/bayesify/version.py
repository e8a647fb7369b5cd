"""The package version (a floor-1 module: persistence and the CLI read it)."""

__version__ = "0.1.0"
