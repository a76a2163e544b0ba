"""Workloads: synthetic routing traces of real models, the traces bundled with the package, and load
statistics (skew, drift, locality, co-activation)."""
