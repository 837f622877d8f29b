"""The gateway in front of real runtime replicas (``conveyor serve``, built-in model) on loopback.

Driven by the official ``openai`` client: streaming passthrough, model routing, auth, a
replica killed under load and brought back, replicas joining and leaving.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from collections.abc import Iterator

import httpx
import openai
import pytest
from gateway_helpers import PYTHON, Process, Processes, gateway
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.bench.procs import free_port
from conveyor.bench.wait import wait_until
from conveyor.gateway.app import PROXIED_PATHS

MODEL = "conveyor-tiny"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None
    or importlib.util.find_spec("conveyor.runtime.server.cli") is None,
    reason="needs the runtime server (`conveyor serve`) and torch",
)


def runtime(port: int | None = None, *extra: str) -> Process:
    port = port or free_port()
    argv = [PYTHON, "-m", "conveyor.cli", "serve", "--model", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--num-threads", "1", "--max-total-tokens", "8192", *extra]  # fmt: skip
    return Process(f"runtime-{port}", argv, port)


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[Processes, list[Process]]]:
    owner = Processes()
    try:
        started = [owner.start(runtime()) for _ in range(3)]
        for replica in started:
            replica.wait_http("/ready", timeout=180)
        yield owner, started
    finally:
        owner.stop_all()
        for p in owner.all:
            p.log_path.unlink(missing_ok=True)


def admitted(gw: Process, model: str, key: str | None = None) -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        pool = httpx.get(gw.url + "/debug/pools", headers=headers, timeout=5).json().get(model)
    except httpx.HTTPError:
        return -1
    return -1 if pool is None else sum(r["admitted"] for r in pool["replicas"])


def start_gateway(processes: Processes, *args: str) -> Process:
    gw = processes.start(gateway(*args))
    gw.wait_http("/health")
    return gw


async def test_streaming_passes_through_chunk_by_chunk(replicas, processes: Processes) -> None:
    _, (replica, *_) = replicas
    gw = start_gateway(processes, "--backend", replica.url)
    wait_until(lambda: admitted(gw, MODEL) == 1, 30, "the replica to be admitted")
    messages = [{"role": "user", "content": "Tell me a story about a conveyor belt."}]

    async def deltas(base_url: str) -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused") as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, stream=True, max_tokens=24, temperature=0.0
            )
            return [c.choices[0].delta.content async for c in stream if c.choices]

    direct = await deltas(replica.url)
    through = await deltas(gw.url)
    assert through == direct  # same chunks, one for one, as the replica sent them
    assert len(through) > 2

    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused") as client:
        out = await client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
        assert out.usage is not None and out.usage.completion_tokens == 5
        with pytest.raises(openai.NotFoundError) as err:
            await client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
        assert MODEL in str(err.value)
        assert [m.id for m in (await client.models.list()).data] == [MODEL]
    # the replica's own card, with its max_model_len and root, as vLLM's router passes it on
    card = httpx.get(gw.url + "/v1/models", timeout=10).json()["data"][0]
    assert card == httpx.get(replica.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] > 0 and card["root"]


async def test_api_keys_on_the_gateway_and_on_the_replicas(processes: Processes) -> None:
    replica = processes.start(runtime(None, "--api-key", "replica-key"))
    replica.wait_http("/ready", timeout=180)
    gw = start_gateway(
        processes,
        "--backend",
        replica.url,
        "--api-key",
        "user-key",
        "--backend-api-key",
        "replica-key",
    )
    wait_until(lambda: admitted(gw, MODEL, "user-key") == 1, 30, "the replica to be admitted")
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="replica-key") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="user-key") as client:
        out = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert out.choices[0].finish_reason in ("length", "stop")
        # the card comes from the replica, asked with the replica's key
        (card,) = (await client.models.list()).data
    own = httpx.get(
        replica.url + "/v1/models", headers={"authorization": "Bearer replica-key"}, timeout=10
    ).json()["data"][0]
    assert card.id == MODEL and getattr(card, "max_model_len", None) == own["max_model_len"]
    assert "user-key" not in gw.logs() and "replica-key" not in gw.logs()


async def test_a_killed_replica_loses_no_request_that_had_not_started_streaming(
    replicas, processes: Processes
) -> None:
    owner, started = replicas
    gw = start_gateway(
        processes, *[a for r in started for a in ("--backend", r.url)], "--routing", "least-load"
    )
    wait_until(lambda: admitted(gw, MODEL) == 3, 30, "three admitted replicas")
    victim = started[0]
    on_victim = asyncio.Event()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, bool, BaseException | None]:
        received = 0
        try:
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt=f"request {i}: " + "words " * 30, stream=True, max_tokens=48,
                temperature=0.0,
            )  # fmt: skip
            if raw.headers.get("x-conveyor-backend") == victim.url:
                on_victim.set()
            async for _chunk in raw.parse():
                received += 1
            return received, True, None
        except openai.APIError as exc:
            return received, False, exc

    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        first = [asyncio.create_task(one(client, i)) for i in range(12)]
        async with asyncio.timeout(60):
            await on_victim.wait()
        victim.kill()
        second = [asyncio.create_task(one(client, 100 + i)) for i in range(12)]
        results = await asyncio.gather(*first, *second)

    for received, ok, error in results:
        assert ok or received > 0, f"request lost before it started streaming: {error!r}"
    assert all(ok for _, ok, _ in results[12:]), [e for _, _, e in results[12:]]

    # The replica comes back on the same address and is admitted again by its next /load poll.
    revived = owner.start(runtime(victim.port))
    started[0] = revived
    revived.wait_http("/ready", timeout=180)
    wait_until(lambda: admitted(gw, MODEL) == 3, 30, "the restarted replica to be re-admitted")


async def test_replicas_join_and_leave(replicas, processes: Processes, tmp_path) -> None:
    _, started = replicas
    a, b = started[1], started[2]
    backends = tmp_path / "backends"

    def write(*urls: str) -> None:
        staged = tmp_path / "staged"
        staged.write_text("".join(f"{u}\n" for u in urls))
        os.replace(staged, backends)

    def served_by(n: int) -> set[str]:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        return {
            httpx.post(gw.url + "/v1/completions", json=body, timeout=30).headers[
                "x-conveyor-backend"
            ]
            for _ in range(n)
        }

    write(a.url)
    gw = start_gateway(processes, "--backends-file", str(backends), "--routing", "round-robin")
    wait_until(lambda: admitted(gw, MODEL) == 1, 30, "one replica")
    assert served_by(3) == {a.url}
    write(a.url, b.url)
    wait_until(lambda: admitted(gw, MODEL) == 2, 30, "the second replica to join")
    assert served_by(4) == {a.url, b.url}
    write(b.url)
    wait_until(lambda: admitted(gw, MODEL) == 1, 30, "the first replica to leave")
    assert served_by(4) == {b.url}


async def test_structured_outputs_tools_and_tokenize_pass_through(
    replicas, processes: Processes
) -> None:
    """The gateway forwards the bodies unchanged: greedy answers are the replica's own."""
    _, (replica, *_) = replicas
    gw = start_gateway(processes, "--backend", replica.url)
    wait_until(lambda: admitted(gw, MODEL) == 1, 30, "the replica to be admitted")
    messages = [{"role": "user", "content": "Pick a colour."}]
    schema = {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["colour", "n"],
        "additionalProperties": False,
    }
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}

    async def answers(base_url: str) -> list[object]:
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused") as client:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                temperature=0,
                max_tokens=150,
                stream=True,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": schema, "strict": True},
                },
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            called = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                temperature=0,
                max_tokens=150,
                tools=[weather],
                tool_choice="required",
                parallel_tool_calls=False,
                logit_bias={"48": 5},
            )
            calls = called.choices[0].message.tool_calls or []
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            r = await http.post("/tokenize", json={"model": MODEL, "messages": messages})
            tokens = r.json()["tokens"]
            r = await http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
        return [text, [(c.function.name, c.function.arguments) for c in calls], tokens, r.json()]

    direct = await answers(replica.url)
    through = await answers(gw.url)
    assert through == direct
    text, calls, _, _ = through
    assert json.loads(text)["colour"] in ("red", "green")  # type: ignore[arg-type]
    assert calls and calls[0][0] == "get_weather"  # type: ignore[index]


def test_no_body_gets_a_5xx_through_the_gateway(replicas, processes: Processes) -> None:
    """Random bodies on every proxied path, through the gateway to a real replica: a 4xx
    with a message, never a 5xx, and both serve on."""
    _, (replica, *_) = replicas
    gw = start_gateway(processes, "--backend", replica.url)
    wait_until(lambda: admitted(gw, MODEL) == 1, 30, "the replica to be admitted")
    text = st.text(max_size=8) | st.sampled_from([MODEL, "\ud800", "", "other-model"])
    leaf = st.none() | st.booleans() | st.integers(-3, 10**12) | st.floats(allow_nan=False) | text
    value = st.recursive(
        leaf,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
        max_leaves=6,
    )
    fields = st.sampled_from(["prompt", "messages", "stream", "tools", "tokens", "logit_bias"])
    body = st.dictionaries(fields | text, value, max_size=5)
    raw = (
        body.map(lambda b: json.dumps(b).encode())
        # To the model, with bounded work: these reach the replica's own checks.
        | body.map(lambda b: json.dumps({**b, "model": MODEL, "max_tokens": 2}).encode())
        | value.map(lambda v: json.dumps(v).encode())
        | st.binary(max_size=40)
    )
    with httpx.Client(base_url=gw.url, timeout=60) as http:

        @given(path=st.sampled_from(PROXIED_PATHS), content=raw)
        @settings(
            max_examples=120,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def no_5xx(path: str, content: bytes) -> None:
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code < 500, (path, content, r.text)
            if r.status_code >= 400:
                assert r.json()["error"]["message"]

        no_5xx()
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
    assert httpx.get(replica.url + "/health", timeout=5).status_code == 200


async def test_a_conversation_of_stored_responses_stays_on_the_replica_that_stores_it(
    replicas, processes: Processes
) -> None:
    """Round robin would send each turn elsewhere: ``previous_response_id`` pins it to the
    replica that stored the previous turn, streamed or not; ``GET`` and ``DELETE`` of a stored
    response reach it there."""
    _, started = replicas
    backends = [arg for r in started for arg in ("--backend", r.url)]
    gw = start_gateway(processes, "--routing", "round-robin", *backends)
    wait_until(lambda: admitted(gw, MODEL) == len(started), 30, "the replicas to be admitted")
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused") as client:
        first = await client.responses.with_raw_response.create(
            model=MODEL, input="Hello", max_output_tokens=4
        )
        home = first.headers["x-conveyor-backend"]
        previous = first.parse().id
        for turn in range(4):
            stream = turn % 2 == 1
            raw = await client.responses.with_raw_response.create(
                model=MODEL, input=f"turn {turn}", previous_response_id=previous,
                max_output_tokens=4, stream=stream,
            )  # fmt: skip
            assert raw.headers["x-conveyor-backend"] == home
            if stream:
                events = [event async for event in raw.parse()]
                assert events[-1].type == "response.completed"
                previous = events[-1].response.id
            else:
                previous = raw.parse().id
        stored = await client.responses.retrieve(previous)
        assert stored.previous_response_id is not None and stored.status == "incomplete"
        items = await client.responses.input_items.list(previous)
        assert [item.content[0].text for item in items.data] == ["turn 3"]
        await client.responses.delete(previous)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(previous)
        with pytest.raises(openai.NotFoundError):  # a well-formed id no replica here made
            await client.responses.retrieve("resp_" + "0" * 40)


async def test_a_replicas_lora_adapters_are_routed_by_their_names(
    processes: Processes, tmp_path
) -> None:
    """``--backend URL``: the gateway learns the adapters from the replica's /v1/models, and
    a request naming one reaches the replica that serves it."""
    from conveyor.bench.engine.lora_adapters import write_adapter
    from conveyor.runtime.model.builtin import builtin_model_path

    write_adapter(tmp_path / "sql", builtin_model_path(), seed=1, std=0.3)
    plain = processes.start(runtime())
    tuned = processes.start(runtime(None, "--lora-modules", f"sql={tmp_path / 'sql'}"))
    for replica in (plain, tuned):
        replica.wait_http("/ready", timeout=180)
    gw = start_gateway(processes, "--backend", plain.url, "--backend", tuned.url)
    wait_until(lambda: admitted(gw, "sql") == 1 and admitted(gw, MODEL) == 2, 60, "both pools")
    async with (
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as client,
        openai.AsyncOpenAI(base_url=tuned.url + "/v1", api_key="unused", max_retries=0) as direct,
    ):
        cards = {m.id: m for m in (await client.models.list()).data}
        assert set(cards) == {MODEL, "sql"} and cards["sql"].model_dump()["parent"] == MODEL
        ask = dict(prompt="Hello", max_tokens=12, temperature=0)
        for _ in range(4):  # whichever replica the base model's pool picks, sql is the tuned one
            through = await client.completions.create(model="sql", **ask)
            assert through.model == "sql"
        assert (
            through.choices[0].text
            == (await direct.completions.create(model="sql", **ask)).choices[0].text
        )
        base = await client.completions.create(model=MODEL, **ask)
        assert base.choices[0].text != through.choices[0].text
