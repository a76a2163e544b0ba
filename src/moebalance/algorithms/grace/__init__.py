"""GRACE-MoE ("Grouping and Replication with Locality-Aware Routing for Efficient Distributed MoE Inference"): affinity grouping of experts and skew-driven replication."""
