"""Data builders and developer tools (layout figures, the same-numbers check, the reference harness's sweeps).
Each script runs as a module from the repository's root: python -m tools.layout"""
