"""Embedded digits data (no download) and ImageFolder helpers."""

from bayesify.data.digits import DigitsSplits, digits_loaders, load_digits_splits

__all__ = ["DigitsSplits", "digits_loaders", "load_digits_splits"]
