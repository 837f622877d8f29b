"""Settings of one runtime replica's HTTP server, parsed once from the command line."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.server.reasoning import REASONING_PARSERS, ReasoningParser

API_KEY_ENV = "CONVEYOR_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


TOOL_CALL_PARSERS = ("hermes", "smollm2", "qwen3_coder", "seed_oss")
"""Tool-call formats ``--tool-call-parser`` knows (``tool_calls.py`` reads them, and
``tool_prompt.py`` writes tools in them for chat templates that ignore ``tools``)."""


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s template: a file's text, or the value itself when it is a
    template (it holds ``{{`` or ``{%``). ValueError for a file that is not there."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"--chat-template {value!r} is neither a file nor a Jinja template; give the path of "
        "a .jinja file or the template itself"
    )


@dataclass(frozen=True)
class ServerSettings:
    """How the OpenAI-compatible server of one replica listens, admits and drains."""

    host: str = "0.0.0.0"
    """Interface to bind; all of them by default, as a pod must be reachable on its IP."""

    port: int = 8000
    """TCP port; 8000 is the runtime's port in ARCHITECTURE.md (and vLLM's default)."""

    served_model_name: str | None = None
    """Name clients put in ``model``; defaults to ``--model`` as given."""

    max_queued_requests: int | None = None
    """Waiting requests (not yet running) above which new ones get 429; unset = unbounded."""

    api_key: str | None = field(default=None, repr=False)
    """Bearer token required on ``/v1/*`` when set (also read from $CONVEYOR_API_KEY)."""

    drain_timeout: float = 30.0
    """Seconds SIGTERM waits for in-flight requests before exiting; Kubernetes' default
    grace period is 30 s."""

    retry_after: int = 1
    """Seconds sent in ``Retry-After`` with 429 and 503: about one short request's length."""

    log_level: str = "info"
    """Log level of the ``conveyor`` and ``uvicorn`` loggers."""

    access_log: bool = False
    """Log one line per HTTP request (off: at thousands of requests per second it is noise)."""

    log_stats_interval: float = 10.0
    """Seconds between one-line engine summaries in the log while busy (0 = never); vLLM's 10 s."""

    tool_call_parser: str | None = None
    """The model's own tool-call format, read when ``tool_choice`` is ``auto`` (vLLM's flag);
    unset: ``auto`` is refused, as nothing could read the calls."""

    chat_template: str | None = None
    """A Jinja chat template that replaces the tokenizer's (vLLM's ``--chat-template``, given
    as a file or inline; the file is read when the flags are parsed)."""

    reasoning_parser: str | None = None
    """``qwen3``, ``deepseek_r1`` or ``seed_oss``: a chat completion's thinking goes into
    ``reasoning_content``, apart from ``content`` (``reasoning.py``); unset: all is content."""

    responses_store_mb: float = 256.0
    """MiB of responses of ``POST /v1/responses`` kept in memory (the newest, as JSON), for
    ``previous_response_id`` and ``GET /v1/responses/{id}``; 0 keeps none (vLLM's default,
    which ignores ``store``). A chat turn is a few KiB; one with top logprobs of each of
    2,000 tokens, about 3 MiB."""

    vllm_metrics: bool = False
    """Also export the metrics vLLM has under vLLM's names and labels
    (``vllm:num_requests_waiting{model_name=...}``), for tools written against vLLM's: the
    Gateway API Inference Extension's endpoint picker, KEDA or HPA rules, vLLM's dashboards.
    Off by default: every such series is a second copy in Prometheus."""

    return_tokens_as_token_ids: bool = False
    """Logprobs name every token ``token_id:ID`` unless a request says otherwise (vLLM's
    ``--return-tokens-as-token-ids``)."""

    allow_runtime_lora_updating: bool = False
    """Serve ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's, behind
    its ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a client names a folder on the replica to
    read, so only where clients are trusted. Implies ``--enable-lora``."""

    engine: EngineSettings = field(default_factory=EngineSettings)
    """The engine this server drives."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(
                f"max_queued_requests must be >= 0 (or unset for no bound), got {self.max_queued_requests}"
            )
        if self.log_stats_interval < 0:
            raise ValueError(
                f"log_stats_interval must be >= 0 seconds, got {self.log_stats_interval}"
            )
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")
        if self.allow_runtime_lora_updating and not self.engine.lora_enabled:
            object.__setattr__(self, "engine", self.engine.replace(enable_lora=True))
        if self.model_name in {m.name for m in self.engine.lora_modules}:
            raise ValueError(
                f"LoRA adapter name {self.model_name!r} is the base model's served name; "
                "give the adapter another"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None:
            ReasoningParser(self.reasoning_parser)  # ValueError naming the choices
        if not self.responses_store_mb >= 0:
            raise ValueError(
                f"responses_store_mb must be >= 0 (0 keeps none), got {self.responses_store_mb}"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty; leave it unset to disable authentication")

    @property
    def model_name(self) -> str:
        """The name this replica serves under."""
        return self.served_model_name or self.engine.model

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the server's flags and the engine's (vLLM / SGLang names)."""
        d = ServerSettings()
        g = parser.add_argument_group("server")
        g.add_argument("--host", default=d.host, help=f"interface to bind (default {d.host})")
        g.add_argument("--port", type=int, default=d.port, help=f"TCP port (default {d.port})")
        g.add_argument(
            "--served-model-name",
            default=None,
            help="name clients use in `model` (default: --model as given)",
        )
        g.add_argument(
            "--max-queued-requests",
            type=int,
            default=None,
            help="waiting requests above which new ones get 429 with Retry-After (default: unbounded)",
        )
        g.add_argument(
            "--api-key",
            default=None,
            help=f"require `Authorization: Bearer KEY` on /v1/* (or set ${API_KEY_ENV})",
        )
        g.add_argument(
            "--drain-timeout",
            type=float,
            default=d.drain_timeout,
            help=f"seconds SIGTERM waits for in-flight requests (default {d.drain_timeout:g})",
        )
        g.add_argument(
            "--log-level",
            default=d.log_level,
            choices=["critical", "error", "warning", "info", "debug"],
            help=f"log level (default {d.log_level})",
        )
        g.add_argument("--access-log", action="store_true", help="log every HTTP request")
        g.add_argument(
            "--log-stats-interval",
            type=float,
            default=d.log_stats_interval,
            help=f"seconds between engine summaries in the log while busy; 0 = never (default {d.log_stats_interval:g})",
        )
        g.add_argument(
            "--tool-call-parser",
            default=None,
            choices=list(TOOL_CALL_PARSERS),
            help="the model's tool-call format, for tool_choice auto: hermes (Hermes, Qwen: "
            "<tool_call>{...}</tool_call>), smollm2 (<tool_call>[{...}]</tool_call>), qwen3_coder "
            "(<tool_call><function=NAME><parameter=KEY>...) or seed_oss (the same in "
            "<seed:tool_call>); each reads all of these in its tags, and writes the tools into "
            "the prompt in its format when the chat template ignores them; default: auto is "
            "refused",
        )
        g.add_argument(
            "--chat-template",
            default=None,
            metavar="FILE_OR_TEMPLATE",
            help="a Jinja chat template (a file, or the template itself) that replaces the "
            "tokenizer's, e.g. for a base model without one; default: the tokenizer's",
        )
        g.add_argument(
            "--reasoning-parser",
            default=None,
            choices=list(REASONING_PARSERS),
            help="a reasoning model's <think>...</think>, given apart as reasoning_content in chat "
            "completions: qwen3 (the model opens <think>), deepseek_r1 (the template opens it: "
            "DeepSeek-R1 and its distilled models) or seed_oss (Seed-OSS's <seed:think>); "
            "default: all output is content",
        )
        g.add_argument(
            "--responses-store-mb",
            type=float,
            default=d.responses_store_mb,
            metavar="MIB",
            help="MiB of /v1/responses answers kept in memory, the newest, for "
            "previous_response_id and GET /v1/responses/ID; 0 keeps none "
            f"(default {d.responses_store_mb:g})",
        )
        g.add_argument(
            "--vllm-metrics",
            action="store_true",
            help="also export the metrics under vLLM's names and labels on /metrics "
            "(vllm:num_requests_waiting, vllm:kv_cache_usage_perc, vllm:time_to_first_token_seconds, "
            "... with model_name), for tools written against vLLM: the Gateway API Inference "
            "Extension, KEDA or HPA rules, vLLM's dashboards",
        )
        g.add_argument(
            "--enable-auto-tool-choice",
            action="store_true",
            help="accepted as vLLM has it; tool_choice auto needs --tool-call-parser",
        )
        g.add_argument(
            "--return-tokens-as-token-ids",
            action="store_true",
            help="in logprobs, name each token 'token_id:ID' instead of its text (vLLM's), so "
            "that tokens holding part of a character can be told apart; a request's "
            "return_tokens_as_token_ids overrides it",
        )
        g.add_argument(
            "--allow-runtime-lora-updating",
            action="store_true",
            default=_env_flag(RUNTIME_LORA_ENV),
            help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which read an "
            "adapter from a folder the client names (only where clients are trusted); implies "
            f"--enable-lora (also set by ${RUNTIME_LORA_ENV}=true, as vLLM)",
        )
        EngineSettings.add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerSettings:
        return cls(
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            max_queued_requests=args.max_queued_requests,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            drain_timeout=args.drain_timeout,
            log_level=args.log_level,
            access_log=args.access_log,
            log_stats_interval=args.log_stats_interval,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            chat_template=read_chat_template(args.chat_template),
            responses_store_mb=args.responses_store_mb,
            vllm_metrics=args.vllm_metrics,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            engine=EngineSettings.from_cli_args(args),
        )
