"""The report stage on a synthetic run: log parsing, a self-contained page, headless rendering."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftline import formats
from draftline.report import page as report_page
from draftline.pipeline import artifacts, config

from conftest import compose
from draftline.evaluate.gate import judge

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LOG = """\
- step 1/3 loss 3.0 | ttt0 loss 1.0 acc 0.1 cond 0.1 | ttt1 loss 1.0 acc 0.0 cond 0.0 | lr 1e-4
- step 2/3 loss 2.0 | ttt0 loss 0.5 acc 0.5 cond 0.5 | ttt1 loss 1.5 acc 0.2 cond 0.4 | lr 1e-4
- step 1/2 loss 9.0 | ttt0 loss 9.0 acc 0.0 cond 0.0 | ttt1 loss 9.0 acc 0.0 cond 0.0 | lr 1e-4
- step 1/3 loss 2.5 | ttt0 loss 0.9 acc 0.2 cond 0.2 | ttt1 loss 1.6 acc 0.1 cond 0.5 | lr 1e-4
- step 2/3 loss 2.4 | ttt0 loss 0.8 acc 0.3 cond 0.3 | ttt1 loss 1.6 acc 0.1 cond 0.3 | lr 1e-4
- train 3/3 steps (5.98 steps/s, 2491 tok/s, ETA 0:00:00) | loss 2.3 | ttt0 loss 0.7 acc 0.4 cond 0.4 | ttt1 loss 1.6 acc 0.2 cond 0.5 | lr 1e-4
"""


def test_train_log_gives_the_last_complete_run():
    rows = report_page.parse_train_log(LOG, total_steps=3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] == 2.5 and rows[2]["full_acc_0"] == 0.4 and rows[1]["cond_acc_1"] == 0.3


def _result(tau: float, k: int = 2) -> dict:
    return {"tau": tau, "tau_ci": [tau - 0.05, tau + 0.05], "acceptance": [0.5, 0.4],
            "acceptance_ci": [[0.45, 0.55], [0.3, 0.5]], "steps": 100, "samples": 4}


def _provenance() -> dict:
    return {"config": {}, "config_sha256": "ab" * 32, "versions": {"vllm": "0.16.0", "torch": "2.10.0"},
            "patches": [{"name": "0001-x.diff", "sha256": "cd" * 32}],
            "vllm_patches": [{"name": "0002-v.diff", "sha256": "ef" * 32}], "git": "deadbeef", "python": "3.11",
            "host": "h"}


def _write(stage_dir: Path, manifest: dict) -> None:
    stage_dir.mkdir(parents=True, exist_ok=True)
    artifacts.write_json(stage_dir / artifacts.MANIFEST, {**manifest, "provenance": _provenance()})


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    """Manifests shaped like a real run's (k = 2), small enough to write by hand."""
    run = tmp_path / "run"
    save_file({formats.TOKEN_FREQ: torch.arange(64, 0, -1)}, str(tmp_path / "vocab.safetensors"))
    (run / "tokenize").mkdir(parents=True)
    shutil.copy(tmp_path / "vocab.safetensors", run / "tokenize/vocab.safetensors")
    _write(run / "tokenize", {"vocab": "vocab.safetensors", "draft_vocab_size": 16, "target_vocab_size": 64,
                              "draft_vocab_coverage": 0.5})
    _write(run / "regenerate", {"replies": "target", "vocab": "../tokenize/vocab.safetensors",
                                "draft_vocab_size": 16, "target_vocab_size": 64, "draft_vocab_coverage": 0.5})
    _write(run / "extract", {"target": "t", "num_tokens": 300, "num_samples": 3, "tokens_per_second": 1234.5,
                             "shards": [{"tokens": 200, "seconds": 0.5}, {"tokens": 100, "seconds": 0.25}], "resumed_shards": 0,
                             "bytes_per_token": {"on_disk": 2057.0},
                             "time_split": {"writer": "rank0", "forward_s": 81.9, "waiting_s": 0.2,
                                            "writing_s": 1.0, "writing_overlaps_forward": True,
                                            "capture_share": 0.0021, "capture_bound": False}})
    _write(run / "prepare", {})
    _write(run / "train", {"metrics": {"loss_history": [3.0, 2.0, 1.5], "total_steps": 3, "steps": 3,
                                       "final": {"loss_0": 0.7, "full_acc_0": 0.4, "loss_1": 1.6},
                                       "validation": {"loss_0": 0.8, "full_acc_0": 0.3, "cond_acc_0": 0.3}}})
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(draft / "model.safetensors"))
    results = {"draft": str(draft), "k": 2, "held_out_samples": 4, "alignment": "start t ...",
               "ci": {"method": "bootstrap over samples", "resamples": 100, "level": 0.95},
               "offline": {"eagle3": _result(1.9), "most_frequent": _result(1.1), "bigram": _result(1.4)},
               "versus_best_baseline": {"baseline": "bigram", "difference": 0.5, "ci": [0.4, 0.6]},
               "baselines_from": "training counts", "draft_vocab_coverage_of_greedy": 0.9,
               "in_vllm": {"vllm": _result(2.0), "offline": _result(2.0), "replies": 4, "shared_steps": 9,
                           "text_mismatches": 0, "diverging_replies": 0, "vllm_tau_inside_offline_ci": True,
                           "vllm_acceptance_inside_offline_ci": [True, True],
                           "paired_difference": {"statistic": "tau", "difference": 0.0,
                                                 "ci": [0.0, 0.0], "agrees": True}},
               "vllm_load": None}
    (run / "evaluate").mkdir()
    artifacts.write_json(run / "evaluate/results.json", results)
    gate = judge({"tau_min": 1.5}, results["offline"], "floors.json", {"enabled": True, "off_because": None})
    _write(run / "evaluate", {"results": "results.json", "skipped": [], "gate": gate})
    (run / "logs").mkdir()
    (run / "logs/train.log").write_text(LOG)
    return run


def test_report_is_one_self_contained_page(run_dir):
    from draftline.report.run import run

    cfg = compose("tiny", f"run_dir={run_dir}")
    fields = run(cfg)
    page = (run_dir / "report/index.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 4 and all(base64.b64decode(i).startswith(PNG_MAGIC) for i in images)
    assert not re.search(r'(src|href)="(?!data:)', page), "the page must not load anything"
    for name in ("training.png", "acceptance.png", "coverage.png", "extraction.png"):
        assert (run_dir / "report" / name).read_bytes().startswith(PNG_MAGIC)
    for text in ("1.900 [1.850, 1.950]", "1.400 [1.350, 1.450]", "1.100 [1.050, 1.150]", "0001-x.diff",
                 "0002-v.diff", "abababababababab", "passed", "CI above bigram baseline's",
                 "draft minus bigram baseline", "+0.500 [0.400, 0.600]",
                 "1234 tok/s", "400 tok/s in generate calls alone",
                 "forward 81.9 s, waiting on copies or the writer 0.2 s, writing 1.0 s (beside the "
                 "forwards, on the engine&#x27;s rank 0); forward-bound"):
        assert text in page, text
    assert fields["training_history_source"].endswith("train.log")
    assert "not measured" in page and fields["speedup"] is None
    assert "serving speed-up" in {s["what"] for s in fields["skipped"]}


def _text(page: str) -> str:
    return re.sub(r'src="data:image/png;base64,[^"]+"', "", page)


def test_the_page_has_one_name_per_method(run_dir):
    from draftline.report.run import run

    run(compose("tiny", f"run_dir={run_dir}"))
    page = _text((run_dir / "report/index.html").read_text())
    for key in ("eagle3", "most_frequent", "trained draft"):
        assert key not in page, key
    for name in report_page.METHODS.values():
        assert page.count(name) >= 2, name  # its card and its table row at least


def test_the_speed_up_shows_for_the_draft_it_was_measured_on(run_dir):
    from draftline.evaluate import speedup
    from draftline.report.run import run

    draft = Path(json.loads((run_dir / "evaluate/results.json").read_text())["draft"])
    measured = {"speedup": 0.93, "tokens_per_second": {"target alone": 100.0, "with draft": 93.0},
                "repeats": 3, "device": "CPU (2 cores)"}
    kept = speedup.record(run_dir, draft, measured)
    assert kept == config.speedup_file(run_dir)
    fields = run(compose("tiny", f"run_dir={run_dir}"))
    page = (run_dir / "report/index.html").read_text()
    assert "0.93x" in page and "CPU (2 cores): 93 vs 100 output tok/s, median of 3" in page
    assert "no speed-up is expected" in page and fields["speedup"]["speedup"] == 0.93
    # Another draft (retrained): the page no longer shows the old draft's figure.
    save_file({"w": torch.ones(2)}, str(draft / "model.safetensors"))
    fields = run(compose("tiny", f"run_dir={run_dir}"))
    assert fields["speedup"] is None and "not measured" in (run_dir / "report/index.html").read_text()
    speedup.record(run_dir, draft, {**measured, "speedup": 1.8, "device": "NVIDIA H200"})
    assert len(json.loads(kept.read_text())) == 2  # both drafts' measurements kept
    page = (run(compose("tiny", f"run_dir={run_dir}")) and (run_dir / "report/index.html").read_text())
    assert "1.80x" in page and "no speed-up is expected" not in page


def test_a_speed_up_measured_after_the_report_makes_it_stale(tmp_path):
    from draftline.cli import status
    from draftline.pipeline import deps

    cfg = compose("tiny", f"run_dir={tmp_path / 'run'}")
    files = config.stage_files(cfg, "report")
    assert files == status.stage_files(tmp_path / "run", "report") == [str(config.speedup_file(cfg.run_dir))]
    before = deps.current({"files": dict.fromkeys(files)})
    config.speedup_file(cfg.run_dir).parent.mkdir(parents=True)
    config.speedup_file(cfg.run_dir).write_text("{}")
    assert deps.differences(before, deps.current({"files": dict.fromkeys(files)})) == [f"files {files[0]} changed"]


def rendered_pixels(png: Path) -> dict:
    """What a reader of the screenshot would see, as numbers: how much of the page is not
    background, and how much of it is in colour (the figures' lines and bars, not text)."""
    from matplotlib import image

    pixels = torch.from_numpy(image.imread(str(png)))[..., :3].float()  # [H, W, 3] in 0..1
    ink = (pixels < 0.9).any(-1)
    colour = (pixels.max(-1).values - pixels.min(-1).values) > 0.25
    rows_with_colour = colour.any(1).nonzero().flatten()
    return {"height": pixels.shape[0], "ink": float(ink.float().mean()), "colour": float(colour.float().mean()),
            "colour_rows": [int(rows_with_colour.min()), int(rows_with_colour.max())]
            if len(rows_with_colour) else None}


# CI installs Debian's chromium and sets DRAFTLINE_REQUIRE_CHROMIUM=1: there the test must run.
@pytest.mark.skipif(shutil.which("chromium") is None and os.environ.get("DRAFTLINE_REQUIRE_CHROMIUM") != "1",
                    reason="Debian's chromium is not installed")
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    from draftline.report.run import run

    if shutil.which("chromium") is None:
        raise RuntimeError("DRAFTLINE_REQUIRE_CHROMIUM=1 but chromium is not on PATH")

    run(compose("tiny", f"run_dir={run_dir}"))
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", "--window-size=1280,2400", f"--screenshot={shot}",
                        (run_dir / "report/index.html").as_uri()],
                       check=True, capture_output=True, timeout=120)
    assert shot.read_bytes().startswith(PNG_MAGIC) and shot.stat().st_size > 50_000
    seen = rendered_pixels(shot)
    print(json.dumps({"screenshot_bytes": shot.stat().st_size, **seen}))
    assert seen["height"] == 2400 and seen["ink"] > 0.03, seen  # a page, not a blank or an error tab
    assert seen["colour"] > 0.005, seen  # the figures were decoded and drawn



def test_the_time_split_says_whether_the_capture_path_held_the_forwards_up():
    driver = {"writer": "driver", "forward_s": 10.0, "waiting_s": 0.0, "writing_s": 30.0,
              "writing_overlaps_forward": False, "capture_share": 0.75, "capture_bound": True}
    assert report_page.time_split_text(driver) == (
        "forward 10.0 s, waiting on copies or the writer 0.0 s, writing 30.0 s (between the "
        "forwards, in this process); capture-bound: the forwards waited on the capture path (75% "
        "of the time; writer driver)")
    assert report_page.time_split_text(None).startswith("not recorded")


def test_the_extraction_card_explains_its_two_rates():
    shards = [{"tokens": 200, "seconds": 0.5}, {"tokens": 100, "seconds": 0.25}]
    assert report_page.extraction_text({"tokens_per_second": 150.0, "shards": shards}) == (
        "150 tok/s<small>whole run, target load included; 400 tok/s in generate calls alone</small>")
    resumed = report_page.extraction_text({"tokens_per_second": 0.0, "shards": shards})
    assert resumed.startswith("400 tok/s") and "resumed all 2 shards" in resumed
    untimed = [{"tokens": 200}, {"tokens": 100}]
    assert report_page.extraction_text({"tokens_per_second": 150.0, "shards": untimed}) == (
        "150 tok/s<small>whole run, target load included</small>")


def test_the_benchmark_table_lists_each_draft_then_the_baselines():
    """Per benchmark: the run's draft, each compared draft (with its speed-up), the baselines."""
    from draftline.report import page

    def measured(tau):
        return {"tau": tau, "tau_ci": [tau - 0.1, tau + 0.1], "acceptance": [0.5, 0.25, 0.125]}

    found = {"prompts": 2, "turns": 4, "vllm": measured(1.8),
             "speedup": {"ratio": 1.25, "with_draft_tokens_per_s": 50.0, "plain_tokens_per_s": 40.0},
             "baselines": {"bigram": measured(1.2)}}
    other = {"prompts": 2, "turns": 4, "vllm": measured(1.4), "baselines": {}}
    evaluation = {"benchmarks": {"k": 3, "max_new_tokens": 32, "tools_rendered_by_template": False,
                                 "per_benchmark": {"mt_bench": found}},
                  "compared": {"speculators_trainer": {"benchmarks": {"per_benchmark": {"mt_bench": other}}}}}
    rows = page.benchmark_rows(evaluation)
    assert [r[1] for r in rows] == ["this run's draft", "speculators_trainer",
                                    page.method("bigram") + " (offline, same replies)"]
    assert rows[0][2] == 1.8 and rows[0][5].startswith("1.25x (50 / 40 tok/s)") and rows[1][5] == "not measured"
    html = page.benchmark_html(evaluation)
    assert "Standard benchmarks (vLLM)" in html and "in a system turn" in html
    assert page.benchmark_html({"benchmarks": None}) == ""
