"""Cluster-scale goodput simulator: NTP and its alternatives under GPU failures."""
