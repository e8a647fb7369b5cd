"""Adapters to other training stacks (imported on demand; each needs its own library).

- :mod:`bayesify.integrations.hf`: ``BayesTrainer``, a ``transformers.Trainer`` for
  bayesified models.
"""
