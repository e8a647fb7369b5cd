"""Embedded digits data (no download), ImageFolder helpers, and a real ImageNet network
offline (EfficientNet-Lite0 from its wheel, :mod:`bayesify.data.pretrained`)."""

from bayesify.data.digits import DigitsSplits, digits_loaders, load_digits_splits
from bayesify.data.pretrained import load_efficientnet_lite0, sample_photo_folder

__all__ = ["DigitsSplits", "digits_loaders", "load_digits_splits", "load_efficientnet_lite0",
           "sample_photo_folder"]
