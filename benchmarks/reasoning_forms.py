"""What ``tokenize.reasoning`` trains, template against as_generated (issue 43), printed.

    .venv/bin/python -m benchmarks.reasoning_forms [--embedded MODEL_DIR]

1. Per family style (the project-made Kimi-, Qwen3- and DeepSeek-R1-style templates of
   tests/chat_families.py): a two-turn record with reasoning in both replies, each sample
   rendered with ``[[...]]`` around what it trains.
2. A mixed file (tests/test_tool_traces.py's: plain chat, reasoning, tool calls, records tokenize
   skips) tokenized both ways: reasoning tokens trained, samples, tokens, and the prompt overhead.
3. With ``--embedded MODEL_DIR`` (a thinking target, e.g. runs/_assets/tiny-thinking): the same
   counts on the embedded set with reasoning (runs/_assets/conversations-reasoning.jsonl).

The test helpers are imported from tests/ (the families' templates live there).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from chat_families import family_tokenizer  # noqa: E402
from test_tool_traces import marked, mixed_records  # noqa: E402

from draftline.tiny import tokenizer  # noqa: E402
from draftline.tokenize.windows import encode_windows  # noqa: E402
from draftline.tokenize.conversations import DEFAULT_ROLES  # noqa: E402
from draftline.tokenize.encode import Budget, TokenizeSettings, tokenize_source  # noqa: E402
from draftline.tokenize.sources import open_source  # noqa: E402

FAMILIES = ("kimi", "qwen3", "deepseek_r1")
TWO_TURNS = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "reasoning_content": "Two plus three is five.", "content": "5."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "reasoning_content": "Five times four is twenty.", "content": "20."},
]


def renders(tok) -> None:
    for setting in ("template", "as_generated"):
        windows = encode_windows(tok, TWO_TURNS, 4096, reasoning=setting)
        print(f"  -- tokenize.reasoning={setting}: {len(windows.samples)} sample(s), "
              f"{windows.num_reasoning_tokens} reasoning tokens trained")
        for i, sample in enumerate(windows.samples):
            print(f"  sample {i}: {marked(tok, sample.input_ids, sample.loss_mask)!r}")


def counts(path: Path, model_dir: Path, workers: int) -> None:
    rows = {}
    for setting in ("template", "as_generated"):
        result = tokenize_source(open_source(path), TokenizeSettings(
            model_dir=str(model_dir), seq_length=4096, roles=DEFAULT_ROLES, workers=workers,
            budget=Budget(1.0), reasoning=setting))
        m = result.tally.manifest()
        rows[setting] = m
        extra = m["as_generated"] or {}
        print(f"  {setting:>12}: {m['num_conversations']} conversations ({m['num_skipped']} records skipped), "
              f"{len(result.offsets) - 1} samples, {len(result.input_ids)} tokens, "
              f"{int(result.loss_mask.sum())} trained; reasoning: {m['reasoning_trained']['replies']} of "
              f"{m['reasoning']['replies']} replies, {m['reasoning_trained']['tokens']} tokens"
              + (f"; {extra['extra_samples']} extra samples, {extra['extra_prefix_tokens']} prompt tokens "
                 f"= {extra['overhead_fraction']:.1%} of the tokens" if extra else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedded", type=Path, help="a thinking target's directory (its tokenizer)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = tokenizer.build_tokenizer(Path(tmp) / "base")
        for family in FAMILIES:
            tok = family_tokenizer(base, family)
            print(f"== {family}-style template: a two-turn record, [[trained]]")
            renders(tok)
        mixed = Path(tmp) / "mixed.jsonl"
        mixed.write_text("".join(json.dumps(r) + "\n" for r in mixed_records()))
        for family in FAMILIES:
            model = Path(tmp) / family
            family_tokenizer(base, family).save_pretrained(str(model))
            print(f"== the mixed file ({len(mixed_records())} records), {family}-style template")
            counts(mixed, model, 1)
    if args.embedded:
        path = REPO / "runs/_assets/conversations-reasoning.jsonl"
        print(f"== {path.relative_to(REPO)}, {args.embedded}'s template")
        counts(path, args.embedded, 2)


if __name__ == "__main__":
    main()
