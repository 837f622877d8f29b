"""LoRA adapters through the OpenAI API, as vLLM serves them: ``--lora-modules``, the
adapter's name as ``model``, ``GET /v1/models`` listing adapters with their parent, and
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` at run time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from lora_files import write_adapter
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.procs import ChildProcess
from conveyor.runtime.model.builtin import builtin_model_path

BASE = "conveyor-tiny"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(("sql", "chat", "later")):
        write_adapter(root / name, builtin_model_path(), seed=seed, std=0.3)
    return root


@pytest.fixture(scope="module")
def server(start_server: Callable[..., ChildProcess], adapters: Path) -> ChildProcess:
    return start_server(
        "--lora-modules", f"sql={adapters / 'sql'}",
        f'{{"name": "chat", "path": "{adapters / "chat"}"}}',
        "--max-cpu-loras", "3", "--allow-runtime-lora-updating",
    )  # fmt: skip


@pytest.fixture
def client(server: ChildProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _text(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(model=model, prompt="Hello there", max_tokens=16, temperature=0)
    assert r.model == model
    return r.choices[0].text


def test_models_list_the_adapters_with_their_parent(client: openai.OpenAI, adapters: Path) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {BASE, "sql", "chat"}
    assert cards["sql"]["parent"] == BASE and cards["sql"]["root"] == str(adapters / "sql")
    assert cards["chat"]["max_model_len"] == cards[BASE]["max_model_len"]
    assert cards[BASE]["parent"] is None


def test_a_request_naming_an_adapter_runs_with_it(client: openai.OpenAI) -> None:
    base, sql, chat = (_text(client, m) for m in (BASE, "sql", "chat"))
    assert len({base, sql, chat}) == 3
    assert _text(client, "sql") == sql  # greedy, with its blocks from the prefix cache
    stream = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert {c.model for c in stream} == {"sql"}
    with pytest.raises(openai.NotFoundError) as err:
        _text(client, "nope")
    assert err.value.body["param"] == "model" and "'sql'" in err.value.body["message"]


def test_adapters_load_and_unload_at_run_time(
    client: openai.OpenAI, server: ChildProcess, adapters: Path
) -> None:
    def post(path: str, **body: object) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)

    r = post("load_lora_adapter", lora_name="later", lora_path=str(adapters / "later"))
    assert r.status_code == 200 and "added" in r.text
    later = _text(client, "later")
    assert later != _text(client, BASE)
    again = post("load_lora_adapter", lora_name="later", lora_path=str(adapters / "later"))
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    full = post("load_lora_adapter", lora_name="fourth", lora_path=str(adapters / "sql"))
    assert full.status_code == 400 and "--max-cpu-loras" in full.json()["error"]["message"]
    missing = post("load_lora_adapter", lora_name="x", lora_path=str(adapters / "none"))
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    assert post("load_lora_adapter", lora_name=BASE, lora_path="/").status_code == 400
    assert post("load_lora_adapter", lora_name="x").status_code == 400  # no lora_path
    long = post("load_lora_adapter", lora_name="x", lora_path="/" + "x" * 300)
    assert long.status_code == 400 and long.json()["error"]["param"] == "lora_path"

    r = post("unload_lora_adapter", lora_name="later")
    assert r.status_code == 200 and "removed" in r.text
    with pytest.raises(openai.NotFoundError):
        _text(client, "later")
    assert post("unload_lora_adapter", lora_name="later").status_code == 404
    # its slot is free again; the same folder gives the same answers under a new name
    r = post("load_lora_adapter", lora_name="again", lora_path=str(adapters / "later"))
    assert r.status_code == 200
    assert _text(client, "again") == later
    assert "again" in {m.id for m in client.models.list().data}


def test_without_the_flag_adapters_cannot_be_loaded(
    start_server: Callable[..., ChildProcess],
) -> None:
    plain = start_server()
    r = httpx.post(
        f"{plain.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/"}, timeout=30
    )
    assert r.status_code == 404


def test_metrics_say_which_adapters_run_as_vllm_does(
    start_server: Callable[..., ChildProcess], adapters: Path
) -> None:
    """``vllm:lora_requests_info``, which the Gateway API Inference Extension's endpoint
    picker reads for LoRA affinity: the slots, and the adapters of running and waiting
    requests."""
    s = start_server("--lora-modules", f"sql={adapters / 'sql'}", "--vllm-metrics")
    with openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0) as c:
        _text(c, "sql")
    text = httpx.get(f"{s.url}/metrics", timeout=30).text
    [line] = [x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{")]
    assert 'max_lora="1"' in line and 'running_lora_adapters=""' in line
    assert 'model_name="conveyor-tiny"' in line
    assert float(line.rsplit(" ", 1)[1]) > 1.7e9  # the scrape's Unix time
    [family] = [
        f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
    ]
    # vLLM's labels, and the model and engine every one of its series has here
    vllm_labels = {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert set(family.samples[0].labels) == vllm_labels | {"model_name", "engine"}
    assert "conveyor_lora_requests_info{" in text
