"""Training: the ELBO loop shared by every gradient-trained family."""

from bayesify.train.loop import FitResult, fit
from bayesify.train.schedules import beta_schedule, lr_factor

__all__ = ["FitResult", "beta_schedule", "fit", "lr_factor"]
