"""Client load for the end-to-end tests: OpenAI clients sending back to back until stopped,
every failure recorded (the tests assert there is none)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from operator_helpers import wait_for


@dataclass
class Load:
    """Clients alternating completions and streamed chat, each ``max_tokens`` long. Prompts are
    not a few tokens short: vLLM for CPU 0.32.0 without its warm-up (``--enforce-eager``) loses
    its worker when a new replica's first forward is a 4-token prompt."""

    client: Any
    model: str
    max_tokens: int = 24
    stop: threading.Event = field(default_factory=threading.Event)
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                if i % 2:
                    out = self.client.completions.create(
                        model=self.model, prompt=f"request {i}: once upon a time",
                        max_tokens=self.max_tokens,
                    )  # fmt: skip
                    ok = bool(out.choices)
                else:
                    # closed on the way out: a stream left half read keeps its socket open
                    # until the garbage collector warns about it (warnings fail the tests)
                    with self.client.chat.completions.create(
                        model=self.model, messages=[{"role": "user", "content": f"hi {i}"}],
                        max_tokens=self.max_tokens, stream=True,
                    ) as stream:  # fmt: skip
                        ok = any(c.choices for c in stream)
            except Exception as exc:  # every failure is recorded and fails the test
                with self.lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                continue
            with self.lock:
                self.answered += 1
                if not ok:
                    self.failures.append("an answer without choices")


def run_load(
    load: Load, until: Callable[[], Any], what: str, *, clients: int, deadline_s: float
) -> Any:
    """Drive ``load`` with ``clients`` until ``until()`` is truthy; its last value. The
    clients are stopped and joined on the way out, whatever happened."""
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(load.worker, i) for i in range(clients)]
        try:
            return wait_for(what, until, timeout_s=deadline_s, interval_s=0.5)
        finally:
            load.stop.set()
            for future in futures:
                future.result()
