"""Reply regeneration: the splice rules on token ids, and the real vLLM CPU engine against HF greedy."""

from __future__ import annotations

import os

import pytest
import torch

from draftline.regenerate import greedy
from draftline.engine import EngineOptions
from draftline.tiny import builders


class Scripted:
    """Stands in for the engine in the splice tests: replies from a list, prompts recorded."""

    def __init__(self, *replies: tuple[list[int], bool]):
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.caps: list[int] = []

    def __call__(self, prompts, caps):
        self.prompts += [list(p) for p in prompts]
        self.caps += list(caps)
        out, self.replies = self.replies[:len(prompts)], self.replies[len(prompts):]
        return out


def test_reply_spans():
    assert greedy.reply_spans([0, 1, 1, 0, 0, 1]) == [(1, 3), (5, 6)]
    assert greedy.reply_spans([0, 0]) == []


def test_every_reply_is_replaced_and_the_turns_between_are_kept():
    # prompt 10 11 | reply 20 21 9 | user turn 12 13 | reply 22 9 | trailer 14
    ids = [10, 11, 20, 21, 9, 12, 13, 22, 9, 14]
    mask = [0, 0, 1, 1, 1, 0, 0, 1, 1, 0]
    engine = Scripted(([30, 9], True), ([31, 32, 33, 9], True))
    new_ids, new_masks, stats = greedy.regenerate([ids], [mask], engine, 64, None)
    assert engine.prompts == [[10, 11], [10, 11, 30, 9, 12, 13]]  # turn 2 sees the new turn 1
    assert new_ids == [[10, 11, 30, 9, 12, 13, 31, 32, 33, 9, 14]]
    assert new_masks == [[0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0]]
    assert (stats.replies, stats.stopped, stats.capped, stats.dropped_turns) == (2, 2, 0, 0)


def test_a_capped_reply_ends_its_sample_and_samples_never_exceed_seq_length():
    ids = [10, 11, 20, 9, 12, 22, 9]
    mask = [0, 0, 1, 1, 0, 1, 1]
    engine = Scripted(([30, 31, 32, 33], False))
    new_ids, new_masks, stats = greedy.regenerate([ids], [mask], engine, 6, None)
    assert engine.caps == [4]  # seq_length 6 minus the 2-token prompt
    assert new_ids == [[10, 11, 30, 31, 32, 33]] and new_masks == [[0, 0, 1, 1, 1, 1]]
    assert (stats.capped, stats.dropped_turns) == (1, 1)
    engine = Scripted(([30], False))
    greedy.regenerate([ids], [mask], engine, 64, 1)
    assert engine.caps == [1]  # max_new_tokens


def test_an_engine_returning_more_than_the_cap_is_an_error():
    with pytest.raises(RuntimeError, match="cap of 2"):
        greedy.regenerate([[1, 2, 3]], [[0, 1, 1]], Scripted(([5, 6, 7], False)), 3, None)
    with pytest.raises(ValueError, match="without loss-mask"):
        greedy.regenerate([[1, 2]], [[0, 0]], Scripted(), 8, None)


def test_stop_ids_come_from_the_generation_config(tmp_path):
    model = builders.build_tiny_llama(tmp_path / "m", hidden_size=64, num_layers=2, num_heads=2,
                                  num_kv_heads=1, intermediate_size=128)
    assert greedy.stop_token_ids(model) == [1, 6]  # <|eos|>, <|end|>


@pytest.mark.vllm
def test_vllm_replies_are_the_targets_greedy_replies(tmp_path):
    """vLLM (CPU, float32) generates what transformers' greedy decoding does, and a reply that
    ends at a stop token keeps it."""
    from transformers import AutoModelForCausalLM

    model_dir = builders.build_tiny_llama(tmp_path / "m", num_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(7, 512, (n,), generator=g).tolist() for n in (5, 17, 40, 9)]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    # A random target rarely emits its real stop tokens: use a token of its own reply instead.
    stop = expected[1][5]
    saved = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    try:
        options = EngineOptions(target=str(model_dir), dtype="float32", max_model_len=256,
                                max_num_seqs=2, gpu_memory_utilization=0.5)
        engine = greedy.VllmReplies(options, [stop], max_num_batched_tokens=64)
        try:
            replies = engine(prompts, [12] * len(prompts))
        finally:
            engine.shutdown()
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved
    for reference, (reply, stopped) in zip(expected, replies, strict=True):
        cut = reference.index(stop) + 1 if stop in reference else len(reference)
        assert reply == reference[:cut]
        assert stopped == (stop in reference)
    assert replies[1][1] and replies[1][0][-1] == stop


# --------------------------------------------------------------------------- tool traces (issue 31)
# prompt 10 | reply 20 21 9 (a call) | tool result 12 13 | reply 22 9 | user 14 | reply 23 9
TRACE_IDS = [10, 20, 21, 9, 12, 13, 22, 9, 14, 23, 9]
TRACE_MASK = [0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1]
TRACE_TOOLS = [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]  # tokenize's marks: the result after reply 1


def test_a_different_call_ends_the_sample_before_the_recorded_tool_result():
    engine = Scripted(([30, 9], True))
    new_ids, new_masks, stats = greedy.regenerate([TRACE_IDS], [TRACE_MASK], engine, 64, None,
                                                      [TRACE_TOOLS])
    assert engine.prompts == [[10]]  # nothing is generated after a result that answers another call
    assert new_ids == [[10, 30, 9]] and new_masks == [[0, 1, 1]]
    assert (stats.replies, stats.tool_stops, stats.dropped_turns) == (1, 1, 2)


def test_the_same_call_keeps_its_recorded_result_and_the_sample_goes_on():
    engine = Scripted(([20, 21, 9], True), ([31, 9], True), ([32, 9], True))
    new_ids, new_masks, stats = greedy.regenerate([TRACE_IDS], [TRACE_MASK], engine, 64, None,
                                                      [TRACE_TOOLS])
    assert engine.prompts[1] == [10, 20, 21, 9, 12, 13]
    assert new_ids == [[10, 20, 21, 9, 12, 13, 31, 9, 14, 32, 9]]
    assert new_masks == [[0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1]]
    assert (stats.replies, stats.tool_stops, stats.dropped_turns) == (3, 0, 0)


def test_without_tool_marks_every_reply_is_regenerated():
    engine = Scripted(([30, 9], True), ([31, 9], True), ([32, 9], True))
    _, _, stats = greedy.regenerate([TRACE_IDS], [TRACE_MASK], engine, 64, None)
    assert (stats.replies, stats.tool_stops) == (3, 0)
