"""A step load against the autoscaler on the one-machine cluster."""
