"""An HTTP load generator for a replica or a gateway, and the scheduling modes over HTTP."""
