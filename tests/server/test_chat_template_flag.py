"""``conveyor serve --chat-template``: a template for a model whose tokenizer has none (a base
model), given as a file or inline; one that does not parse stops the server at start."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import httpx
import pytest

from conveyor.bench.procs import ChildProcess
from conveyor.runtime.model.builtin import builtin_model_path

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """conveyor-tiny without its chat template."""
    model = tmp_path_factory.mktemp("models") / "tiny-base"
    shutil.copytree(builtin_model_path(), model)
    (model / "chat_template.jinja").unlink()
    return str(model)


def test_a_model_without_a_template_says_how_to_give_one(start_server, base_model):
    server = start_server("--model", base_model)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "model": base_model})
    assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]


@pytest.mark.parametrize("as_file", [True, False], ids=["file", "inline"])
def test_the_template_given_renders_the_chat(
    start_server: Callable[..., ChildProcess], base_model, tmp_path, as_file
):
    value = TEMPLATE
    if as_file:
        (tmp_path / "chat.jinja").write_text(TEMPLATE)
        value = str(tmp_path / "chat.jinja")
    server = start_server("--model", base_model, "--chat-template", value)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        tokens = http.post("/tokenize", json={"messages": CHAT["messages"]}).json()["tokens"]
        prompt = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert prompt == "[user] Hi\n[assistant] "
        r = http.post("/v1/chat/completions", json={**CHAT, "model": base_model})
        assert r.status_code == 200, r.text


def test_a_template_that_does_not_parse_stops_the_server(start_server, base_model):
    with pytest.raises(RuntimeError, match="--chat-template does not parse"):
        start_server("--model", base_model, "--chat-template", "{% if %}")


def test_a_path_that_is_not_there_is_refused_at_once(start_server, base_model):
    with pytest.raises(RuntimeError, match="neither a file nor a Jinja template"):
        start_server("--model", base_model, "--chat-template", "/no/such/template.jinja")
