"""Agent turns on the chat API: ``tools`` / ``tool_choice`` checked and turned into a grammar, tool calls
parsed from the output (``--tool-call-parser``: vLLM's ``hermes``, Qwen's ``<tool_call>{json}</tool_call>``,
and ``qwen3_coder``'s ``<function=...><parameter=...>``), and ``<think>`` split into ``reasoning_content``
(``--reasoning-parser``: ``qwen3`` / ``deepseek_r1``), whole or streamed.

``tool_choice="required"`` and a named function constrain the output with the grammar library to the
server's tool-call format, so even an untrained model returns a valid call (one call;
``parallel_tool_calls: true`` with ``required`` allows several): hermes' ``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>`` with the arguments under the function's JSON schema, or
qwen3_coder's ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n
</tool_call>`` with each parameter's value JSON under its property's schema (the parser reads a value as
JSON where it parses, so a string comes back a string), the schema's required parameters present.
The text and token ids returned are those sampled, tool-call text included.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import List, Optional, Tuple

from .errors import bad_value

TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")
REASONING_PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK, UNTHINK = "<think>", "</think>"


def check_tools(request) -> Optional[dict]:
    """{name: parameters schema} of ``tools`` (None without), or a 400 naming ``tools`` / ``tool_choice``."""
    tools, choice = request.tools, request.tool_choice
    if tools is None:
        if choice not in (None, "none"):
            raise bad_value("tool_choice", f"tool_choice {choice!r} needs tools")
        return None
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_value("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}, got {tool!r}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise bad_value("tools", f"tools[{i}].function.name must be 1-64 of [A-Za-z0-9_.-], got {name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_value("tools", f"tools[{i}].function.parameters must be a JSON schema object, got {params!r}")
        functions[name] = params
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in functions:
            raise bad_value("tool_choice", f"tool_choice names function {name!r}, not one of tools: {list(functions)}")
    elif choice not in (None, "none", "auto", "required"):
        raise bad_value("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}")
    return functions


def _call_schema(name: str, params: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _hermes_call(names: List[str], functions: dict) -> str:
    schemas = [_call_schema(n, functions[n]) for n in names]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = _JSON_STYLE
    return f"call: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}"


def _coder_call(names: List[str], functions: dict) -> str:
    """qwen3_coder's call: one rule per function, one per parameter (optional ones may be left out)."""
    rules, alternatives = [], []
    for f, name in enumerate(names):
        params = functions[name]
        required = set(params.get("required", ()))
        parts = []
        for p, (key, schema) in enumerate((params.get("properties") or {}).items()):
            schema = dict(schema) if isinstance(schema, dict) else {}
            schema["x-guidance"] = _JSON_STYLE
            head, tail = json.dumps(f"<parameter={key}>\n"), json.dumps("\n</parameter>\n")
            rules.append(f"f{f}_p{p}: {head} %json {json.dumps(schema)} {tail}")
            parts.append(f"f{f}_p{p}" + ("" if key in required else "?"))
        head = json.dumps(f"{OPEN}\n<function={name}>\n")
        rules.append(f"f{f}: {head} {' '.join(parts)} {json.dumps('</function>' + chr(10) + CLOSE)}")
        alternatives.append(f"f{f}")
    return "\n".join([f"call: {' | '.join(alternatives)}"] + rules)


def tool_grammar(request, functions: dict, parser: Optional[str] = "hermes") -> Optional[dict]:
    """The ``lark`` structured outputs for ``required`` / a named function in the format of ``parser`` (the
    server's ``--tool-call-parser``) (None: the output is free)."""
    choice = request.tool_choice
    if isinstance(choice, dict):
        names = [choice["function"]["name"]]
    elif choice == "required":
        names = list(functions)
    else:
        return None
    call = _coder_call(names, functions) if parser == "qwen3_coder" else _hermes_call(names, functions)
    many = choice == "required" and request.parallel_tool_calls is True
    start = 'start: call ("\\n" call)*' if many else "start: call"
    return {"lark": f"{start}\n{call}\n"}


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call(name: str, arguments) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": _arguments(arguments)},
    }


def _parse_block(body: str, parser: str) -> Optional[dict]:
    """One ``<tool_call>`` body as an OpenAI tool call (None: not a call)."""
    if parser == "qwen3_coder":
        fn = re.search(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", body, re.S)
        if not fn:
            return None
        args = {}
        for key, value in re.findall(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", fn.group(2), re.S):
            try:
                args[key] = json.loads(value)
            except ValueError:
                args[key] = value
        return _call(fn.group(1), args)
    try:
        data = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    return _call(data["name"], data.get("arguments", data.get("parameters", {})))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that starts ``tag`` (held back in a stream)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCalls:
    """One choice's content split into text and tool calls, fed piece by piece (``feed``) or at once."""

    def __init__(self, parser: str):
        self.parser = parser
        self.buffer = ""  # text not yet handed out
        self.calls: List[dict] = []

    def feed(self, text: str, final: bool = False) -> Tuple[str, List[dict]]:
        """(content to hand out now, tool calls completed now)."""
        self.buffer += text
        content, calls = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, OPEN)
                content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            content += self.buffer[:start]
            self.buffer = self.buffer[start:]
            end = self.buffer.find(CLOSE)
            if end < 0 and not final:
                break
            body = self.buffer[len(OPEN) : end if end >= 0 else len(self.buffer)]
            call = _parse_block(body, self.parser)
            if call is None:  # not a call after all: the text stays content
                taken = end + len(CLOSE) if end >= 0 else len(self.buffer)
                content += self.buffer[:taken]
                self.buffer = self.buffer[taken:]
            else:
                calls.append(call)
                self.buffer = self.buffer[end + len(CLOSE) :] if end >= 0 else ""
            if not self.buffer:
                break
        self.calls += calls
        return content, calls


class Reasoning:
    """One choice's text split into ``reasoning_content`` (inside ``<think>``) and content, streamed."""

    def __init__(self, parser: str, prompt_text: str):
        self.parser = parser
        opened = prompt_text.rfind(THINK) > prompt_text.rfind(UNTHINK)  # the template opened a think block
        self.inside = opened or parser == "deepseek_r1"
        self.start = not opened
        self.buffer = ""

    def feed(self, text: str, final: bool = False) -> Tuple[str, str]:
        """(reasoning, content) to hand out now."""
        self.buffer += text
        reasoning = content = ""
        if self.start:
            if len(self.buffer) < len(THINK) and THINK.startswith(self.buffer) and not final:
                return "", ""
            self.start = False
            if self.buffer.startswith(THINK):
                self.buffer, self.inside = self.buffer[len(THINK) :], True
        if self.inside:
            end = self.buffer.find(UNTHINK)
            if end < 0:
                keep = 0 if final else _partial_suffix(self.buffer, UNTHINK)
                reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                return reasoning, ""
            reasoning, self.buffer, self.inside = self.buffer[:end], self.buffer[end + len(UNTHINK) :], False
        content, self.buffer = self.buffer, ""
        return reasoning, content


class AgentOutput:
    """A choice's text through the reasoning parser, then the tool-call parser (each when on)."""

    def __init__(self, reasoning_parser: Optional[str], tool_parser: Optional[str], prompt_text: str):
        self.reasoning = Reasoning(reasoning_parser, prompt_text) if reasoning_parser else None
        self.tools = ToolCalls(tool_parser) if tool_parser else None
        self.saw_content = False

    def feed(self, text: str, final: bool = False) -> Tuple[str, str, List[dict]]:
        """(reasoning, content, tool calls) to hand out now."""
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        calls: List[dict] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        if not self.saw_content:  # the space / newlines between the think block and the answer
            content = content.lstrip() if self.reasoning else content
            self.saw_content = bool(content)
        return reasoning, content, calls


def finish_reason(reason: Optional[str], calls: List[dict]) -> Optional[str]:
    return "tool_calls" if calls and reason == "stop" else reason


__all__ = ["check_tools", "tool_grammar", "AgentOutput", "finish_reason", "TOOL_CALL_PARSERS", "REASONING_PARSERS"]
