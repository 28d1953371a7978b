"""Chat prompts: render a message list with a GGUF's Jinja chat template, as Hugging Face does.

render_chat(messages, template) runs `template` (normally the GGUF's tokenizer.chat_template) in a
sandboxed Jinja environment with the helpers HF chat templates expect (raise_exception, tojson,
strftime_now). template=None renders plain ChatML. default_template() is legacy_engine's own
Qwen3.5/3.6 template (templates/qwen35_chat.jinja), written into the GGUFs we make.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from importlib import resources

ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "image", "image_url", "video")


@lru_cache(maxsize=1)
def default_template() -> str:
    """legacy_engine's Qwen3.5/3.6 chat template (spec §5)."""
    return (resources.files(__package__) / "templates" / "qwen35_chat.jinja").read_text(encoding="utf-8")


def _raise_exception(message: str):
    raise ValueError(f"chat template: {message}")


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    # HF's override of Jinja's tojson: no HTML escaping, unicode kept.
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateSyntaxError

    try:
        return _environment().from_string(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e.message} (line {e.lineno})") from e


def _check_content(i: int, role: str, content) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
        raise ValueError(f"messages[{i}].content must be a str or a list of parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ValueError(f"messages[{i}].content[{j}] must be a dict, got {type(part).__name__}")
        kind = part.get("type")
        if kind is None:  # {"text": ...} / {"image": ...} without a type, as HF's templates accept
            kind = next((k for k in PART_TYPES if k in part), None)
        if kind not in PART_TYPES:
            raise ValueError(f"messages[{i}].content[{j}]: type must be one of {PART_TYPES}, got {kind!r}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content[{j}]: a text part needs a str 'text'")
        if role == "system" and kind != "text":
            raise ValueError(f"messages[{i}]: a system message can only hold text")


def _normalise_call(i: int, k: int, call) -> dict:
    if not isinstance(call, Mapping):
        raise ValueError(f"messages[{i}].tool_calls[{k}] must be a dict")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(f"messages[{i}].tool_calls[{k}] needs a function name")
    args = fn.get("arguments") or {}
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"messages[{i}].tool_calls[{k}].arguments is not JSON: {e}") from e
    if not isinstance(args, Mapping):
        raise ValueError(f"messages[{i}].tool_calls[{k}].arguments must be an object")
    return {**call, "function": {**fn, "arguments": dict(args)}}


def validate_messages(messages) -> list[dict]:
    """Check roles and content shapes; returns shallow copies with tool-call arguments parsed."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': …, 'content': …} dicts")
    if not messages:
        raise ValueError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {role!r}")
        if role == "system" and i != 0:
            raise ValueError(f"messages[{i}]: the system message must be the first message")
        if "content" not in m and not (role == "assistant" and m.get("tool_calls")):
            raise ValueError(f"messages[{i}] has no content")
        _check_content(i, role, m.get("content"))
        if m.get("content") is None and role != "assistant":
            raise ValueError(f"messages[{i}].content is None; only an assistant turn with tool calls may omit it")
        msg = dict(m)
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant" or isinstance(calls, (str, Mapping)) or not isinstance(calls, Sequence):
                raise ValueError(f"messages[{i}].tool_calls must be a list on an assistant message")
            msg["tool_calls"] = [_normalise_call(i, k, c) for k, c in enumerate(calls)]
        if isinstance(m.get("content"), Sequence) and not isinstance(m.get("content"), str):
            msg["content"] = [p if "type" in p else {**p, "type": next(k for k in PART_TYPES if k in p)}
                              for p in m["content"]]
        out.append(msg)
    return out


def _chatml(messages: list[dict], add_generation_prompt: bool) -> str:
    """Plain ChatML: <|im_start|>{role}\\n{text}<|im_end|>\\n per message (text parts only)."""
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(p["text"] for p in c if p["type"] == "text")
        out.append(f"<|im_start|>{m['role']}\n{c or ''}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def render_chat(
    messages,
    template: str | None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    tools=None,
    **extra,
) -> str:
    """Render `messages` to prompt text with `template` (a Jinja chat template, or None for plain ChatML).

    Raises ValueError on malformed messages or when the template raises. `extra` reaches the template
    as variables (e.g. add_vision_id=True).
    """
    msgs = validate_messages(messages)
    if tools is not None and (isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence)
                              or not all(isinstance(t, Mapping) for t in tools)):
        raise ValueError("tools must be a list of JSON-schema dicts")
    if template is None:
        if tools:
            raise ValueError("tools need a chat template; plain ChatML has no tool format")
        return _chatml(msgs, add_generation_prompt)
    from jinja2 import TemplateError

    try:
        context = {"bos_token": "", "eos_token": "<|im_end|>", **extra}
        context.update(messages=msgs, tools=list(tools) if tools else None,
                       add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
        return _compile(template).render(**context)
    except TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e
