"""Tool traces and reasoning in records, in the shape chat templates take them.

Chat templates (and vLLM's chat endpoint, which renders requests with them) take OpenAI-style
messages: an assistant turn may carry ``tool_calls`` (``[{"id", "type": "function",
"function": {"name", "arguments"}}]``) and ``reasoning_content``; a ``tool`` turn carries the
result with its ``tool_call_id`` / ``name``; the declared tools are a separate ``tools`` list of
``{"type": "function", "function": {"name", "description", "parameters"}}``.  Datasets spell
these several ways; everything here maps one spelling to that shape or raises ``ValueError``
with what is wrong (the loader turns it into a counted skip).

Normalisations, each what the target's serving path would do or lossless:

* call ``arguments`` given as a JSON string are parsed to an object, and empty ones become
  ``{}``: vLLM 0.16 does the same before rendering (``chat_utils._postprocess_messages``), so
  the template's own JSON formatting is what the target saw;
* a flat call ``{"name", "arguments"}`` (ShareGPT ``function_call`` values, OpenAI's legacy
  ``function_call`` field) and a flat tool ``{"name", "parameters", ...}`` are wrapped as above;
* reasoning written inline at the start of a reply (``<think>R</think>C``) moves to
  ``reasoning_content`` (``R``, and ``C`` stays the content), with leading and trailing newlines
  stripped the way Qwen3's template splits it; templates that render ``reasoning_content``
  themselves would otherwise show ``<think></think><think>R</think>C``.  Think tags anywhere
  else, or inline reasoning beside a ``reasoning_content`` field, are refused.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["THINK_CLOSE", "THINK_OPEN", "TRACE_ROLES", "declared_tools", "split_inline_think",
           "tool_calls"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# Role names of tool traces, understood without data.roles: the tool's output ("tool" in
# OpenAI data, "function" in its legacy spelling, "observation" in ShareGPT agent sets,
# "ipython" in Llama 3.1's) and ShareGPT's "function_call" turn, whose value is the call.
TRACE_ROLES = {"tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
               "function_call": "function_call"}


def _json(value: Any, what: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON ({exc.msg} at character {exc.pos})") from exc


def _call(raw: Any, what: str) -> dict:
    """One call as ``{"type": "function", "function": {"name", "arguments": object}}`` (+ id)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{what} is a {type(raw).__name__}, not an object")
    function = raw.get("function", raw)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{what} has no function name")
    arguments = _json(function.get("arguments") or {}, f"{what} arguments")
    if not isinstance(arguments, dict):
        raise ValueError(f"{what} arguments are a {type(arguments).__name__}, not an object")
    call = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(raw.get("id"), str):
        call = {"id": raw["id"], **call}
    return call


def tool_calls(raw: Any, what: str) -> list[dict]:
    """A list of calls from an OpenAI ``tool_calls`` list, a single call object, or the JSON
    text of either (ShareGPT ``function_call`` values)."""
    raw = _json(raw, what)
    calls = raw if isinstance(raw, list) else [raw]
    if not calls:
        raise ValueError(f"{what} is an empty list")
    return [_call(call, f"{what}[{i}]") for i, call in enumerate(calls)]


def declared_tools(raw: Any) -> list[dict] | None:
    """The record's ``tools`` (a list, or its JSON text) as OpenAI tool objects; None if absent."""
    raw = _json(raw, "tools")
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise ValueError(f"tools is a {type(raw).__name__}, not a list")
    tools = []
    for i, tool in enumerate(raw):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tools.append({"type": tool.get("type", "function"), "function": tool["function"]})
        elif isinstance(tool, dict) and isinstance(tool.get("name"), str):
            tools.append({"type": "function", "function": tool})
        else:
            raise ValueError(f"tools[{i}] is neither {{'function': {{...}}}} nor {{'name': ...}}")
    return tools


def split_inline_think(content: str, reasoning: str | None) -> tuple[str, str | None, bool]:
    """``(content, reasoning, moved)``: leading ``<think>R</think>`` of ``content`` moved to the
    reasoning (``moved`` says so).  The opening tag may be missing, as in Qwen3 replies whose
    generation prompt opened the block."""
    if THINK_OPEN not in content and THINK_CLOSE not in content:
        return content, reasoning, False
    head = content.lstrip()
    opened = head.startswith(THINK_OPEN)
    if content.count(THINK_CLOSE) != 1 or content.count(THINK_OPEN) != int(opened):
        raise ValueError("think tags inside the reply text other than one leading "
                         "<think>...</think> block")
    if reasoning is not None:
        raise ValueError("reasoning both inline (<think>...</think>) and in reasoning_content")
    inner, _, rest = head[len(THINK_OPEN) if opened else 0:].partition(THINK_CLOSE)
    return rest.lstrip("\n"), inner.strip("\n"), True
