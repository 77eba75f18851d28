"""Generation requests as the gateway accepts them (OpenAI bodies and WebSocket messages).

Every check fails with an :class:`ApiError` carrying the HTTP status and an OpenAI-style error
body; nothing here talks to NATS. Statuses: 400 malformed JSON or a missing field, 401 no valid
API key (access.py), 404 unknown model, 408 a body not sent in time, 413 oversized body or prompt,
422 a field of the wrong type or out of range, 429 a key's rate or the queue's limit, 502 a route
that failed while generating, 503 no tracker or no route right now.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web

from neuron_bus import messages as M
from neuron_bus.admission import DEFAULT_LIMIT as DEFAULT_QUEUE_LIMIT

TOP_LOGPROBS_MAX = 5  # alternatives the route's tail reports per token


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
        **extra,
    ):
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})
        self.retry_after = retry_after  # seconds, for 429 and 503: when to try again
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.extra = extra

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code, **self.extra}
        }

    def response(self) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return web.json_response(self.body(), status=self.status, headers=headers or None)


@dataclass(frozen=True)
class Limits:
    max_context: int = 4096  # prompt + generated tokens per session (workers default to 4608 positions)
    max_body_bytes: int = 1 << 20
    max_queue: int = DEFAULT_QUEUE_LIMIT  # generations waiting for a free session slot (429 beyond; 0: 503 at once)
    chars_per_token: int = 16  # a prompt longer than max_context * this is refused before tokenizing
    body_timeout_s: float = 30.0  # a request body must arrive within this (408: slow clients)

    @property
    def max_prompt_chars(self) -> int:
        return self.max_context * self.chars_per_token


@dataclass
class GenRequest:
    """One validated generation: what to prompt with, how to sample, how to answer."""

    model: str | None
    sampling: M.SamplingParams
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_tokens: list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int = 0  # alternatives per token in the answer (0: none)
    extra: dict = field(default_factory=dict)
    policy: str = "public"  # route policy: public | private (trusted nodes only) | paid-trusted
    speculative: int = 0  # draft tokens per decode step (an extra parameter: `speculative`)


async def read_body(request: web.Request, limits: Limits) -> bytes:
    """The request's body, within the size limit (413) and ``body_timeout_s`` (408)."""
    try:
        return await asyncio.wait_for(request.read(), limits.body_timeout_s)
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {limits.body_timeout_s:g}s", code="request_timeout"
        ) from None


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # nesting deeper than the parser goes
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


_MISSING = object()
_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
}


def get(body: dict, name: str, kind: type, default=_MISSING, lo=None, hi=None):
    """``body[name]`` checked for type and range, or ``default`` when absent (required without one)."""
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise ApiError(400, f"missing required parameter '{name}'", param=name, code="missing_required_parameter")
        return default
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ApiError(422, f"'{name}' must be {_TYPE_NAMES[kind]}", param=name, code="invalid_type")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ApiError(422, f"'{name}' must be between {lo} and {hi}, got {value}", param=name, code="out_of_range")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise ApiError(
            422, "'stop' must be a string or an array of at most 4 strings", param="stop", code="invalid_type"
        )
    return stop


def sampling(body: dict, limits: Limits, default_max_tokens: int, logprobs: bool) -> M.SamplingParams:
    if get(body, "n", int, 1) != 1:
        raise ApiError(422, "only n=1 is supported", param="n", code="unsupported_value")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return M.SamplingParams(
        max_tokens=get(body, max_name, int, default_max_tokens, 1, limits.max_context - 1),
        temperature=get(body, "temperature", float, 0.0, 0.0, 2.0),
        top_p=get(body, "top_p", float, 1.0, 0.0, 1.0) or 1.0,
        top_k=get(body, "top_k", int, 0, 0, 100_000),
        seed=get(body, "seed", int, 0),
        stop=_stop(body),
        logprobs=logprobs,
        ignore_eos=get(body, "ignore_eos", bool, False),
    )


def _check_chars(text: str, limits: Limits, param: str) -> str:
    if len(text) > limits.max_prompt_chars:
        raise ApiError(
            413,
            f"the prompt has {len(text)} characters; this gateway accepts at most {limits.max_prompt_chars} "
            f"(a context of {limits.max_context} tokens)",
            param=param,
            code="context_length_exceeded",
        )
    return text


def _prompt(body: dict, limits: Limits) -> tuple[str | None, list[int] | None]:
    """A completion prompt: a string, an array holding one string, or an array of token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "missing required parameter 'prompt'", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(422, "'prompt' is empty", param="prompt", code="empty_prompt")
        return _check_chars(prompt, limits, "prompt"), None
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return None, list(prompt)
    raise ApiError(
        422,
        "'prompt' must be a string or an array of token ids (one prompt per request)",
        param="prompt",
        code="invalid_type",
    )


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ApiError(
        422,
        f"messages[{i}].content must be a string or an array of text parts",
        param=f"messages[{i}].content",
        code="invalid_type",
    )


def _messages(body: dict, limits: Limits) -> list[dict[str, str]]:
    messages = get(body, "messages", list)
    if not messages:
        raise ApiError(
            400, "'messages' must hold at least one message", param="messages", code="missing_required_parameter"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(
                422, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]", code="invalid_type"
            )
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(
                422,
                f"messages[{i}].role {m['role']!r} is not a known role",
                param=f"messages[{i}].role",
                code="invalid_value",
            )
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m.get("content") or "", i)})
    _check_chars("".join(m["content"] for m in out), limits, "messages")
    return out


def completion_request(body: dict, limits: Limits) -> GenRequest:
    """``POST /v1/completions``: ``logprobs`` is the number of alternatives (0-5) or absent."""
    model = get(body, "model", str)
    prompt, tokens = _prompt(body, limits)
    n_top = get(body, "logprobs", int, None, 0, TOP_LOGPROBS_MAX)
    return GenRequest(
        model=model,
        prompt=prompt,
        prompt_tokens=tokens,
        sampling=sampling(body, limits, 16, logprobs=n_top is not None),
        stream=get(body, "stream", bool, False),
        include_usage=_include_usage(body),
        top_logprobs=n_top or 0,
        policy=_policy(body),
        speculative=_speculative(body),
    )


def chat_request(body: dict, limits: Limits) -> GenRequest:
    """``POST /v1/chat/completions``: ``logprobs`` is a boolean, ``top_logprobs`` 0-5."""
    model = get(body, "model", str)
    messages = _messages(body, limits)
    logprobs = get(body, "logprobs", bool, False)
    n_top = get(body, "top_logprobs", int, 0, 0, TOP_LOGPROBS_MAX)
    return GenRequest(
        model=model,
        messages=messages,
        sampling=sampling(body, limits, 256, logprobs=logprobs or n_top > 0),
        stream=get(body, "stream", bool, False),
        include_usage=_include_usage(body),
        top_logprobs=n_top,
        policy=_policy(body),
        speculative=_speculative(body),
    )


def ws_request(body: dict, limits: Limits) -> GenRequest:
    """A WebSocket ``generate`` message: ``prompt`` (raw completion) or ``messages`` (chat template)."""
    model = get(body, "model", str, None)
    if body.get("messages") is not None:
        messages, prompt, tokens = _messages(body, limits), None, None
    else:
        messages, (prompt, tokens) = None, _prompt(body, limits)
    logprobs = get(body, "logprobs", bool, False)
    return GenRequest(
        model=model,
        prompt=prompt,
        messages=messages,
        prompt_tokens=tokens,
        sampling=sampling(body, limits, 256, logprobs=logprobs),
        top_logprobs=TOP_LOGPROBS_MAX if logprobs else 0,
        policy=_policy(body),
        speculative=_speculative(body),
    )


def _speculative(body: dict) -> int:
    """The extra ``speculative`` parameter: draft tokens per decode step, 0 (plain decoding) to 16."""
    return get(body, "speculative", int, 0, 0, M.MAX_SPECULATIVE)


def _policy(body: dict) -> str:
    policy = get(body, "policy", str, "public")
    if policy not in ("public", "private", "paid-trusted"):
        raise ApiError(
            400,
            f"policy must be public, private or paid-trusted, got {policy!r}",
            param="policy",
            code="invalid_policy",
        )
    return policy


def _include_usage(body: dict) -> bool:
    opts = get(body, "stream_options", dict, {})
    return bool(opts.get("include_usage"))
