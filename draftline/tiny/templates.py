"""Chat templates of real families for the project's tiny targets, written from the families'
documented output formats (no template text is copied; tests/chat_families.py describes each).

* ``KIMI_TEMPLATE``: Kimi-K2.5's thinking conventions: role headers
  ``<|im_user|>user<|im_middle|>``, declared tools as a TypeScript-like ``namespace functions``
  block, calls in a ``<|tool_calls_section_begin|>`` section with ids ``functions.NAME:INDEX``,
  results as ``## Return of ID``; every reply opens a think block, and reasoning is kept only
  after the last reply without tool calls (earlier replies show ``<think></think>``) unless the
  template argument ``preserve_thinking`` is true.  The generation prompt is
  ``<|im_assistant|>assistant<|im_middle|>``: the model opens its think block itself.

The section markers are special tokens, as in the real vocabularies.
"""

from __future__ import annotations

KIMI_SPECIALS = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
                 "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]
KIMI_TEMPLATE = (
    "{% macro ts_type(p) %}{% if p.type == 'integer' or p.type == 'number' %}number"
    "{% elif p.type == 'boolean' %}boolean{% elif p.enum is defined %}"
    "{{ p.enum | map('tojson') | join(' | ') }}{% else %}string{% endif %}{% endmacro %}"
    "{% if tools %}<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
    "{% for t in tools %}{% set f = t.function %}"
    "// {{ f.description }}\ntype {{ f.name }} = (_: {\n"
    "{% for name, p in f.parameters.properties.items() %}"
    "{% if p.description is defined %}// {{ p.description }}\n{% endif %}"
    "{{ name }}{{ '' if name in f.parameters.get('required', []) else '?' }}: {{ ts_type(p) }},\n"
    "{% endfor %}}) => any;\n{% endfor %}}<|im_end|>{% endif %}"
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m.role == 'assistant' and not m.get('tool_calls') %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>"
    "{% if loop.index0 > ns.last or preserve_thinking %}<think>{{ m.get('reasoning_content') or '' }}</think>"
    "{% else %}<think></think>{% endif %}{{ m.content }}"
    "{% if m.get('tool_calls') %}<|tool_calls_section_begin|>"
    "{% for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>"
    "{{ c.function.arguments | tojson }}<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>"
    "{% endif %}"
    "{% elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n"
    "{{ m.content }}"
    "{% else %}<|im_system|>{{ m.role }}<|im_middle|>{{ m.content }}{% endif %}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
# A reply ends with this token (generation_config's eos), as Kimi's do.
KIMI_END_OF_TURN = "<|im_end|>"
