"""The OpenAI-compatible API, driven by the official ``openai`` package (sync and async)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from conveyor.bench.procs import ChildProcess

MODEL = "conveyor-tiny"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
]


@pytest.fixture
def client(server: ChildProcess) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def aclient(server: ChildProcess) -> openai.AsyncOpenAI:
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="Hello, world",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion"
    assert len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completion_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="abc", temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 16


def test_greedy_is_deterministic_and_matches_stream(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        prompt="The quick brown fox",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == a.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_token_id_prompt_and_batch(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt=[[10, 20, 30, 40], [50, 60]],
        n=2,
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage is not None and r.usage.prompt_tokens == 6
    assert r.usage.completion_tokens == 12


def test_completion_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, echo=True)
    assert r.choices[0].text.startswith("Echo me")


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert lp is not None
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    )
    assert all(x <= 0 for x in lp.token_logprobs)
    # A dict keyed by token text: distinct byte tokens may share a text ("\ufffd").
    assert all(1 <= len(t) <= 4 for t in lp.top_logprobs)


def test_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 5


def test_chat_max_completion_tokens_and_n(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=3,
        n=3,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage is not None and r.usage.completion_tokens == 9


def test_chat_seed_reproducible(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for tok in content:
        assert tok.logprob <= 0
        assert len(tok.top_logprobs) == 2
        assert tok.bytes is not None


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_continuous_usage_stats_and_null_include_usage(client: openai.OpenAI) -> None:
    """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far (it was
    ignored); ``include_usage: null`` means its default, as a null field does (it was a 400)."""
    stream = client.completions.create(
        model=MODEL,
        prompt="Count",
        max_tokens=5,
        n=2,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 10
    assert {c.usage.prompt_tokens for c in chunks if c.usage is not None} == {
        chunks[-1].usage.prompt_tokens
    }
    assert chunks[-1].choices == []

    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": None},
    )
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)


def test_stop_string(client: openai.OpenAI) -> None:
    base = client.completions.create(
        model=MODEL,
        prompt="Stop test",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].text
    stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"greedy output has no usable stop string: {text!r}")
    cut = text[: text.index(stop)]
    r = client.completions.create(
        model=MODEL,
        prompt="Stop test",
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == cut
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Stop test",
            max_tokens=24,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_async_chat_and_completions_concurrently(aclient: openai.AsyncOpenAI) -> None:
    async def chat(i: int) -> str:
        r = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=4 + i % 3,
            extra_body={"ignore_eos": True},
        )
        assert r.usage is not None and r.usage.completion_tokens == 4 + i % 3
        return r.choices[0].finish_reason

    async def stream(i: int) -> int:
        n = 0
        s = await aclient.completions.create(
            model=MODEL,
            prompt=f"stream {i}",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in s:
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        return n

    results = await asyncio.gather(*(chat(i) for i in range(8)), *(stream(i) for i in range(8)))
    assert results[:8] == ["length"] * 8
    assert results[8:] == [5] * 8


def test_health_ready_load_metrics(server: ChildProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
        load = http.get("/load").json()
        for key, kind in [
            ("running", int),
            ("waiting", int),
            ("kv_cache_usage", float),
            ("max_running_requests", int),
            ("ready", bool),
        ]:
            assert isinstance(load[key], kind), key
        assert "max_queued_requests" in load and load["max_queued_requests"] is None
        assert load["max_running_requests"] == 32
        http.post(
            "/v1/completions", json={"prompt": "metrics", "max_tokens": 3, "ignore_eos": True}
        )
        text = http.get("/metrics").text
    from conveyor.runtime import metrics_names as names

    for name in (
        names.TIME_TO_FIRST_TOKEN,
        names.TIME_PER_OUTPUT_TOKEN,
        names.INTER_TOKEN_LATENCY,
        names.E2E_REQUEST_LATENCY,
        names.REQUEST_QUEUE_TIME,
    ):
        assert f"{name}_bucket{{" in text, name
    for name in (
        names.NUM_REQUESTS_RUNNING,
        names.NUM_REQUESTS_WAITING,
        names.KV_CACHE_USAGE,
        names.PREFIX_CACHE_QUERIES,
        names.PREFIX_CACHE_HITS,
        names.PROMPT_TOKENS,
        names.GENERATION_TOKENS,
        names.NUM_PREEMPTIONS,
    ):
        assert f'{name}{{model="{MODEL}"}}' in text, name
    assert f'{names.REQUEST_SUCCESS}{{finish_reason="length",model="{MODEL}"}}' in text


def test_api_responses_say_the_replica_load_in_a_header(server: ChildProcess) -> None:
    from conveyor.contracts.load import LOAD_HEADER, ReplicaLoad

    body = {"prompt": "load", "max_tokens": 3, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        plain = http.post("/v1/completions", json=body)
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
            # the head goes out as the request is queued: it counts itself
            during = ReplicaLoad.from_header(streamed.headers[LOAD_HEADER])
            streamed.read()
        assert LOAD_HEADER not in http.get("/load").headers
    after = ReplicaLoad.from_header(plain.headers[LOAD_HEADER])
    assert after.ready and after.max_running_requests == 32 and after.model is None
    assert during.running + during.waiting >= 1


def test_chat_stream_n_choices(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 12


def test_serve_help_lists_the_flags() -> None:
    from conveyor.runtime.server.cli import build_parser

    text = build_parser().format_help()
    for flag in (
        "--host",
        "--port",
        "--model",
        "--served-model-name",
        "--max-running-requests",
        "--chunked-prefill-size",
        "--mem-fraction-static",
        "--max-model-len",
        "--block-size",
        "--dtype",
        "--scheduler",
        "--max-queued-requests",
        "--api-key",
        "--load-format",
        "--drain-timeout",
        "--context-length",
        "--page-size",
    ):
        assert flag in text, flag


def test_settings_from_sglang_spellings() -> None:
    from conveyor.runtime.server.cli import build_parser
    from conveyor.runtime.server.settings import ServerSettings

    args = build_parser().parse_args(
        [
            "--model-path",
            "m",
            "--context-length",
            "2048",
            "--page-size",
            "32",
            "--max-queued-requests",
            "5",
            "--served-model-name",
            "x",
        ]
    )
    s = ServerSettings.from_cli_args(args)
    assert (s.engine.model, s.engine.max_model_len, s.engine.block_size) == ("m", 2048, 32)
    assert (s.max_queued_requests, s.model_name, s.port) == (5, "x", 8000)
