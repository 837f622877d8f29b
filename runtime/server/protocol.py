"""Request bodies of the OpenAI API (pydantic), with the vLLM / SGLang sampling extensions.

Responses are plain dicts built in ``serving_*.py``: one stream chunk per token per
request is the hot path, and a dict plus ``json.dumps`` is the cheapest honest way to
write it. Unknown fields are ignored, as the OpenAI API does; wrong types are 400s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from conveyor.runtime.sampling_params import SamplingParams, StructuredOutputParams

MAX_N = 128
"""Most choices per request: each is one engine request holding its own KV blocks."""


class StreamOptions(BaseModel):
    include_usage: bool | None = None
    """A last chunk with the request's usage; null is false, as for the body's fields."""
    continuous_usage_stats: bool | None = None
    """vLLM's: with ``include_usage``, every chunk carries the usage so far too."""


class GenerateRequestBody(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions that vLLM and SGLang accept too.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    """vLLM's: lower runs sooner on a server started with ``--scheduling-policy priority``;
    anything but 0 is a 400 on any other."""
    prompt_logprobs: int | None = None
    """vLLM's: each prompt token's logprob and rank, with this many alternatives (0-20);
    not streamed."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these token ids may be generated."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: logprobs name each token ``token_id:ID`` instead of its text (None: as the
    server's ``--return-tokens-as-token-ids``)."""
    bad_words: list[str] | None = None
    """vLLM's: words not to generate."""
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    """vLLM's: the prompt's KV blocks are shared through the prefix cache only with requests
    that bring the same salt (a tenant's secret), so that no one else can tell from a
    response's speed or ``cached_tokens`` what was asked before."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    """vLLM's: keep only the prompt's last this many tokens (-1: as many as the context
    holds beside the output)."""
    # Structured outputs (``structured_outputs.py``): one of these per request.
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    """A JSON schema, as an object or as its JSON text."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """``"n": null``, ``"stream": null``, ...: OpenAI's schema allows null for every
        optional field and means its default by it; a required field keeps its null (400)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or (k in fields and fields[k].is_required())
        }

    def to_sampling_params(
        self,
        *,
        max_tokens: int,
        logprobs: int | None,
        structured_output: StructuredOutputParams | None,
        defaults: dict[str, Any] | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` of this request, the one shape they keep down to
        the sampler. A field left out (None) takes the model's default from ``defaults``
        (``engine/sampling_defaults.py``: temperature, top_p, top_k, min_p,
        repetition_penalty), else ``SamplingParams``' own. ValueError (naming the field
        first) for a value it refuses."""
        model = defaults or {}

        def pick(name: str) -> Any:
            """The request's value, else the model's default, else ``SamplingParams``'."""
            value = getattr(self, name)
            return value if value is not None else model.get(name, getattr(SamplingParams, name))

        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            repetition_penalty=pick("repetition_penalty"),
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_logit_bias(self.logit_bias),
            structured_output=structured_output,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
        )


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(
                f'logit_bias keys must be token ids such as "50256", got {key!r}'
            ) from None
    return out


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(GenerateRequestBody):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCall(BaseModel):
    """A tool call of an earlier assistant message, sent back in the conversation."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    """On a ``role: tool`` message: the call it answers."""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments; none means the function takes none."""
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call this function."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerateRequestBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: ``auto`` when tools are given, as OpenAI has it."""
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered by the template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt (BOS as completions adds it), false for messages (the
    template brings its own)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    """Rendered by the chat template, as chat completions renders them (in the
    ``--tool-call-parser`` format when the template ignores them, as chat does for ``auto``)."""
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
