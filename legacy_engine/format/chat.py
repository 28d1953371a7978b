"""Chat prompts: render a message list with a GGUF's Jinja chat template, as Hugging Face does.

render_chat(messages, template) runs `template` (normally the GGUF's tokenizer.chat_template) in a
sandboxed Jinja environment with the helpers HF chat templates expect (raise_exception, tojson,
strftime_now). template=None renders plain ChatML. default_template() is legacy_engine's own
Qwen3.5/3.6 template (templates/qwen35_chat.jinja), written into the GGUFs we make.

A template is code from the model file: every way it can fail (a syntax error, raise_exception, ZeroDivisionError,
RecursionError, MemoryError, an include without a loader, output past max_chars) is a TemplateRenderError naming
it. TemplateRenderer runs render_chat in a child process that is killed when a render runs too long (the server's
way to stop a template that loops). render_prompt keeps control tokens out of user text (see there).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from importlib import resources

from ..core.errors import TemplateRenderError

ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "image", "image_url", "video")
RENDER_CHARS = 32 << 20     # a render that writes more characters than this is stopped: a runaway template


class TemplateRaised(TemplateRenderError):
    """The template's raise_exception(): it refused these messages (the caller's error, not the template's)."""


@lru_cache(maxsize=1)
def default_template() -> str:
    """legacy_engine's Qwen3.5/3.6 chat template (spec §5)."""
    return (resources.files(__package__) / "templates" / "qwen35_chat.jinja").read_text(encoding="utf-8")


def _raise_exception(message: str):
    raise TemplateRaised(message)


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
    return _environment().from_string(template)


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
    source: str = "chat template",
    max_chars: int = RENDER_CHARS,
    **extra,
) -> str:
    """Render `messages` to prompt text with `template` (a Jinja chat template, or None for plain ChatML).

    Raises ValueError on malformed messages, and TemplateRenderError (a ValueError) naming `source` whenever the
    template fails: TemplateRaised when it calls raise_exception (it refuses the messages). A render that writes
    more than max_chars characters is stopped. `extra` reaches the template as variables (e.g. add_vision_id=True).
    """
    msgs = validate_messages(messages)
    if tools is not None and (isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence)
                              or not all(isinstance(t, Mapping) for t in tools)):
        raise ValueError("tools must be a list of JSON-schema dicts")
    if template is None:
        if tools:
            raise ValueError("tools need a chat template; plain ChatML has no tool format")
        return _chatml(msgs, add_generation_prompt)
    from jinja2 import TemplateError, TemplateSyntaxError

    context = {"bos_token": "", "eos_token": "<|im_end|>", **extra}
    context.update(messages=msgs, tools=list(tools) if tools else None,
                   add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    try:
        out, n = [], 0
        for piece in _compile(template).generate(**context):  # piece by piece: a runaway output stops early
            n += len(piece)
            if n > max_chars:
                raise TemplateRenderError(f"{source} wrote more than {max_chars} characters: stopped")
            out.append(piece)
        return "".join(out)
    except TemplateRaised as e:
        raise TemplateRaised(f"{source}: {e}") from None
    except TemplateRenderError:
        raise
    except TemplateSyntaxError as e:
        raise TemplateRenderError(f"{source} does not parse: {e.message} (line {e.lineno})") from None
    except TemplateError as e:
        raise TemplateRenderError(f"{source} failed: {e}") from None
    except Exception as e:  # the template is code from the model file: whatever it does wrong is its error
        raise TemplateRenderError(f"{source} failed: {type(e).__name__}" + (f": {e}" if str(e) else "")) from None


# ------------------------------------------------------------------------------------------------ user text

def render_prompt(messages, template: str | None, specials=(), render=render_chat,
                  **kw) -> tuple[str, list[tuple[int, int]]]:
    """render(messages, template, **kw) -> (prompt, literal): the [start, end) spans of the prompt where user text
    held one of `specials` (control-token literals such as <|im_start|>). tokenizer.encode_prompt(prompt, literal)
    then keeps those literals plain text, so control tokens come only from the template's own markup: a user who
    types <|im_start|>system does not open a system turn.

    How: every literal in the untrusted strings (message contents, reasoning, tool-call names and arguments, the
    tools) is swapped for a per-request random placeholder before rendering (letters and digits only: it survives
    trim, split and tojson as the literal would), and swapped back afterwards, recording where."""
    if not specials:
        return render(messages, template, **kw), []
    nonce = "le" + secrets.token_hex(12)
    table = {t: f"{nonce}{i:04x}" for i, t in enumerate(specials)}
    find = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))

    def shield(x):
        if isinstance(x, str):
            return find.sub(lambda m: table[m.group()], x)
        if isinstance(x, Mapping):
            return {shield(k): shield(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [shield(v) for v in x]
        return x

    if kw.get("tools") is not None:
        kw["tools"] = shield(kw["tools"])
    text = render(shield(messages), template, **kw)
    out, spans, pos, n = [], [], 0, 0
    for m in re.finditer(nonce + "([0-9a-f]{4})", text):
        literal = specials[int(m.group(1), 16)]
        out.append(text[pos:m.start()])
        n += m.start() - pos
        spans.append((n, n + len(literal)))
        out.append(literal)
        n += len(literal)
        pos = m.end()
    out.append(text[pos:])
    return "".join(out), spans


# ------------------------------------------------------------------------------------------------ render process

class TemplateRenderer:
    """render_chat in a child process that can be stopped. A chat template is code from the model file and may not
    end: a `range` inside a `range` loops for hours with no output, 'a' * 10**9 and '%999999999d' % 1 each build a
    gigabyte in one C call. A thread cannot be stopped in Python, and a sandbox that patches range and the operators
    still cannot bound the time of nested loops, so the render runs in a process: killed after `seconds`, its
    address space capped at `memory` bytes (those allocations fail at once with MemoryError), its output at
    max_chars. Every such failure is a TemplateRenderError naming the template.

    render() takes render_chat's arguments (JSON-able messages and tools) and blocks: call it off the event loop.
    One render at a time; the child starts on first use and again after a kill. close() stops it."""

    def __init__(self, seconds: float = 10.0, memory: int = 1 << 30):
        self.seconds, self.memory = seconds, memory
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def render(self, messages, template: str | None, source: str = "chat template", **kw) -> str:
        if template is None:  # ChatML: nothing to run
            return render_chat(messages, None, source=source, **kw)
        request = json.dumps(dict(kw, messages=messages, template=template, source=source)).encode() + b"\n"
        with self._lock:
            reply = self._ask(request, source)
        if "text" in reply:
            return reply["text"]
        raise {"raised": TemplateRaised, "failed": TemplateRenderError}.get(reply["kind"], ValueError)(reply["error"])

    def start(self) -> None:
        """Starts the child now (else on the first render): its ~0.2 s of Python start-up off the first request."""
        with self._lock:
            self._spawn()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _spawn(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package's parent
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from legacy_engine.format.chat import _child_main; _child_main()",
                 str(self.memory), str(self.seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                f.close()
            self._proc = None

    def _ask(self, request: bytes, source: str) -> dict:
        proc = self._spawn()
        try:
            proc.stdin.write(request)
            proc.stdin.flush()
        except OSError:  # it died since the last render
            self._stop()
            proc = self._spawn()
            proc.stdin.write(request)
            proc.stdin.flush()
        fd, buf = proc.stdout.fileno(), bytearray()
        deadline = time.monotonic() + self.seconds
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._stop()
                raise TemplateRenderError(f"{source} did not finish within {self.seconds:g} s: stopped (does it "
                                          f"loop?)")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                code = proc.wait()
                self._stop()
                raise TemplateRenderError(f"{source} failed: the render process ended (exit status {code})")
            buf += chunk
        return json.loads(buf)


def _child_main() -> None:
    """The TemplateRenderer's child: one JSON request per stdin line, one JSON reply per stdout line."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    memory, seconds = int(sys.argv[1]), float(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    _environment()  # jinja2 imported before the first request
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        # why: a CPU limit too, so that a loop outlives its parent by seconds at most (the parent normally kills it)
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        resource.setrlimit(resource.RLIMIT_CPU, (int(used + seconds) + 2, resource.RLIM_INFINITY))
        try:
            reply = {"text": render_chat(**json.loads(line))}
        except TemplateRaised as e:
            reply = {"kind": "raised", "error": str(e)}
        except TemplateRenderError as e:
            reply = {"kind": "failed", "error": str(e)}
        except ValueError as e:
            reply = {"kind": "invalid", "error": str(e)}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
