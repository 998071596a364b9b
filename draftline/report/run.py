"""report's stage: the run's manifests (and the train log, the vocabulary counts) into one HTML
page and its PNG figures (``draftline.report.page``).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from draftline.pipeline import artifacts, config

UPSTREAM = ("tokenize", "regenerate", "extract", "prepare", "train", "evaluate")


def run(cfg: DictConfig) -> dict:
    from draftline import formats
    from draftline.evaluate import speedup as serving
    from draftline.report import page

    manifests = {stage: artifacts.read_manifest(config.stage_dir(cfg, stage)) for stage in UPSTREAM}
    evaluation = {**artifacts.read_json(config.stage_dir(cfg, "evaluate") / manifests["evaluate"]["results"]),
                  "gate": manifests["evaluate"]["gate"]}
    vocab = config.stage_dir(cfg, "regenerate") / manifests["regenerate"]["vocab"]
    token_freq = formats.load_token_freq(vocab)  # [target_vocab] masked-token counts
    history, source = page.training_history(manifests["train"], Path(cfg.run_dir) / "logs" / "train.log")
    dpi = int(cfg.report.dpi)
    figures = {
        "training": page.training_figure(manifests["train"], history, source, dpi),
        "acceptance": page.acceptance_figure(evaluation, dpi),
        "coverage": page.coverage_figure(token_freq, int(manifests["regenerate"]["draft_vocab_size"]), dpi),
        "extraction": page.extraction_figure(manifests["extract"], dpi),
    }
    out_dir = config.stage_dir(cfg, "report")
    for figure in figures.values():
        with artifacts.atomic_path(out_dir / figure.name) as tmp:
            tmp.write_bytes(figure.png)
    title = cfg.report.title or f"draftline run {cfg.exp}"
    # A target trained by draftline.cli.trained_target carries its build record.
    build = Path(manifests["extract"]["target"]) / "build.json"
    target_build = artifacts.read_json(build) if build.exists() else None
    # Name the draft by the run's link (runs/<EXP>/draft, what make serve serves) when it is that one.
    link = Path(cfg.run_dir) / "draft"
    if link.exists() and link.resolve() == Path(evaluation["draft"]).resolve():
        evaluation["draft_link"] = str(link)
    # benchmarks.serve's measurement of this very draft, when it ran (draftline.evaluate.speedup).
    speedup = serving.read(cfg.run_dir, evaluation["draft"])
    with artifacts.atomic_path(out_dir / "index.html") as tmp:
        tmp.write_text(page.render(title, manifests, evaluation, figures, source, target_build,
                                     speedup, str(cfg.exp)))
    files = ["index.html", *(f.name for f in figures.values())]
    return {
        "page": "index.html",
        "files": {name: artifacts.sha256_file(out_dir / name) for name in files},
        "training_history_source": source,
        "inputs": {f"{stage}_manifest_sha256":
                   artifacts.sha256_file(config.stage_dir(cfg, stage) / artifacts.MANIFEST)
                   for stage in UPSTREAM},
        "speedup": speedup,
        "skipped": ([] if history else [{"what": "per-TTT training curves", "reason": source}])
        + ([] if speedup else [{"what": "serving speed-up", "reason": "benchmarks.serve has not measured "
                                "this draft (python -m benchmarks.serve --exp " + str(cfg.exp) + ")"}]),
    }
