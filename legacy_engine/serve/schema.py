"""OpenAI's request side: a /v1/chat/completions or /v1/completions body -> a validated Plan (the prompt rendered and
tokenized, the generation fields checked and clipped to the context), and errors in OpenAI's shape (APIError).
ServeConfig holds what the HTTP side knows beyond the worker."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..core.errors import FormatError, TemplateRenderError
from ..format.chat import TemplateRaised, render_chat
from .images import ImageRequestError, request_images
from .sampling import SamplingParams
from .grammar import GrammarError, grammar_of


MAX_CHOICES = 16             # n: each choice is a job of its own (a slot, a state)
MAX_TOP_LOGPROBS = 20        # OpenAI's bound for chat's top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # and for the completions API's logprobs


# ------------------------------------------------------------------------------------------------ errors

class APIError(Exception):
    """An answer in OpenAI's error format: HTTP status + {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ------------------------------------------------------------------------------------------------ the body

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> dict:
    """A request body -> its JSON object; 400 for anything else, a lone UTF-16 surrogate ("\\ud800") included:
    JSON allows the escape, but no text holds it (it would fail later, in encode)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # rare (clients that escape non-BMP text): only then the full check
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
                                "pair): not text", code="invalid_json") from None
    return body


# ------------------------------------------------------------------------------------------------ request fields

_JSON_TYPE = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
              dict: "an object", type(None): "null"}
NUMBER, INTEGER = (int, float), (int,)


def _field(body: dict, name: str, kinds: tuple, default=None, ok=None, rule: str = ""):
    """body[name] checked against JSON kinds (bool is never a number) and a range; None/absent -> default."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        want = " or ".join(_JSON_TYPE[k] for k in kinds if k is not float or int not in kinds)
        raise _bad(f"'{name}' must be {want}, got {_JSON_TYPE.get(type(v), type(v).__name__)}", name,
                   "invalid_type")
    if ok is not None and not ok(v):
        raise _bad(f"'{name}' = {v!r} is out of range: it must be {rule}", name)
    return v


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(stop) > 16:
        raise _bad(f"'stop' holds {len(stop)} strings; at most 16 are allowed", "stop")
    return [s for s in stop if s]


def _sampling(body: dict, defaults: SamplingParams | None) -> SamplingParams:
    """OpenAI's sampling fields plus the usual local-server extensions (top_k, min_p, repetition_penalty)."""
    defaults = defaults or SamplingParams(temperature=1.0)
    top_k = _field(body, "top_k", INTEGER, defaults.top_k, lambda v: v >= -1, ">= 0 (0 or -1: off)")
    seed = _field(body, "seed", INTEGER)
    return SamplingParams(
        temperature=float(_field(body, "temperature", NUMBER, defaults.temperature, lambda v: 0 <= v <= 2,
                                 "in [0, 2]")),
        top_p=float(_field(body, "top_p", NUMBER, defaults.top_p, lambda v: 0 < v <= 1, "in (0, 1]")),
        top_k=max(top_k, 0),
        min_p=float(_field(body, "min_p", NUMBER, defaults.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")),
        presence_penalty=float(_field(body, "presence_penalty", NUMBER, 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]")),
        frequency_penalty=float(_field(body, "frequency_penalty", NUMBER, 0.0, lambda v: -2 <= v <= 2,
                                       "in [-2, 2]")),
        repetition_penalty=float(_field(body, "repetition_penalty", NUMBER, 1.0, lambda v: 0 < v <= 10,
                                        "in (0, 10]")),
        seed=None if seed is None else seed % 2**64)  # numpy seeds are unsigned


def _unsupported(body: dict, chat: bool) -> None:
    """Fields whose non-default values this server cannot honour: refused rather than ignored."""
    if _field(body, "logit_bias", (dict,), {}):
        raise _bad("logit_bias is not supported by this server", "logit_bias", "unsupported_value")
    if not chat:
        if _field(body, "echo", (bool,), False):
            raise _bad("echo is not supported by this server", "echo", "unsupported_value")
        if _field(body, "best_of", INTEGER, 1) != 1:
            raise _bad("only best_of = 1 is supported", "best_of", "unsupported_value")
        if _field(body, "suffix", (str,)):
            raise _bad("suffix (fill-in-the-middle) is not supported by this server", "suffix", "unsupported_value")


@dataclass
class ServeConfig:
    """What the HTTP side needs to know beyond the worker. Defaults are the `serve` flags' defaults."""
    model_id: str
    api_key: str | None = None
    max_body: int = 4 << 20               # bytes of request body
    max_tokens: int | None = None         # cap on (and default of) a request's max_tokens; None: the context
    defaults: SamplingParams | None = None  # for fields a request leaves out; None: OpenAI's (temperature 1)
    enable_thinking: bool = True          # for chat requests that do not set chat_template_kwargs
    host: str = "127.0.0.1"               # --host: a name requests may give in Host (ORIGIN_POLICY)
    port: int | None = None               # --port: of this server's own origin; None: any
    allow_origins: tuple = ()             # --allow-origin: more server names and web origins; '*': any
    read_timeout: float = 30.0            # seconds for a request head, and for its body
    max_reading: int = 64                 # request bodies read at once; more wait (within read_timeout)
    special_in_user_text: bool = False    # parse control tokens in user text (the old, unsafe behaviour)
    render_seconds: float = 10.0          # a chat template render that takes longer is stopped
    image_dir: str | None = None          # --allow-file-images: file:// image URLs under it; None: refused


@dataclass
class Plan:
    """A validated request, ready to queue."""
    ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    thinking: bool = False               # the prompt leaves a <think> block open: output starts in reasoning
    tools: list | None = None            # parse <tool_call> output against these
    images: list = field(default_factory=list)    # format.image.ImageInput, one per image span, in prompt order
    spans: list = field(default_factory=list)     # format.multimodal.ImageSpan of each, in ids (already widened)
    grammar: str | None = None           # response_format's llguidance grammar (serve/grammar.py); None: free text
    n: int = 1                           # choices: one job each (serve/choices.py)
    logprobs: int | None = None          # None: off; else the alternatives reported per token


def _options(body: dict, cfg: ServeConfig, chat: bool) -> dict:
    """The generation fields of a request, checked before any prompt work."""
    mt = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    stream = _field(body, "stream", (bool,), False)
    opts = _field(body, "stream_options", (dict,), {})
    if chat:   # logprobs: bool, top_logprobs: alternatives per token (0..20)
        top = _field(body, "top_logprobs", INTEGER, None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                     f"in [0, {MAX_TOP_LOGPROBS}]")
        logprobs = (top or 0) if _field(body, "logprobs", (bool,), False) else None
        if top is not None and logprobs is None:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    else:      # logprobs: alternatives per token (0..5), as the legacy completions API
        logprobs = _field(body, "logprobs", INTEGER, None, lambda v: 0 <= v <= MAX_COMPLETION_LOGPROBS,
                          f"in [0, {MAX_COMPLETION_LOGPROBS}]")
    try:
        grammar = grammar_of(_field(body, "response_format", (dict,)))
    except GrammarError as e:
        raise _bad(str(e), "response_format") from None
    return dict(max_tokens=_field(body, mt, INTEGER, None, lambda v: v >= 1, ">= 1"),
                params=_sampling(body, cfg.defaults), stop=_stop_strings(body), stream=stream,
                include_usage=stream and _field(opts, "include_usage", (bool,), False), grammar=grammar,
                n=_field(body, "n", INTEGER, 1, lambda v: 1 <= v <= MAX_CHOICES, f"in [1, {MAX_CHOICES}]"),
                logprobs=logprobs)


def _fit(ids: list[int], opts: dict, cfg: ServeConfig, n_ctx: int, param: str) -> dict:
    """opts with the prompt, its length checked and max_tokens clipped to what the context has left (generation
    then ends with "length" at the context's edge)."""
    if len(ids) >= n_ctx:
        raise APIError(400, f"the prompt is {len(ids)} tokens; this server's context is {n_ctx} tokens and must "
                            f"keep room for at least one generated token (restart it with a larger --ctx, or "
                            f"shorten the prompt)", param=param, code="context_length_exceeded")
    limits = (opts["max_tokens"], cfg.max_tokens, n_ctx - len(ids))
    return dict(opts, ids=ids, max_tokens=min(x for x in limits if x is not None))


def _check_model(body: dict, cfg: ServeConfig) -> None:
    model = _field(body, "model", (str,), cfg.model_id)
    if model != cfg.model_id:
        raise APIError(404, f"the model '{model}' does not exist here; this server serves '{cfg.model_id}' "
                            f"(GET /v1/models)", param="model", code="model_not_found")


def _check_tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array of {'type': 'function', 'function': {...}}", "tools", "invalid_type")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': …, 'parameters': …}}}}",
                       "tools", "invalid_type")
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools", "invalid_type")
    return tools


def plan_chat(body: dict, engine, cfg: ServeConfig, render=None) -> Plan:
    """Validates a /v1/chat/completions body and renders + tokenizes its prompt. render: render_chat (default) or
    a TemplateRenderer's render. Blocks: the server calls it in a thread."""
    _check_model(body, cfg)
    _unsupported(body, chat=True)
    opts = _options(body, cfg, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array of {'role': …, 'content': …}", "messages",
                   "invalid_type" if not isinstance(messages, list) else "invalid_value")
    try:
        images = request_images(messages, engine, cfg.image_dir)
    except ImageRequestError as e:
        raise _bad(str(e), "messages", e.code) from None
    tools = body.get("tools") or None
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _bad("tool_choice must be 'auto' or 'none' (forcing a call is not supported)", "tool_choice",
                   "unsupported_value")
    if tools is not None:
        tools = None if choice == "none" else _check_tools(tools)
    kwargs = _field(body, "chat_template_kwargs", (dict,), {})
    unknown = set(kwargs) - {"enable_thinking"}
    if unknown:
        raise _bad(f"chat_template_kwargs: only 'enable_thinking' is supported, got {sorted(unknown)}",
                   "chat_template_kwargs", "unsupported_value")
    thinking = _field(kwargs, "enable_thinking", (bool,), cfg.enable_thinking)
    try:
        prompt, literal = engine.chat_text(messages, enable_thinking=thinking, tools=tools,
                                           special_in_user_text=cfg.special_in_user_text, render=render or render_chat)
    except TemplateRaised as e:  # the template refused these messages
        raise _bad(str(e), "messages") from None
    except TemplateRenderError as e:  # the template itself failed: the server's fault, not the request's
        raise APIError(500, str(e), "server_error", code="template_error") from None
    except ValueError as e:
        raise _bad(str(e), "messages") from None
    try:
        ids, spans = engine.expand_images(engine.tokenizer.encode_prompt(prompt, literal), images)
    except FormatError as e:
        raise _bad(str(e), "messages") from None
    return Plan(**_fit(ids, opts, cfg, engine.n_ctx, "messages"), thinking=prompt.rstrip().endswith("<think>"),
                tools=tools, images=images, spans=spans)


def plan_completion(body: dict, engine, cfg: ServeConfig) -> Plan:
    """Validates a /v1/completions body: prompt = a string, or token ids (or a one-element array of either)."""
    _check_model(body, cfg)
    _unsupported(body, chat=False)
    opts = _options(body, cfg, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    n_vocab = engine.model.hparams.n_vocab  # what Session accepts
    if isinstance(prompt, str):
        ids = engine.tokenizer.encode_prompt(prompt)  # the caller's whole prompt: special tokens are parsed
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < n_vocab for t in prompt):
            raise _bad(f"'prompt' holds a token id outside [0, {n_vocab})", "prompt")
        ids = list(prompt)
    else:
        raise _bad("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt",
                   "invalid_type")
    if not ids:
        raise _bad("'prompt' is empty: nothing to continue", "prompt")
    return Plan(**_fit(ids, opts, cfg, engine.n_ctx, "prompt"))
