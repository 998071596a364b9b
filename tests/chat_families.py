"""Project-made tokenizers whose chat templates follow real families' tool and thinking conventions.

Written here from the families' documented output formats (no template text is copied):

* ``kimi``: role headers ``<|im_user|>user<|im_middle|>``; declared tools as a TypeScript-like
  ``namespace functions`` block in a ``tool_declare`` system turn; calls in a
  ``<|tool_calls_section_begin|>`` section with ids ``functions.NAME:INDEX``; results as
  ``## Return of ID``; every reply opens a think block, and reasoning is kept only after the
  last reply without tool calls (earlier replies show ``<think></think>``) unless the template
  argument ``preserve_thinking`` is true.
* ``qwen3``: ChatML; tools as JSON lines in ``<tools>`` inside the system turn; calls as JSON in
  ``<tool_call>`` inside the reply text; results grouped in a user turn as
  ``<tool_response>``; reasoning as ``<think>\\n...\\n</think>\\n\\n``, kept after the last real
  user query (and always shown, empty, on the final reply).
* ``llama31``: ``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``; tools as JSON in the
  first user turn; one call per reply, rendered as ``{"name", "parameters"}`` JSON *instead of*
  the reply text; results under the ``ipython`` role.
* ``deepseek_r1``: ``<｜User｜>`` / ``<｜Assistant｜>`` turns ending in ``<｜end▁of▁sentence｜>``;
  declared tools as ``### NAME`` sections after the system prompt; calls as
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` plus a JSON code block; results grouped in
  ``<｜tool▁outputs▁begin｜>``; the generation prompt opens the think block
  (``<｜Assistant｜><think>\\n``) and history shows replies without reasoning.  DeepSeek's own
  template drops the reasoning of the last reply too; this one shows the last reply as the model
  wrote it after that prompt (``R\\n</think>\\n\\nC``), so that the reply as generated is the
  template's own text.  ``DEEPSEEK_R1_OWN`` is the variant that drops it everywhere.

The section markers are special tokens, as in the real vocabularies.
"""

from __future__ import annotations

import copy

# Kimi's: the tiny thinking target (draftline/tiny/tokenizer.py, chat="kimi") carries the same.
from draftline.tiny.templates import KIMI_SPECIALS, KIMI_TEMPLATE  # noqa: E402

QWEN3_SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                  "</tool_response>", "<think>", "</think>"]
QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "Return each call as JSON inside <tool_call></tool_call> tags.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% set r = (m.get('reasoning_content') or '').strip('\n') %}"
    "{% if loop.index0 > ns.last_query and (loop.last or r) %}<think>\n{{ r }}\n</think>\n\n"
    "{{ m.content.lstrip('\n') }}{% else %}{{ m.content }}{% endif %}"
    "{% for c in m.get('tool_calls', []) %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                    "<|eom_id|>", "<|python_tag|>"]
LLAMA31_TEMPLATE = (
    "<|begin_of_text|>"
    "{% set system = messages[0].content if messages[0].role == 'system' else '' %}"
    "{% set rest = messages[1:] if messages[0].role == 'system' else messages %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{% if tools %}Environment: ipython\n{% endif %}"
    "Cutting Knowledge Date: December 2023\n\n{{ system }}<|eot_id|>"
    "{% for m in rest %}"
    "{% if m.role == 'user' %}<|start_header_id|>user<|end_header_id|>\n\n"
    "{% if tools and loop.first %}Given the following functions, respond with a JSON for a function "
    "call with its proper arguments that best answers the given prompt.\n\n"
    "{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{% endif %}"
    "{{ m.content }}<|eot_id|>"
    "{% elif m.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% if m.get('tool_calls') %}"
    "{% if m.tool_calls | length != 1 %}{{ raise_exception('only single tool calls') }}{% endif %}"
    "{% set c = m.tool_calls[0].function %}"
    "{\"name\": \"{{ c.name }}\", \"parameters\": {{ c.arguments | tojson }}}<|eot_id|>"
    "{% else %}{{ m.content }}<|eot_id|>{% endif %}"
    "{% elif m.role == 'tool' or m.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

DEEPSEEK_R1_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                        "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                        "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                        "<think>", "</think>"]
DEEPSEEK_R1_TEMPLATE = (
    "<｜begin▁of▁sentence｜>{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}{% if messages[0].role == 'system' %}\n\n{% endif %}"
    "## Tools\nYou have access to the following tools:\n"
    "{% for t in tools %}\n### {{ t.function.name }}\nDescription: {{ t.function.description }}\n\n"
    "Parameters: {{ t.function.parameters | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>"
    "{% if loop.last %}<think>\n{{ (m.get('reasoning_content') or '').strip('\n') }}\n</think>\n\n{% endif %}"
    "{{ m.content }}"
    "{% if m.get('tool_calls') %}<｜tool▁calls▁begin｜>{% for c in m.tool_calls %}<｜tool▁call▁begin｜>"
    "function<｜tool▁sep｜>{{ c.function.name }}\n```json\n{{ c.function.arguments | tojson }}\n```"
    "<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<｜tool▁outputs▁begin｜>{% endif %}"
    "<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<｜tool▁outputs▁end｜>{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)
# DeepSeek's own rule: no reply shows its reasoning, the last one neither.
DEEPSEEK_R1_OWN = DEEPSEEK_R1_TEMPLATE.replace("{% if loop.last %}<think>", "{% if false %}<think>")

FAMILIES = {"kimi": (KIMI_SPECIALS, KIMI_TEMPLATE), "qwen3": (QWEN3_SPECIALS, QWEN3_TEMPLATE),
            "llama31": (LLAMA31_SPECIALS, LLAMA31_TEMPLATE),
            "deepseek_r1": (DEEPSEEK_R1_SPECIALS, DEEPSEEK_R1_TEMPLATE),
            "deepseek_r1_own": (DEEPSEEK_R1_SPECIALS, DEEPSEEK_R1_OWN)}


def family_tokenizer(base, family: str):
    """A copy of the project's byte-level BPE ``base`` with the family's specials and template."""
    specials, template = FAMILIES[family]
    tok = copy.deepcopy(base)
    tok.add_special_tokens({"additional_special_tokens": specials}, replace_additional_special_tokens=False)
    tok.chat_template = template
    return tok
