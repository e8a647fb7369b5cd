"""Posterior families, one package each (config, layers, method)."""
