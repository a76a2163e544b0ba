"""Paper algorithms, arrays in and arrays out: DeepSeek EPLB, CRAFT, GRACE-MoE's grouping and replication,
MoETuner's integer programs, greedy packing and a small MILP driver. Policies (:mod:`moebalance.policies`)
adapt them to loads, clusters and budgets."""
