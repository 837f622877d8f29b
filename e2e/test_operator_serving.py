"""The operator's LLMServices answering through the gateway, on pods that really run: the
example on the real model, two models behind one gateway, a spec change rolled out under
traffic, a tensor-parallel replica. Each skips with the reason on a cluster where pods do
not really run. The operator runs as a local process under its own ServiceAccount's token and RBAC
(``operator_helpers``), watching only the test's namespace.
"""

from __future__ import annotations

import sys
import time

from operator_helpers import (
    RECONCILE_S,
    REPO,
    OperatorProcess,
    apply_yaml,
    children,
    deployment,
    llmservice,
    llmservice_status,
    path_of,
    reconciled,
    wait_for,
)

# the fixtures these tests and their fixtures ask for by name
from conveyor.cluster.testing import KubeUnderTest

EXAMPLE = REPO / "examples" / "llmservice.yaml"
MODEL = "smollm2"  # the example's name: the model clients send


def test_example_is_served_through_the_gateway(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess, running_pods: None
) -> None:
    """kubectl apply the example (the real model) -> runtime and gateway pods Ready -> the
    openai client gets right answers through the gateway, streamed and not."""
    import openai

    started = time.monotonic()
    kube.kubectl("-n", namespace, "apply", "-f", str(EXAMPLE))
    status = wait_for(
        "the example LLMService Ready",
        lambda: (s := llmservice_status(kube.api, namespace, MODEL)).get("phase") == "Ready" and s,
        timeout_s=600,
    )
    ready_s = time.monotonic() - started
    endpoint = status["endpoint"]
    assert endpoint["model"] == MODEL and endpoint["clusterIP"]
    client = openai.OpenAI(
        base_url=f"http://{endpoint['clusterIP']}:8080/v1", api_key="none", max_retries=0,
        timeout=120,
    )  # fmt: skip
    answered = wait_for(
        "the gateway to route to the replica",
        lambda: client.completions.create(model=MODEL, prompt="Hello", max_tokens=8),
        timeout_s=120,
    )
    first_answer_s = time.monotonic() - started
    assert answered.choices[0].text
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=32, temperature=0
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=32, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    print(
        f"\n[figures] apply -> Ready {ready_s:.1f} s, apply -> first answer {first_answer_s:.1f} s"
        f"; {startup_split(kube, namespace, MODEL)}; answer: {streamed!r}",
        file=sys.stderr,
    )


def startup_split(kube: KubeUnderTest, namespace: str, name: str) -> str:
    """Where the time to Ready went, from the apiserver's (whole-second) timestamps."""
    from datetime import datetime

    def at(stamp: str) -> float:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()

    created = at(kube.api.get(path_of(namespace, name))["metadata"]["creationTimestamp"])
    pod = kube.api.get(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"conveyor.dev/llmservice={name}"
    )["items"][0]
    conditions = {c["type"]: at(c["lastTransitionTime"]) for c in pod["status"]["conditions"]}
    running = pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    marks = [
        ("LLMService -> pod created", created, at(pod["metadata"]["creationTimestamp"])),
        ("pod scheduled", at(pod["metadata"]["creationTimestamp"]), conditions["PodScheduled"]),
        ("container started", conditions["PodScheduled"], at(running)),
        ("model loaded and Ready", at(running), conditions["Ready"]),
    ]
    return ", ".join(f"{what} {end - start:.0f} s" for what, start, end in marks)


def test_two_models_behind_one_gateway_each_answer_for_their_name(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess, running_pods: None
) -> None:
    import openai

    apply_yaml(
        kube,
        namespace,
        llmservice("alpha"),
        llmservice("beta", model={"builtin": "conveyor-tiny", "servedName": "beta-model"}),
    )
    for name in ("alpha", "beta"):
        wait_for(
            f"{name} Ready",
            lambda n=name: llmservice_status(kube.api, namespace, n).get("phase") == "Ready",
            timeout_s=600,
        )
    ip = llmservice_status(kube.api, namespace, "alpha")["endpoint"]["clusterIP"]
    assert (
        llmservice_status(kube.api, namespace, "beta")["endpoint"]["clusterIP"] == ip
    )  # one base URL
    client = openai.OpenAI(base_url=f"http://{ip}:8080/v1", api_key="none", max_retries=0)
    for model in ("alpha", "beta-model"):
        wait_for(
            f"an answer for {model}",
            lambda m=model: client.completions.create(model=m, prompt="Hi", max_tokens=4),
            timeout_s=120,
        )
    kube.kubectl("-n", namespace, "delete", "llmservice", "alpha", "--wait=true")
    assert client.completions.create(model="beta-model", prompt="Hi", max_tokens=4).choices

    def alpha_unknown() -> bool:
        try:
            client.completions.create(model="alpha", prompt="Hi", max_tokens=4)
        except openai.NotFoundError:
            return True
        return False

    wait_for("the gateway to answer 404 for alpha", alpha_unknown, timeout_s=60)
    kube.kubectl("-n", namespace, "delete", "llmservice", "beta", "--wait=true")
    wait_for(
        "the shared gateway garbage-collected with the last LLMService",
        lambda: not children(kube.api, namespace, component="gateway"),
        timeout_s=RECONCILE_S,
    )


def test_a_spec_change_rolls_out_under_traffic_without_failed_requests(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess, running_pods: None
) -> None:
    import threading

    import openai

    # A quarter core each, so that the surge replica fits beside the two old ones (the GPU
    # nodes have 666m each): with no room for it, a maxUnavailable=0 rollout waits forever.
    small = {"gpus": 1, "cpu": "250m", "memory": "1Gi"}
    apply_yaml(kube, namespace, llmservice("roll", replicas=2, resources=small))
    status = wait_for(
        "roll Ready",
        lambda: (s := llmservice_status(kube.api, namespace, "roll")).get("phase") == "Ready" and s,
        timeout_s=600,
    )
    client = openai.OpenAI(
        base_url=f"http://{status['endpoint']['clusterIP']}:8080/v1",
        api_key="none",
        max_retries=0,
        timeout=60,
    )
    wait_for(
        "routed",
        lambda: client.completions.create(model="roll", prompt="Hi", max_tokens=4),
        timeout_s=120,
    )
    stop, failures, answered = threading.Event(), [], [0]

    def traffic() -> None:
        while not stop.is_set():
            try:
                stream = client.completions.create(
                    model="roll", prompt="Tell a story", max_tokens=48, stream=True
                )
                for _ in stream:
                    pass
                answered[0] += 1
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        kube.kubectl(
            "-n",
            namespace,
            "patch",
            "llmservice",
            "roll",
            "--type=merge",
            "-p",
            '{"spec":{"runtime":{"maxRunningRequests":16}}}',
        )
        min_ready = [2]

        def rolled_out() -> bool:
            d = deployment(kube, namespace, "roll")["status"]
            min_ready[0] = min(min_ready[0], d.get("readyReplicas", 0))
            s = reconciled(kube, namespace, "roll")
            return bool(
                s
                and s["phase"] == "Ready"
                and d.get("updatedReplicas") == 2
                and d.get("replicas") == 2
            )

        wait_for("the new spec rolled out", rolled_out, timeout_s=600, interval_s=0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert failures == [] and answered[0] > 0
    assert min_ready[0] >= 2  # new replicas were Ready before old ones went


def test_two_gpus_make_one_tensor_parallel_replica_that_answers_through_the_gateway(
    kube: KubeUnderTest, namespace: str, operator: OperatorProcess, running_pods: None
) -> None:
    """``resources.gpus: 2``: one replica whose model is split over two ranks (tensor
    parallelism) answers through the gateway with the tokens one rank gives, greedy."""
    import openai

    from conveyor.runtime import LLM, SamplingParams

    name = "tp"
    apply_yaml(
        kube,
        namespace,
        llmservice(name, resources={"gpus": 2, "cpu": "500m", "memory": "2Gi"}),
    )
    status = wait_for(
        "the tensor-parallel LLMService Ready",
        lambda: (s := llmservice_status(kube.api, namespace, name)).get("phase") == "Ready" and s,
        timeout_s=300,
    )
    container = deployment(kube, namespace, name)["spec"]["template"]["spec"]["containers"][0]
    args = container.get("args") or []
    assert args[args.index("--tensor-parallel-size") + 1] == "2", args
    client = openai.OpenAI(
        base_url=f"http://{status['endpoint']['clusterIP']}:8080/v1", api_key="none",
        max_retries=0, timeout=120,
    )  # fmt: skip
    prompt = "The conveyor belt carries"
    answered = wait_for(
        "the gateway to route to the tensor-parallel replica",
        lambda: client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0),
        timeout_s=120,
    )
    with LLM("conveyor-tiny") as one_rank:
        expected = one_rank.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    assert answered.choices[0].text == expected.text
    print(
        f"\n[figures] tensor-parallel replica: {startup_split(kube, namespace, name)}; "
        f"answer: {answered.choices[0].text!r}",
        file=sys.stderr,
    )
