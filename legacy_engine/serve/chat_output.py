"""Assistant output -> OpenAI's message parts: reasoning (<think>…</think>), content and Qwen tool calls, split as
the text streams (ChatOutput) or at once (parse_tool_calls)."""
from __future__ import annotations

import json
import re
import secrets

_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _param_value(raw: str, schema) -> object:
    """A <parameter> value: the text itself for string (or unknown) types, else its JSON value if it parses."""
    v = raw.removeprefix("\n").removesuffix("\n")  # the format puts the value on its own lines
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind in (None, "string"):
        return v
    try:
        return json.loads(v)
    except ValueError:
        return v


def _one_call(inner: str, schemas: dict) -> dict | None:
    """{'name', 'arguments' (a JSON string)} from one <tool_call> body, XML-ish or JSON; None if malformed."""
    m = _FUNCTION.match(inner)
    if m:
        name = m.group(1).strip()
        props = schemas.get(name, {})
        args = {p.group(1).strip(): _param_value(p.group(2), props.get(p.group(1).strip()))
                for p in _PARAMETER.finditer(m.group(2))}
        return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_tool_calls(text: str, tools: list | None) -> tuple[str, list[dict]]:
    """Splits assistant text into (content, OpenAI tool_calls). Each <tool_call> block holds either Qwen3.5's
    <function=NAME><parameter=P>VALUE</parameter></function> or JSON {"name", "arguments"}; a final block may
    lack </tool_call> (generation stopped at EOS). Values are typed by the tool's JSON schema. Blocks that do
    not parse stay in the content. Without tools nothing is parsed."""
    if not tools:
        return text, []
    schemas = {}
    for t in tools:
        fn = t.get("function", {})
        schemas[fn.get("name")] = (fn.get("parameters") or {}).get("properties") or {}
    calls, kept, last = [], [], 0
    for m in _CALL_BLOCK.finditer(text):
        call = _one_call(m.group(1).strip(), schemas)
        if call is None:
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": "call_" + secrets.token_hex(12), "type": "function", "function": call})
    kept.append(text[last:])
    return "".join(kept).strip(), calls


class ChatOutput:
    """Splits assistant text, as it streams, into reasoning, content and tool calls.

    push(text) -> [("reasoning" | "content", piece), …] ready to send; finish() -> (the last pieces,
    tool_calls). Reasoning runs until </think> (from the start when the prompt left <think> open, or when the
    output opens one); with tools, content stops at the first <tool_call> and the rest is parsed at the end.
    Like the template, each part is trimmed: leading whitespace is dropped and trailing whitespace waits until
    more text follows. The pieces joined equal the non-streamed split, however the text is cut."""

    def __init__(self, thinking: bool, tools: list | None = None):
        self.mode = "reasoning" if thinking else "content"
        self.tools = tools
        self.buf = ""               # text of the current mode not yet sent
        self.started = False        # the current mode has sent text (leading whitespace is gone)
        self.any_content = False    # content may still open with <think>
        self.parts: dict[str, list[str]] = {"reasoning": [], "content": []}

    def _markers(self) -> tuple[str, ...]:
        if self.mode == "reasoning":
            return ("</think>",)
        return ("<tool_call>",) if self.tools else ()

    def _send(self, out: list, text: str) -> None:
        if not self.started:
            text = text.lstrip()
        if text:
            self.started = True
            self.any_content |= self.mode == "content"
            self.parts[self.mode].append(text)
            out.append((self.mode, text))

    def _switch(self, mode: str, rest: str) -> None:
        self.mode, self.buf, self.started = mode, rest, False

    def push(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.buf += text
        while self.mode != "tools":
            if self.mode == "content" and not self.any_content:
                head = self.buf.lstrip()
                if head.startswith("<think>"):
                    self._switch("reasoning", head[len("<think>"):])
                    continue
                if head and "<think>".startswith(head):  # may still become <think>
                    break
            hits = [(i, m) for m in self._markers() if (i := self.buf.find(m)) >= 0]
            if hits:
                i, m = min(hits)
                self._send(out, self.buf[:i].rstrip())
                self._switch("content" if m == "</think>" else "tools", self.buf[i + len(m):])
                continue
            end = len(self.buf)
            for m in self._markers():  # hold a suffix that may start a marker
                k = next((k for k in range(min(len(m) - 1, end), 0, -1) if self.buf.endswith(m[:k])), 0)
                end = min(end, len(self.buf) - k)
            end = len(self.buf[:end].rstrip())
            self._send(out, self.buf[:end])
            self.buf = self.buf[end:]
            break
        return out

    def finish(self) -> tuple[list[tuple[str, str]], list[dict]]:
        out: list[tuple[str, str]] = []
        calls: list[dict] = []
        if self.mode == "tools":
            rest, calls = parse_tool_calls("<tool_call>" + self.buf, self.tools)
            self.mode, self.started = "content", self.any_content
            if rest:
                self._send(out, ("\n\n" if self.any_content else "") + rest)
        else:
            self._send(out, self.buf.rstrip())
        self.buf = ""
        return out, calls

    @property
    def reasoning(self) -> str:
        return "".join(self.parts["reasoning"])

    @property
    def content(self) -> str:
        return "".join(self.parts["content"])
