"""The gateway: routing policies side by side, and its own overhead against a stub replica."""
