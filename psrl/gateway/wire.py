"""OpenAI-compatible request bodies, validated strictly, and the gateway's error type.

Unknown fields are rejected with a 400 that names them; fields OpenAI defines but the gateway
cannot honour (``n > 1``, penalties, logit bias, JSON modes) are rejected with the reason, so an
agent never silently gets different sampling than it asked for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class GatewayError(Exception):
    """An HTTP error with an OpenAI-style body: ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", *, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # some clients echo the streaming index back


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Echoed back by clients that replay the assistant message they received (litellm, openai SDK).
    refusal: str | None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = None
    reasoning_content: str | None = None
    provider_specific_fields: dict[str, Any] | None = None
    thinking_blocks: None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (text content, tool calls with JSON arguments)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Strict):
    type: Literal["text"]


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None  # vLLM extension
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    return_token_ids: bool = False  # vLLM extension: prompt and output ids in the response

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only n=1 is supported: each call is one sample of the session's trajectory")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("penalties are not supported: they would change the policy being trained")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported: it would change the policy being trained")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_top(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("top_logprobs > 0 is not supported; logprobs=true gives the sampled tokens' log-probs")
        return v

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = None
    echo: bool = False

    @field_validator("logprobs")
    @classmethod
    def _sampled_only(cls, v: int | None) -> int | None:
        if v not in (None, 0, 1):
            raise ValueError("logprobs may be 0 or 1 (the sampled token's log-prob); top alternatives are not supported")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def token_limit(self) -> int | None:
        return self.max_tokens


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Validate a JSON body; any problem becomes a 400 that says which field and why."""
    if not raw:
        raise GatewayError(400, "request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"]) or "(body)"
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown field {loc!r}")
            elif err["type"] == "json_invalid":
                problems.append(f"malformed JSON: {err['msg']}")
            else:
                problems.append(f"{loc}: {err['msg']}")
        raise GatewayError(400, "; ".join(problems)) from None
