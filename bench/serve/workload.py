"""The synthetic requests of ``conveyor bench serve``: prompt and output length
distributions, optional shared prefixes; the same seed gives the same requests."""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadSettings:
    """The synthetic requests: the same seed gives the same requests."""

    num_requests: int = 128
    """Requests in the run."""
    input_len_min: int = 32
    """Shortest prompt (tokens), not counting a shared prefix."""
    input_len_max: int = 128
    """Longest prompt (tokens); lengths are uniform in [min, max]."""
    output_len_mean: int = 64
    """Mean output length (tokens), sent as max_tokens with ignore_eos."""
    output_len_max: int = 256
    """Cap on output length (tokens)."""
    output_len_dist: str = "exponential"
    """``exponential`` (a long tail, as real traffic), ``uniform`` in [1, 2*mean], or ``fixed``."""
    shared_prefix_len: int = 0
    """Tokens of a prefix shared by every request of a group (a system prompt); 0 = none."""
    num_prefix_groups: int = 1
    """How many distinct shared prefixes; requests are spread over them round-robin."""
    token_id_min: int = 32
    """Prompt token ids are drawn from [min, max): valid in any vocabulary of 256 or more."""
    token_id_max: int = 127
    seed: int = 0
    """Seeds the workload and, per request, the sampling."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int
    max_tokens: int


def build_workload(w: WorkloadSettings, endpoint: str) -> list[BenchRequest]:
    rng = random.Random(w.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(w.token_id_min, w.token_id_max) for _ in range(n)]

    prefixes = [ids(w.shared_prefix_len) for _ in range(max(1, w.num_prefix_groups))]
    requests = []
    for i in range(w.num_requests):
        body = ids(rng.randint(w.input_len_min, w.input_len_max))
        prompt = (prefixes[i % len(prefixes)] + body) if w.shared_prefix_len else body
        requests.append(
            BenchRequest(
                prompt=prompt if endpoint == "completions" else _as_text(prompt),
                prompt_len=len(prompt),
                max_tokens=_output_len(rng, w),
            )
        )
    return requests


def _as_text(ids: list[int]) -> str:
    # Printable characters from the ids: about one token per character on a byte-level
    # tokenizer; the server's usage reports the true count.
    return "".join(chr(32 + (t % 95)) for t in ids)


def _output_len(rng: random.Random, w: WorkloadSettings) -> int:
    if w.output_len_dist == "fixed":
        n = w.output_len_mean
    elif w.output_len_dist == "uniform":
        n = rng.randint(1, 2 * w.output_len_mean)
    elif w.output_len_dist == "exponential":
        n = math.ceil(rng.expovariate(1.0 / w.output_len_mean))
    else:
        raise ValueError(
            f"output_len_dist must be fixed, uniform or exponential; got {w.output_len_dist!r}"
        )
    return max(1, min(n, w.output_len_max))


def add_workload_args(
    parser: argparse.ArgumentParser, defaults: WorkloadSettings | None = None
) -> None:
    d = defaults or WorkloadSettings()
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--num-requests",
        "--num-prompts",
        type=int,
        default=d.num_requests,
        help=f"requests in the run (default {d.num_requests})",
    )
    g.add_argument(
        "--input-len-min",
        type=int,
        default=d.input_len_min,
        help=f"shortest prompt in tokens (default {d.input_len_min})",
    )
    g.add_argument(
        "--input-len-max",
        type=int,
        default=d.input_len_max,
        help=f"longest prompt in tokens (default {d.input_len_max})",
    )
    g.add_argument(
        "--output-len-mean",
        type=int,
        default=d.output_len_mean,
        help=f"mean output length in tokens (default {d.output_len_mean})",
    )
    g.add_argument(
        "--output-len-max",
        type=int,
        default=d.output_len_max,
        help=f"cap on output length (default {d.output_len_max})",
    )
    g.add_argument(
        "--output-len-dist",
        choices=["exponential", "uniform", "fixed"],
        default=d.output_len_dist,
        help="output length distribution (default exponential)",
    )
    g.add_argument(
        "--shared-prefix-len",
        type=int,
        default=d.shared_prefix_len,
        help=f"tokens of a prefix shared within a group of requests (default {d.shared_prefix_len})",
    )
    g.add_argument(
        "--num-prefix-groups",
        type=int,
        default=d.num_prefix_groups,
        help=f"distinct shared prefixes, assigned round-robin (default {d.num_prefix_groups})",
    )
    g.add_argument(
        "--token-id-range",
        type=int,
        nargs=2,
        default=(d.token_id_min, d.token_id_max),
        metavar=("LO", "HI"),
        help="prompt token ids drawn from [LO, HI) (default 32 127)",
    )
    g.add_argument(
        "--seed", type=int, default=d.seed, help=f"workload and sampling seed (default {d.seed})"
    )


def workload_from_args(a: argparse.Namespace) -> WorkloadSettings:
    w = WorkloadSettings(
        num_requests=a.num_requests,
        input_len_min=a.input_len_min,
        input_len_max=a.input_len_max,
        output_len_mean=a.output_len_mean,
        output_len_max=a.output_len_max,
        output_len_dist=a.output_len_dist,
        shared_prefix_len=a.shared_prefix_len,
        num_prefix_groups=a.num_prefix_groups,
        token_id_min=a.token_id_range[0],
        token_id_max=a.token_id_range[1],
        seed=a.seed,
    )
    if not 1 <= w.input_len_min <= w.input_len_max:
        raise SystemExit("--input-len-min must be >= 1 and <= --input-len-max")
    if w.num_requests < 1 or w.output_len_mean < 1 or w.output_len_max < 1:
        raise SystemExit("--num-requests, --output-len-mean and --output-len-max must be >= 1")
    return w
