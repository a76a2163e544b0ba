"""The data model: a cluster, loads and token-level traces, placement plans, budgets, errors and atomic file
writing. Everything else in the package is built on these types; they import nothing from the rest but the model descriptions
(:mod:`moebalance.models`, the floor below: a load names its model)."""
