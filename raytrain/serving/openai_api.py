"""The OpenAI wire format of `raytrain serve`: request parsing into replica requests, response and stream shaping.

Pure functions on dicts (no Serve, no model): the router parses a body here, fans the replica requests it
gets out to a model deployment (one per prompt and choice, so Serve batches them), and shapes the replica
results back into `text_completion` / `chat.completion` objects, their stream chunks and OpenAI errors.
Field meanings follow OpenAI's API and vLLM's OpenAI server; the legacy completions `logprobs` object is
`tokens`, `token_logprobs` (null for the very first prompt token), `top_logprobs` and `text_offset`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Optional

from raytrain.serving.fields import RequestError, bool_field, int_field, number_field, stop_field

DEFAULT_NEW_TOKENS = 16
MAX_TOP_LOGPROBS = 20
MAX_N = 16
# raytrain's default chat template (docs/SERVING.md): `role: content` lines, then `assistant:` to answer.
# `raytrain export` writes it into every exported tokenizer; `raytrain serve --chat-template none` turns the
# fallback off for models that carry none.
DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error"}


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    """OpenAI's error object; `code` is the HTTP status, as vLLM sends it."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


@dataclass
class Parsed:
    """One OpenAI request, validated: the replica requests it fans out to and how to shape the answer."""

    kind: str  # "text_completion" or "chat.completion"
    prompts: list[dict]
    sampling: dict
    n: int = 1
    echo: bool = False
    top_logprobs: Optional[int] = None
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def requests(self) -> list[dict]:
        """Prompt-major, then choice: result i answers choice i of the response."""
        seed = self.sampling.get("seed")
        return [{**p, **self.sampling, "seed": None if seed is None else seed + j, "echo": self.echo,
                 "top_logprobs": self.top_logprobs} for p in self.prompts for j in range(self.n)]


def _prompts(v) -> list[dict]:
    """`prompt`: a string, a list of strings, a list of token ids or a list of such lists."""
    def ids(x) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(v, str) and v:
        return [{"text": v}]
    if ids(v):
        return [{"ids": v}]
    if isinstance(v, list) and v and all((isinstance(p, str) and p) or ids(p) for p in v):
        return [{"text": p} if isinstance(p, str) else {"ids": p} for p in v]
    raise RequestError(422, "'prompt' must be a non-empty string, a list of them, a list of token ids or a list of "
                       f"such lists, got {str(v)[:80]!r}", "prompt")


def _sampling(body: dict, max_tokens_key: str, lo_tokens: int) -> dict:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(422, f"'seed' must be an integer, got {seed!r}", "seed")
    return {"max_new_tokens": int_field(body, max_tokens_key, DEFAULT_NEW_TOKENS, lo_tokens, 4096),
            "temperature": number_field(body, "temperature", 1.0, 0, 10),
            "top_p": number_field(body, "top_p", 1.0, 1e-6, 1), "seed": seed, "stop": stop_field(body)}


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream or not isinstance(opts, dict):
        raise RequestError(422, "'stream_options' is an object and goes with \"stream\": true", "stream_options")
    return bool_field(opts, "include_usage")


def parse_completion(body: dict) -> Parsed:
    """POST /v1/completions."""
    if "prompt" not in body:
        raise RequestError(422, "the body needs 'prompt', e.g. {\"prompt\": \"one two\", \"max_tokens\": 8}", "prompt")
    prompts = _prompts(body["prompt"])
    echo = bool_field(body, "echo")
    sampling = _sampling(body, "max_tokens", 0)
    stream = bool_field(body, "stream")
    p = Parsed("text_completion", prompts, sampling, n=int_field(body, "n", 1, 1, MAX_N), echo=echo,
               top_logprobs=int_field(body, "logprobs", None, 0, MAX_TOP_LOGPROBS), stream=stream,
               include_usage=_stream_options(body, stream))
    if body.get("best_of") not in (None, 1, p.n):
        raise RequestError(422, "'best_of' other than n is not supported; leave it out", "best_of")
    return p


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, list):  # content parts: only text ones can be rendered for a text model
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in c):
            raise RequestError(422, f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                               "are supported", "messages")
        return "".join(part["text"] for part in c)
    if not isinstance(c, str):
        raise RequestError(422, f"messages[{i}].content must be a string, got {c!r}", "messages")
    return c


def parse_chat(body: dict) -> Parsed:
    """POST /v1/chat/completions (`max_completion_tokens` is the newer name of `max_tokens`)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(422, "the body needs a non-empty list 'messages', e.g. [{\"role\": \"user\", \"content\": "
                           "\"hi\"}]", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise RequestError(422, f"messages[{i}] needs a 'role' among {', '.join(CHAT_ROLES)}, got "
                               f"{str(m)[:80]!r}", "messages")
        clean.append({"role": m["role"], "content": _content(m, i)})
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stream = bool_field(body, "stream")
    if body.get("logprobs"):
        raise RequestError(422, "chat 'logprobs' is not supported; use /v1/completions with \"echo\" and "
                           "\"logprobs\"", "logprobs")
    return Parsed("chat.completion", [{"messages": clean}], _sampling(body, key, 1),
                  n=int_field(body, "n", 1, 1, MAX_N), stream=stream, include_usage=_stream_options(body, stream))


def render_chat(tokenizer, messages: list[dict], *, fallback: Optional[str]) -> str:
    """The prompt text of a conversation through the model's chat template (or `fallback` when it has none)."""
    template = getattr(tokenizer, "chat_template", None) or fallback
    if not template:
        raise RequestError(400, "this model has no chat template and the server was started with --chat-template "
                           "none; use /v1/completions, or restart without that flag for raytrain's default template",
                           "messages")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template that rejects the conversation (e.g. role order)
        raise RequestError(400, f"the chat template rejected the messages: {str(e).splitlines()[0]}", "messages")


# --- responses ----------------------------------------------------------------------------------------


def _legacy_logprobs(tokens: list[str], lps: list, tops: list, start: int = 0) -> dict:
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _choice_logprobs(p: Parsed, r: dict) -> Optional[dict]:
    if p.top_logprobs is None:
        return None
    tokens, lps, tops = list(r["gen_pieces"]), list(r["gen_lp"]), list(r["gen_top"])
    if p.echo:
        tokens = r["prompt_pieces"] + tokens
        lps, tops = [None] + r["prompt_lp"] + lps, [None] + r["prompt_top"] + tops
    return _legacy_logprobs(tokens, lps, tops)


def _usage(p: Parsed, results: list[dict]) -> dict:
    prompt = sum(r["prompt_tokens"] for r in results[::p.n])  # each prompt once, whatever n
    completion = sum(r["completion_tokens"] for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _head(p: Parsed, version: str, chunk: bool = False) -> dict:
    obj = p.kind + (".chunk" if chunk and p.kind == "chat.completion" else "")
    prefix = "chatcmpl-" if p.kind == "chat.completion" else "cmpl-"
    return {"id": prefix + p.id, "object": obj, "created": p.created, "model": version}


def response(p: Parsed, results: list[dict], version: str) -> dict:
    """The non-streamed answer: one choice per result."""
    choices = []
    for i, r in enumerate(results):
        if p.kind == "chat.completion":
            choices.append({"index": i, "message": {"role": "assistant", "content": r["continuation"]},
                            "logprobs": None, "finish_reason": r["finish_reason"]})
        else:
            text = ("".join(r["prompt_pieces"]) if p.echo else "") + r["continuation"]
            choices.append({"index": i, "text": text, "logprobs": _choice_logprobs(p, r),
                            "finish_reason": r["finish_reason"]})
    return {**_head(p, version), "version": version, "choices": choices, "usage": _usage(p, results)}


def _piece_logprobs(p: Parsed, r: dict, j: int, at: int) -> Optional[dict]:
    if p.top_logprobs is None:
        return None
    return _legacy_logprobs([r["gen_pieces"][j]], [r["gen_lp"][j]], [r["gen_top"][j]], at)


class StreamShaper:
    """The OpenAI stream of one request, shaped from its choices' replica events as they arrive (choices
    interleave, each chunk naming its index): per choice its echo (completions) or role (chat) once it is
    accepted, one chunk per generated token, then its finish; a usage chunk when asked
    (stream_options.include_usage). Each choice's texts concatenate to `response`'s.

    Replica events (`ModelServer.stream`): {"start": {prompt_pieces, prompt_tokens}}, {"pieces": [...]} (final
    text, sent as generated), {"result": r} (the rest: pieces not yet sent, log-probabilities, finish)."""

    def __init__(self, p: Parsed, version: str):
        self.p, self.head = p, _head(p, version, chunk=True)
        self.at: dict[int, int] = {}  # per choice: characters sent (text_offset of the next token)
        self.sent: dict[int, int] = {}  # per choice: generated pieces sent
        self.results: dict[int, dict] = {}

    def _chunk(self, i: int, piece: str, finish=None, logprobs=None, first=False) -> dict:
        if self.p.kind == "chat.completion":
            delta = ({"role": "assistant", "content": piece} if first else {"content": piece}) if finish is None else {}
            return {**self.head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return {**self.head, "choices": [{"index": i, "text": piece, "logprobs": logprobs, "finish_reason": finish}]}

    def event(self, i: int, ev: dict) -> list[dict]:
        if "start" in ev:
            return self.start(i, ev["start"])
        if "pieces" in ev:
            return self.pieces(i, ev["pieces"])
        return self.result(i, ev["result"])

    def _echo_now(self) -> bool:
        return self.p.echo and self.p.top_logprobs is None  # with log-probabilities it waits for the scores

    def start(self, i: int, start: dict) -> list[dict]:
        self.at[i], self.sent[i] = 0, 0
        if self.p.kind == "chat.completion":
            return [self._chunk(i, "", first=True)]
        if self._echo_now():
            prompt = "".join(start["prompt_pieces"])
            self.at[i] = len(prompt)
            return [self._chunk(i, prompt)]
        return []

    def pieces(self, i: int, pieces: list[str]) -> list[dict]:
        out = [self._chunk(i, piece) for piece in pieces]
        self.sent[i] += len(pieces)
        self.at[i] += sum(len(x) for x in pieces)
        return out

    def result(self, i: int, r: dict) -> list[dict]:
        self.results[i] = r
        out = []
        if self.p.echo and not self._echo_now():
            prompt = "".join(r["prompt_pieces"])
            out.append(self._chunk(i, prompt, logprobs=_legacy_logprobs(
                r["prompt_pieces"], [None] + r["prompt_lp"], [None] + r["prompt_top"])))
            self.at[i] = len(prompt)
        for j in range(self.sent[i], len(r["gen_pieces"])):
            out.append(self._chunk(i, r["gen_pieces"][j], logprobs=_piece_logprobs(self.p, r, j, self.at[i])))
            self.at[i] += len(r["gen_pieces"][j])
        self.sent[i] = len(r["gen_pieces"])
        return out + [self._chunk(i, "", finish=r["finish_reason"])]

    def close(self) -> list[dict]:
        """After every choice's result: the usage chunk, when asked."""
        if not self.p.include_usage:
            return []
        return [{**self.head, "choices": [], "usage": _usage(self.p, [self.results[i] for i in sorted(self.results)])}]


def chunks(p: Parsed, results: list[dict], version: str) -> Iterator[dict]:
    """The whole stream of finished results, choice after choice (what a stream is when nothing was sent
    during generation)."""
    shape = StreamShaper(p, version)
    for i, r in enumerate(results):
        yield from shape.start(i, r)
        yield from shape.result(i, r)
    yield from shape.close()


SSE_DONE = "data: [DONE]\n\n"


def sse_event(e: dict) -> str:
    """One server-sent event as OpenAI sends them."""
    return f"data: {json.dumps(e)}\n\n"


def sse(events: Iterator[dict]) -> Iterator[str]:
    """Server-sent events, closed by `data: [DONE]`."""
    for e in events:
        yield sse_event(e)
    yield SSE_DONE
