"""``conveyor serve --generation-config FOLDER``: requests that leave sampling parameters out
take the generation_config.json's (here greedy, 5 tokens), a request's own values win; its
max_new_tokens also caps a request's max_tokens (vLLM's rule for a folder given; the model's
own file, ``auto``, only sets the default: ``tests/engine/test_sampling_defaults.py``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable

import openai
import pytest

from conveyor.bench.procs import ChildProcess
from conveyor.runtime.model.builtin import builtin_model_path

MESSAGES = [{"role": "user", "content": "Say something"}]
NO_EOS = {"ignore_eos": True}  # conveyor-tiny's random weights may end a reply at once


@pytest.fixture(scope="module")
def client(start_server: Callable[..., ChildProcess], tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5, "do_sample": True})
    )
    server = start_server("--generation-config", str(folder))
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
        yield c


def chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model="conveyor-tiny", messages=MESSAGES, extra_body=NO_EOS, **kwargs
    )


def test_max_new_tokens_is_the_default_and_the_cap_of_max_tokens(client):
    reply = chat(client)
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    assert chat(client, max_tokens=3).usage.completion_tokens == 3
    assert chat(client, max_completion_tokens=7).usage.completion_tokens == 5
    completion = client.completions.create(model="conveyor-tiny", prompt="Hi", extra_body=NO_EOS)
    assert completion.usage.completion_tokens == 5  # the completions API's default is 16


def test_the_default_temperature_applies_unless_the_request_sets_one(client):
    greedy = {chat(client, seed=seed).choices[0].message.content for seed in range(4)}
    assert len(greedy) == 1  # temperature 0 from the file: the seed does not matter
    sampled = {
        chat(client, seed=seed, temperature=1.0, max_tokens=12).choices[0].message.content
        for seed in range(4)
    }
    assert len(sampled) > 1


@pytest.fixture(scope="module")
def own_config_client(start_server: Callable[..., ChildProcess], tmp_path_factory):
    """conveyor-tiny copied with a generation_config.json of its own (``auto``)."""
    model = tmp_path_factory.mktemp("models") / "tiny-with-defaults"
    shutil.copytree(builtin_model_path(), model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=5)
    (model / "generation_config.json").write_text(json.dumps(config))
    server = start_server("--model", str(model))
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
        yield c


def test_the_models_own_max_new_tokens_is_only_a_default(own_config_client):
    model = own_config_client.models.list().data[0].id
    reply = own_config_client.chat.completions.create(
        model=model, messages=MESSAGES, extra_body=NO_EOS
    )
    assert reply.usage.completion_tokens == 5
    reply = own_config_client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=7, extra_body=NO_EOS
    )
    assert reply.usage.completion_tokens == 7
    completion = own_config_client.completions.create(model=model, prompt="Hi", extra_body=NO_EOS)
    assert completion.usage.completion_tokens == 16  # the completions API's own default
