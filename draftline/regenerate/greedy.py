"""Replace the data's assistant replies with the target's own greedy replies.

Why: at serving time the draft continues text the *target* wrote.  Trained on the target's own
replies, a draft learns the distribution it will be asked to predict; evaluated on them, the
offline acceptance estimate is exact (every stored context is the context vLLM would verify),
where on other text it is teacher-forced beyond the first draft position
(``draftline.evaluate.offline`` explains the alignment).

Turn by turn, on token ids (no text round trip): reply ``r`` of every sample is generated from
the sample's prefix with replies ``< r`` already regenerated.  What lies between replies (user
turns, role headers) is kept as tokenized.  A reply ends at one of the target's stop tokens,
which stays in the reply and in its loss mask (the chat template's end-of-turn marker is masked
by tokenize too), or at its cap.  A reply that hit its cap without an end of turn ends its
sample: later turns would follow an unfinished reply.  Samples never grow past ``seq_length``.

Tool traces: the data's tool results answer the data's calls, and nothing here runs tools.  So
a reply whose following text holds tool results (tokenize marks those tokens, ``tool_results``)
is regenerated, and the sample continues past the results only when the target's reply is the
data's reply token for token (the same call, so the recorded result still answers it).
Otherwise the sample ends after the target's reply, and the replies after it are counted as
``tool_stops`` and ``dropped_turns``: every later reply would need a tool run on the target's
own call.  A reply is thus only ever regenerated from a prompt whose tool results answer calls
the target itself made.

Greedy decoding through vLLM (``VllmReplies``), in chunks of samples written atomically under a
folder named by the input and config fingerprint, so a crashed run resumes at its first
missing chunk.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

# (prompts, caps) -> per prompt (reply token ids, ended by a stop token)
GenerateFn = Callable[[list[list[int]], list[int]], list[tuple[list[int], bool]]]


def reply_spans(mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of loss-mask ones (the assistant replies), in order."""
    spans, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return spans


@dataclasses.dataclass
class Draft:
    """One sample while its replies are regenerated."""

    source: list[int]  # the tokenized sample
    spans: list[tuple[int, int]]  # its reply spans
    ids: list[int]  # regenerated so far
    mask: list[int]
    alive: bool = True
    capped_replies: int = 0
    tools: list[int] = dataclasses.field(default_factory=list)  # tokenize's tool-result marks


@dataclasses.dataclass
class ChunkStats:
    replies: int = 0  # replies generated
    stopped: int = 0  # replies that ended with a stop token
    capped: int = 0  # replies that hit their cap (their sample ends there)
    dropped_turns: int = 0  # source replies not regenerated because an earlier one was capped or called
    tool_stops: int = 0  # samples ended after a reply whose tool results no longer answer it
    generated_tokens: int = 0

    def add(self, other: "ChunkStats") -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def regenerate(samples: Sequence[list[int]], masks: Sequence[list[int]], generate: GenerateFn,
               seq_length: int, max_new_tokens: int | None,
               tool_results: Sequence[list[int]] | None = None,
               ) -> tuple[list[list[int]], list[list[int]], ChunkStats]:
    """New (ids, masks) with every reply the target's; see the module doc for the rules.
    ``tool_results``: tokenize's marks per sample (None: no sample has tool results)."""
    drafts = []
    if tool_results is None:
        tool_results = [[] for _ in samples]
    for ids, mask, tools in zip(samples, masks, tool_results, strict=True):
        spans = reply_spans(mask)
        if not spans:
            raise ValueError("a sample without loss-mask tokens reached regeneration "
                             "(tokenize drops those)")
        first = spans[0][0]
        drafts.append(Draft(list(ids), spans, list(ids[:first]), [0] * first, tools=list(tools)))
    stats = ChunkStats()
    for turn in range(max(len(d.spans) for d in drafts)):
        todo = [d for d in drafts if d.alive and turn < len(d.spans)]
        caps = [seq_length - len(d.ids) for d in todo]
        if max_new_tokens is not None:
            caps = [min(c, int(max_new_tokens)) for c in caps]
        for d, cap in zip(todo, caps, strict=True):
            if cap <= 0:  # the regenerated prefix already fills the sample
                d.alive = False
                stats.dropped_turns += len(d.spans) - turn
        todo = [d for d in todo if d.alive]
        caps = [c for c in caps if c > 0]
        if not todo:
            continue
        replies = generate([d.ids for d in todo], caps)
        for d, cap, (reply, stopped) in zip(todo, caps, replies, strict=True):
            if not reply or len(reply) > cap:
                raise RuntimeError(f"the engine returned {len(reply)} tokens for a cap of {cap}")
            d.ids += reply
            d.mask += [1] * len(reply)
            stats.replies += 1
            stats.generated_tokens += len(reply)
            if not stopped:
                stats.capped += 1
                stats.dropped_turns += len(d.spans) - turn - 1
                d.alive = False
                continue
            stats.stopped += 1
            start, end = d.spans[turn]
            following = d.spans[turn + 1][0] if turn + 1 < len(d.spans) else len(d.source)
            if any(d.tools[end:following]) and reply != d.source[start:end]:
                stats.tool_stops += 1
                stats.dropped_turns += len(d.spans) - turn - 1
                d.alive = False
                continue
            gap = d.source[end:following][: seq_length - len(d.ids)]
            d.ids += gap
            d.mask += [0] * len(gap)
    return [d.ids for d in drafts], [d.mask for d in drafts], stats


class VllmReplies:
    """Greedy replies from the target through vLLM's offline ``LLM`` (prompts as token ids)."""

    def __init__(self, options, stop_ids: Sequence[int], **stage):
        """``options``: draftline.engine.EngineOptions (the run's one engine builder);
        ``stage``: regenerate's own scheduler keys (max_num_batched_tokens)."""
        from vllm import LLM

        from draftline.engine import llm_kwargs

        self.stop_ids = [int(i) for i in stop_ids]
        self.llm = LLM(**llm_kwargs(options, **stage))

    def __call__(self, prompts: list[list[int]], caps: list[int]) -> list[tuple[list[int], bool]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(temperature=0.0, max_tokens=cap, stop_token_ids=self.stop_ids,
                                 ignore_eos=False, detokenize=False, skip_special_tokens=False)
                  for cap in caps]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=False)
        replies = []
        for prompt, output in zip(prompts, outputs, strict=True):
            if list(output.prompt_token_ids) != prompt:
                raise RuntimeError("vLLM returned outputs out of order")
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            stopped = completion.finish_reason == "stop"
            if stopped and (not tokens or tokens[-1] not in self.stop_ids):
                raise RuntimeError(f"vLLM stopped a reply without a stop token at its end "
                                   f"(stop ids {self.stop_ids}, reason {completion.stop_reason!r}, "
                                   f"last tokens {tokens[-3:]}): the end of turn would be lost")
            if not stopped and completion.finish_reason != "length":
                raise RuntimeError(f"vLLM ended a reply with finish_reason "
                                   f"{completion.finish_reason!r}")
            replies.append((tokens, stopped))
        return replies

    def shutdown(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()


def stop_token_ids(target_dir: str | Path) -> list[int]:
    """eos ids of the target's generation_config.json, else config.json (where a reply ends)."""
    path = Path(target_dir) / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    if eos is None:
        config = json.loads((Path(target_dir) / "config.json").read_text())
        eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    ids = [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    if not ids:
        raise ValueError(f"{target_dir}: no eos_token_id in generation_config.json or config.json; "
                         "regeneration would not know where a reply ends")
    return ids
