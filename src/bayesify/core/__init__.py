"""Core: batch convention, walker, injected-layer base, BayesianModel, posterior state,
Method base, registry, factory and the types the epoch driver calls (``fitting``).

Core imports nothing above it (the family kit, families, predict, persistence, train);
see CONTRIBUTING.md for the floors.
"""
