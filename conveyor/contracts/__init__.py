"""What two components exchange, one torch-free module per document.

``load``: a replica's ``GET /load`` record (the runtime writes it, the gateway and the
autoscaler read it). ``engine_load``: that record from whatever engine a replica runs
(Conveyor's ``/load``, vLLM's and SGLang's ``/metrics``), for the same two readers. ``endpoint_slice``: which endpoints of a Kubernetes EndpointSlice may
take new requests (the gateway's discovery and the autoscaler). ``openai_error``: the OpenAI
error body (the runtime and the gateway). ``response_id``: a stored response's id, which names
the replica that holds it (the runtime writes it, the gateway routes by it).

Nothing here imports the runtime, the gateway or the operator, nor torch, FastAPI, aiohttp
or a Kubernetes client: every side can import it.
"""
