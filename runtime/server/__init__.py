"""One runtime replica's HTTP server: the OpenAI-compatible API, /metrics, /load, probes.

``app.build_app`` builds the FastAPI app; ``cli.main`` is ``conveyor serve``;
``engine_client`` runs the engine on its own thread behind submit / stream / abort.
"""
