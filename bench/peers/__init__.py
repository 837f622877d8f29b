"""Conveyor against its peers (vLLM for CPU), each installed into its own cached environment."""
