"""The engine in process: scheduling modes side by side, structured outputs."""
