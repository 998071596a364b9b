"""One self-contained HTML page per run: training, acceptance, coverage, extraction, provenance.

Figures are drawn with matplotlib's Agg backend (no display), written as PNGs next to the page
and embedded in it as data URIs, so ``index.html`` alone can be mailed or attached to CI.

Per-TTT-step training curves: the train manifest keeps the total loss per step
(``metrics.loss_history``) and per-TTT metrics only for the last step and the validation
pass, so the per-step per-TTT curves come from ``metrics.history`` when a trainer records it,
else from the trainer's log lines (``train N/M steps (..) | loss .. | ttt0 loss .. acc .. cond .. | ..``)
of the last run in ``<run_dir>/logs/train.log``.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import re
from pathlib import Path
from typing import Any

from draftline.tokenize import generated

import matplotlib

matplotlib.use("Agg")  # headless: the report runs in CI and on GPU hosts without a display
import matplotlib.pyplot as plt  # noqa: E402

# The train loop's progress line ("train N/M steps (rate, ETA) | loss .. | ttt0 .. | lr"), and the
# "step N/M loss .. | .. | lr" of logs written before progress had one owner.
STEP_LINE = re.compile(r"(?:train (\d+)/(\d+) steps \([^)]*\) \||step (\d+)/(\d+)) loss ([0-9.eE+-]+) "
                       r"\| (.*?) \| lr")
TTT_PART = re.compile(r"ttt(\d+) loss ([0-9.eE+-]+) acc ([0-9.eE+-]+) cond ([0-9.eE+-]+)")
COLORS = {"eagle3": "#1f77b4", "bigram": "#ff7f0e", "most_frequent": "#7f7f7f"}
# One name per method on the page: evaluate's result keys -> what the page calls them.
METHODS = {"eagle3": "EAGLE-3 draft", "bigram": "bigram baseline", "most_frequent": "most-frequent baseline"}


def method(name: str) -> str:
    return METHODS.get(name, name)


def ordered(offline: dict) -> list[str]:
    """The draft first, then the baselines from the highest tau down (cards, tables, figure)."""
    return sorted(offline, key=lambda name: (name != "eagle3", -offline[name]["tau"]))


@dataclasses.dataclass
class Figure:
    name: str  # file name, e.g. "acceptance.png"
    png: bytes
    caption: str


# --------------------------------------------------------------------------- training curves


def parse_train_log(text: str, total_steps: int) -> list[dict]:
    """Per-step metrics of the last run in a train log: [{"step", "loss", "loss_0", "full_acc_0", ...}].

    A log accumulates runs; a new run starts where the step number does not increase, and
    only the last run with ``total_steps`` steps counts.
    """
    runs: list[list[dict]] = []
    for match in STEP_LINE.finditer(text):
        step, total = int(match[1] or match[3]), int(match[2] or match[4])
        row: dict[str, float] = {"step": step, "loss": float(match[5])}
        for part in TTT_PART.finditer(match[6]):
            k = part[1]
            row.update({f"loss_{k}": float(part[2]), f"full_acc_{k}": float(part[3]),
                        f"cond_acc_{k}": float(part[4])})
        if not runs or total != runs[-1][-1]["total"] or step <= runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append({**row, "total": total})
    matching = [r for r in runs if r[-1]["total"] == total_steps]
    return [{k: v for k, v in row.items() if k != "total"} for row in (matching[-1] if matching else [])]


def training_history(train: dict, log_path: Path) -> tuple[list[dict], str]:
    """Per-step per-TTT metrics and where they came from."""
    metrics = train["metrics"]
    if metrics.get("history"):
        return [{"step": i + 1, **row} for i, row in enumerate(metrics["history"])], "train manifest"
    if log_path.exists():
        rows = parse_train_log(log_path.read_text(errors="replace"), int(metrics["total_steps"]))
        if rows:
            return rows, str(log_path)
    return [], "not recorded"


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def training_figure(train: dict, history: list[dict], source: str, dpi: int) -> Figure:
    """Loss (total and per TTT step) and accuracy per TTT step over optimizer steps."""
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=dpi)
    losses = train["metrics"]["loss_history"]
    steps = list(range(1, len(losses) + 1))
    ax_loss.plot(steps, losses, color="#cccccc", lw=0.8, label="total (raw)")
    ax_loss.plot(steps, moving_average(losses, 10), color="black", lw=1.5, label="total (10-step mean)")
    ttt = sorted({int(k.split("_")[-1]) for row in history for k in row if k.startswith("full_acc_")})
    xs = [row["step"] for row in history]
    for k in ttt:
        color = f"C{k}"  # one color per TTT step in both panels
        ax_loss.plot(xs, moving_average([row[f"loss_{k}"] for row in history], 10), lw=1.2,
                     color=color, label=f"TTT step {k} (10-step mean)")
        ax_acc.plot(xs, moving_average([row[f"full_acc_{k}"] for row in history], 10), lw=1.6,
                    color=color, label=f"TTT step {k} accuracy")
        ax_acc.plot(xs, moving_average([row[f"cond_acc_{k}"] for row in history], 10), lw=1,
                    ls="--", color=color, label=f"TTT step {k} conditional")
    ax_loss.set(xlabel="optimizer step", ylabel="KL loss", title="training loss")
    ax_acc.set(xlabel="optimizer step", ylabel="accuracy", ylim=(0, 1),
               title="accuracy per TTT step (train batches)")
    if not ttt:
        ax_acc.text(0.5, 0.5, "per-TTT history not recorded", ha="center", transform=ax_acc.transAxes)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    caption = (f"Total loss per step from the train manifest; per-TTT-step curves from {source}. "
               "Accuracy = speculators' full_acc (all earlier steps right too); dashed = cond_acc.")
    return Figure("training.png", _png(fig), caption)


# --------------------------------------------------------------------------- acceptance


def acceptance_figure(evaluation: dict, dpi: int) -> Figure:
    """Per-position conditional acceptance and tau, trained draft vs baselines, with CIs."""
    offline = evaluation["offline"]
    names = ordered(offline)
    k = int(evaluation["k"])
    fig, (ax_pos, ax_tau) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=dpi,
                                         gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        result = offline[name]
        xs = [j + 1 + (i - (len(names) - 1) / 2) * width for j in range(k)]
        values = [0.0 if v != v else v for v in result["acceptance"]]  # NaN (never reached) -> 0
        bounds = list(zip(values, result["acceptance_ci"], strict=True))
        errors = [[max(0.0, v - lo) for v, (lo, _) in bounds], [max(0.0, hi - v) for v, (_, hi) in bounds]]
        ax_pos.bar(xs, values, width, yerr=errors, capsize=3, label=method(name),
                   color=COLORS.get(name, None))
    ax_pos.set(xlabel="draft position j", ylabel="P(accept j | accepted 1..j-1)", ylim=(0, 1.05),
               xticks=range(1, k + 1), title="per-position conditional acceptance (offline)")
    labels, taus, errs, colors = [], [], [[], []], []
    for name in names:
        r = offline[name]
        labels.append(method(name)), taus.append(r["tau"]), colors.append(COLORS.get(name, "#999999"))
        errs[0].append(r["tau"] - r["tau_ci"][0]), errs[1].append(r["tau_ci"][1] - r["tau"])
    measured = evaluation.get("in_vllm")
    if measured:
        r = measured["vllm"]
        labels.append(f"{method('eagle3')} in vLLM"), taus.append(r["tau"]), colors.append("#2ca02c")
        errs[0].append(r["tau"] - r["tau_ci"][0]), errs[1].append(r["tau_ci"][1] - r["tau"])
    ax_tau.bar(range(len(labels)), taus, yerr=errs, capsize=4, color=colors)
    ax_tau.set_xticks(range(len(labels)), labels, rotation=25, ha="right", fontsize=8)
    ax_tau.set(ylabel="tau (tokens per verification step)", ylim=(1, k + 1),
               title=f"mean acceptance length tau, k={k}")
    for ax in (ax_pos, ax_tau):
        ax.grid(alpha=0.3, axis="y")
    ax_pos.legend(fontsize=8)
    caption = (f"Error bars: {int(evaluation['ci']['level'] * 100)}% {evaluation['ci']['method']} "
               f"({evaluation['ci']['resamples']} resamples). tau = accepted draft tokens + 1 per step.")
    return Figure("acceptance.png", _png(fig), caption)


# --------------------------------------------------------------------------- coverage, extraction


def coverage_figure(token_freq: Any, draft_vocab_size: int, dpi: int) -> Figure:
    """Share of masked target tokens covered by the N most frequent ids, and the chosen N."""
    import torch

    freq = torch.sort(token_freq.double(), descending=True).values
    cumulative = (freq.cumsum(0) / freq.sum()).tolist()
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=dpi)
    ax.plot(range(1, len(cumulative) + 1), cumulative, color="#1f77b4")
    chosen = cumulative[min(draft_vocab_size, len(cumulative)) - 1]
    ax.axvline(draft_vocab_size, color="#d62728", ls="--")
    ax.annotate(f"draft vocab {draft_vocab_size}: {chosen:.1%}", (draft_vocab_size, chosen),
                textcoords="offset points", xytext=(8, -14), fontsize=8)
    ax.set(xscale="log", xlabel="most frequent target ids kept", ylabel="masked tokens covered",
           ylim=(0, 1.02), title="draft vocabulary coverage (training data counts)")
    ax.grid(alpha=0.3)
    return Figure("coverage.png", _png(fig), "Cumulative share of assistant (masked) tokens "
                  "covered by the most frequent target ids; the dashed line is the draft vocabulary.")


def extraction_figure(extract: dict, dpi: int) -> Figure:
    """Tokens per shard, and seconds per shard where the manifest records them."""
    shards = extract["shards"]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=dpi)
    timed = all("seconds" in s for s in shards)
    values = [s["tokens"] / s["seconds"] if timed else s["tokens"] for s in shards]
    ax.bar(range(len(shards)), values, color="#9467bd")
    ax.set(xlabel="shard", ylabel="tokens/s" if timed else "tokens",
           title="extraction per shard" + ("" if timed else " (no per-shard timing recorded)"))
    ax.grid(alpha=0.3, axis="y")
    return Figure("extraction.png", _png(fig), "Per-shard throughput: tokens / seconds of that "
                  "shard's generate calls, shards in extraction order. The run's overall rate is lower: "
                  "it counts from before the engine started (the target's load) to the last shard, "
                  "with the writes of the shards between." if timed else
                  "Tokens per shard; the extract manifest records only the run's overall tokens/s.")


# --------------------------------------------------------------------------- HTML


def table(rows: list[list[Any]], header: list[str]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return html.escape(str(v))
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def figure_html(figure: Figure) -> str:
    data = base64.b64encode(figure.png).decode()
    return (f'<figure><img alt="{html.escape(figure.name)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(figure.caption)}</figcaption></figure>")


def ci(values: list[float]) -> str:
    return f"[{values[0]:.3f}, {values[1]:.3f}]"


def acceptance_rows(evaluation: dict) -> list[list[Any]]:
    rows = []
    for name in ordered(evaluation["offline"]):
        r = evaluation["offline"][name]
        rows.append([method(name), "offline (stored states)", r["tau"], ci(r["tau_ci"]),
                     ", ".join(f"{a:.3f}" for a in r["acceptance"]), r["steps"]])
    measured = evaluation.get("in_vllm")
    if measured:
        for label, r in (("vLLM's own speculative decoding, held-out prompts", measured["vllm"]),
                         ("offline on the same replies", measured["offline"])):
            rows.append([method("eagle3"), label, r["tau"], ci(r["tau_ci"]),
                         ", ".join(f"{a:.3f}" for a in r["acceptance"]), r["steps"]])
    return rows


def benchmark_rows(evaluation: dict) -> list[list[Any]]:
    """Per standard benchmark: the run's draft, every compared draft, then the baselines."""
    standard = evaluation.get("benchmarks")
    if not standard:
        return []
    compared = evaluation.get("compared") or {}
    rows = []
    for name, found in standard["per_benchmark"].items():
        drafts = [("this run's draft", found)]
        drafts += [(label, (other.get("benchmarks") or {}).get("per_benchmark", {}).get(name))
                   for label, other in compared.items()]
        for label, r in drafts:
            if not r:
                continue
            speedup = r.get("speedup")
            rows.append([name, label, r["vllm"]["tau"], ci(r["vllm"]["tau_ci"]),
                         ", ".join(f"{a:.3f}" for a in r["vllm"]["acceptance"]),
                         f"{speedup['ratio']:.2f}x ({speedup['with_draft_tokens_per_s']:.0f} / "
                         f"{speedup['plain_tokens_per_s']:.0f} tok/s)" if speedup else "not measured",
                         f"{r['prompts']} / {r['turns']}"])
        for baseline, b in found["baselines"].items():
            rows.append([name, method(baseline) + " (offline, same replies)", b["tau"], ci(b["tau_ci"]),
                         ", ".join(f"{a:.3f}" for a in b["acceptance"]), "", f"{found['prompts']} / {found['turns']}"])
    return rows


def benchmark_html(evaluation: dict) -> str:
    rows = benchmark_rows(evaluation)
    if not rows:
        return ""
    standard = evaluation["benchmarks"]
    return ("<h2>Standard benchmarks (vLLM)</h2>"
            f"<p>vLLM's own greedy speculative decoding of each benchmark's prompts, k = {standard['k']}, "
            f"up to {standard['max_new_tokens']} new tokens a reply, all prompts of a turn in one batch; "
            "tau = tokens per verification step, CIs: percentile bootstrap over prompts (an MT-Bench "
            "question's two turns are one unit); speed-up: output tokens/s with the draft / without it on "
            "this machine's engine. Tools: "
            + ("the chat template's" if standard["tools_rendered_by_template"] else
               "in a system turn (the template renders none)") + ".</p>"
            + table(rows, ["benchmark", "draft", "tau", "CI", "acceptance by position", "speed-up",
                           "prompts / turns"]))


def agreement_rows(evaluation: dict) -> list[list[Any]]:
    measured = evaluation.get("in_vllm")
    if not measured:
        return []
    rows = [["vLLM's tau inside the offline CI, same held-out replies", "tau",
             measured["vllm"]["tau"], ci(measured["offline"]["tau_ci"]),
             "yes" if measured["vllm_tau_inside_offline_ci"] else "no"]]
    for j, (rate, bounds, inside) in enumerate(zip(
            measured["vllm"]["acceptance"], measured["offline"]["acceptance_ci"],
            measured["vllm_acceptance_inside_offline_ci"], strict=True), 1):
        rows.append([f"vLLM's acceptance at position {j} inside the offline CI", f"p{j}", rate,
                     ci(bounds), "yes" if inside else "no"])
    d = measured["paired_difference"]
    rows.append([f"vLLM vs offline on the {measured['shared_steps']} shared steps (paired)",
                 d["statistic"], d["difference"], ci(d["ci"]), "yes" if d["agrees"] else "no"])
    rows.append([f"replies vLLM decoded to other text (of {measured['replies']})", "count",
                 measured["text_mismatches"], "", "yes" if not measured["text_mismatches"] else "no"])
    rows.append([f"replies where one verdict differed, a draft near-tie (of {measured['replies']})",
                 "count", measured.get("diverging_replies", 0), "", "info"])
    return rows


def provenance_rows(manifests: dict[str, dict]) -> list[list[Any]]:
    """One row per stage: its config hash, git revision, python and wall time."""
    return [[stage, m["provenance"]["config_sha256"][:16], m["provenance"]["git"],
             m["provenance"]["python"], m["provenance"]["host"], m.get("wall_seconds", "")]
            for stage, m in manifests.items()]


def _patches(applied: list[dict] | None) -> str:
    return ", ".join(f"{x['name']} (sha256 {x.get('sha256', '')[:12]})" for x in (applied or [])) \
        or "none recorded"


def _stack(provenance: dict) -> tuple[str, str, str]:
    versions = ", ".join(f"{k} {v}" for k, v in sorted(provenance["versions"].items()))
    return versions, _patches(provenance.get("patches")), _patches(provenance.get("vllm_patches"))


def stack_rows(manifests: dict[str, dict]) -> list[list[Any]]:
    """Package versions and both patch queues as applied, once per distinct stack (stages listed)."""
    stacks: dict[tuple[str, str, str], list[str]] = {}
    for stage, manifest in manifests.items():
        stacks.setdefault(_stack(manifest["provenance"]), []).append(stage)
    return [[", ".join(stages), *stack] for stack, stages in stacks.items()]


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;
max-width:1180px;color:#222;padding:0 16px}
h1{font-size:1.6em;margin-bottom:0}h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
.sub{color:#666;margin-top:4px}table{border-collapse:collapse;margin:8px 0 16px;font-size:0.86em}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}th{background:#f4f4f4}
figure{margin:8px 0 20px}img{max-width:100%;border:1px solid #eee}figcaption{color:#555;font-size:0.85em}
.kpi{display:inline-block;margin:6px 18px 6px 0;padding:8px 14px;background:#f6f8fa;border-radius:6px}
.kpi b{font-size:1.4em;display:block}.kpi small{display:block;font-size:0.62em;font-weight:normal;
color:#555;max-width:300px}.ok{color:#1a7f37}.bad{color:#cf222e}code{font-size:0.9em}
"""


def gate_text(gate: dict) -> str:
    """evaluate's gate verdict (draftline.evaluate.gate.judge) for the card: what it held the draft to."""
    baseline, floor = gate.get("baseline") or {}, gate.get("floor") or {}
    held = []
    if baseline.get("checked"):
        held.append(f"CI above {html.escape(method(baseline['best']))}'s")
    if floor.get("checked"):
        held.append(f"&ge; floor {floor['tau_min']}")
    verdict = ("<span class='ok'>passed</span>" if gate.get("passed") else
               "<span class='bad'>FAILED</span>") if gate.get("checked") else "not checked"
    note = "; ".join(held)
    if baseline and not baseline.get("checked"):
        note = "; ".join([*held, f"baseline check off: {html.escape(baseline['off_because'])}"])
    return f"{verdict}<small>{note}</small>"


def speedup_text(speedup: dict | None, exp: str) -> str:
    """benchmarks.serve's result for this draft (draftline.evaluate.speedup.read), for the card."""
    if not speedup:
        return (f"not measured<small><code>python -m benchmarks.serve --exp {html.escape(exp)}</code>"
                "</small>")
    rates = speedup["tokens_per_second"]
    note = (f"{html.escape(speedup['device'])}: {rates['with draft']:.0f} vs {rates['target alone']:.0f} "
            f"output tok/s, median of {speedup['repeats']}")
    if speedup["device"].startswith("CPU"):
        note += "; on CPU this checks the path, no speed-up is expected"
    return f"{speedup['speedup']:.2f}x<small>{note}</small>"


def extraction_text(extract: dict) -> str:
    overall, in_generate = extraction_rates(extract)
    alone = f"{in_generate:.0f} tok/s in generate calls alone" if in_generate else ""
    if not overall:  # every shard was on disk already: this run extracted nothing
        return (f"{in_generate:.0f} tok/s<small>in generate calls alone, as the shards recorded them; "
                f"this run resumed all {len(extract['shards'])} shards</small>" if in_generate else
                f"resumed<small>all {len(extract['shards'])} shards were on disk</small>")
    return f"{overall:.0f} tok/s<small>whole run, target load included" + (f"; {alone}" if alone else "") + "</small>"


def time_split_text(split: dict | None) -> str:
    """The manifest's time split in words: forward, waiting on the capture path, writing."""
    if not split:
        return "not recorded (replicas or slices made the shards, or all were on disk)"
    where = ("beside the forwards, on the engine's rank 0" if split["writing_overlaps_forward"]
             else "between the forwards, in this process")
    verdict = ("capture-bound: the forwards waited on the capture path" if split["capture_bound"]
               else "forward-bound: the capture path kept up")
    return (f"forward {split['forward_s']:.1f} s, waiting on copies or the writer "
            f"{split['waiting_s']:.1f} s, writing {split['writing_s']:.1f} s ({where}); "
            f"{verdict} ({split['capture_share']:.0%} of the time; writer {split['writer']})")


def extraction_rates(extract: dict) -> tuple[float, float | None]:
    """The run's overall tokens/s (from before the engine started to the last shard) and the
    generate calls' alone (the shards' tokens over their seconds), where the shards record them."""
    timed = [s for s in extract["shards"] if "seconds" in s]
    in_generate = (sum(s["tokens"] for s in timed) / sum(s["seconds"] for s in timed)
                   if timed and sum(s["seconds"] for s in timed) > 0 else None)
    return float(extract["tokens_per_second"]), in_generate


def kpis(evaluation: dict, data: dict, extract: dict, speedup: dict | None = None, exp: str = "") -> str:
    off = evaluation["offline"]
    items = [(f"tau, {method(name)}", f"{off[name]['tau']:.3f} {ci(off[name]['tau_ci'])}") for name in ordered(off)]
    versus = evaluation.get("versus_best_baseline")
    if versus:
        items.append((f"draft minus {method(versus['baseline'])}",
                      f"{versus['difference']:+.3f} {ci(versus['ci'])}<small>tau, paired over the same "
                      "held-out samples</small>"))
    items += [("speed-up in vLLM", speedup_text(speedup, exp)),
              ("draft vocab coverage", f"{data['draft_vocab_coverage']:.1%}"),
              ("extraction", extraction_text(extract)),
              ("gate", gate_text(evaluation.get("gate") or {}))]
    return "".join(f"<div class='kpi'>{html.escape(label)}<b>{value}</b></div>" for label, value in items)


def draft_html(evaluation: dict) -> str:
    """The draft's path: the run's link (runs/<EXP>/draft) with where it points, or the path."""
    path = f"<code>{html.escape(evaluation['draft'])}</code>"
    link = evaluation.get("draft_link")
    return f"<code>{html.escape(link)}</code> (&rarr; {path})" if link else path


def target_html(build: dict | None) -> str:
    if not build:
        return ""
    spec = build["spec"]
    return (f"<p class='sub'>target trained by draftline: {spec['steps']} steps of "
            f"{spec['batch_size']}x{spec['seq_length']} tokens, loss {build['loss_first']:.2f} &rarr; "
            f"{build['loss_last']:.2f}, held-out next-token accuracy "
            f"{build['held_out_next_token_accuracy']:.1%} ({build['seconds']:.0f} s)</p>")


def render(title: str, manifests: dict[str, dict], evaluation: dict, figures: dict[str, Figure],
           history_source: str, target_build: dict | None = None, speedup: dict | None = None,
           exp: str = "") -> str:
    data, extract, train = manifests["regenerate"], manifests["extract"], manifests["train"]
    overall, in_generate = extraction_rates(extract)
    metrics = train["metrics"]
    ttt = sorted({int(k.split("_")[-1]) for k in metrics["final"] if k.startswith("loss_")})
    ttt_rows = [[f"TTT step {k}", metrics["final"].get(f"loss_{k}", ""),
                 metrics["final"].get(f"full_acc_{k}", ""),
                 (metrics.get("validation") or {}).get(f"loss_{k}", ""),
                 (metrics.get("validation") or {}).get(f"full_acc_{k}", ""),
                 (metrics.get("validation") or {}).get(f"cond_acc_{k}", "")] for k in ttt]
    vllm = evaluation.get("vllm_load")
    vllm_html = "<p>vLLM load check skipped.</p>" if not vllm else (
        f"<p>vLLM {html.escape(manifests['evaluate']['provenance']['versions'].get('vllm', '?'))} "
        f"parses the saved draft as <code>{html.escape(str(vllm['architectures']))}</code> "
        f"(aux layers {vllm['eagle_aux_hidden_state_layer_ids']}, draft vocab "
        f"{vllm['draft_vocab_size']}, k={vllm['num_speculative_tokens']}), and its loader "
        f"(<code>{html.escape(vllm['model_class'])}</code>) placed {len(vllm['placed'])} saved "
        f"tensors by value into {len(vllm['parameters'])} parameters; ignored by design: "
        f"{html.escape(', '.join(vllm['ignored_by_vllm']) or 'none')}.</p>")
    skipped = manifests["evaluate"].get("skipped") or []
    sections = [
        f"<h1>{html.escape(title)}</h1><p class='sub'>target "
        f"<code>{html.escape(str(extract['target']))}</code>"
        f" &middot; draft {draft_html(evaluation)} &middot; k = {evaluation['k']}"
        f" &middot; {evaluation['held_out_samples']} held-out samples</p>" + target_html(target_build),
        kpis(evaluation, data, extract, speedup, exp),
        "<h2>Training</h2>", figure_html(figures["training"]),
        table(ttt_rows, ["", "final loss", "final accuracy", "validation loss",
                         "validation accuracy", "validation cond. accuracy"]),
        table([["steps", metrics["steps"]], ["tokens/s", metrics.get("tokens_per_second") or ""],
               ["seconds/step", metrics.get("seconds_per_step") or ""],
               ["per-TTT curves from", history_source]], ["training", "value"]),
        "<h2>Acceptance</h2>", figure_html(figures["acceptance"]),
        table(acceptance_rows(evaluation),
              ["draft", "measured", "tau", "CI", "acceptance by position", "steps"]),
        "<p>Alignment: " + html.escape(evaluation["alignment"]) + ". Baselines: "
        + html.escape(evaluation["baselines_from"]) + ".</p>",
        table(agreement_rows(evaluation), ["check", "statistic", "value", "CI", "agrees"])
        if agreement_rows(evaluation) else "",
        benchmark_html(evaluation),
        table([[s["what"], s["reason"]] for s in skipped], ["skipped", "why"]) if skipped else "",
        "<h2>Draft vocabulary</h2>", figure_html(figures["coverage"]),
        table([["draft vocab / target vocab",
                f"{data['draft_vocab_size']} / {data['target_vocab_size']}"],
               ["replies", "the target's own (regenerated)" if data["replies"] == "target"
                else "the data's (as tokenized)"],
               ["coverage of masked data tokens", f"{data['draft_vocab_coverage']:.2%}"],
               ["coverage of the target's greedy tokens (held-out)",
                f"{evaluation['draft_vocab_coverage_of_greedy']:.2%}"]], ["", "value"]),
        "<h2>Reasoning</h2>",
        table([list(row) for row in generated.describe(manifests["tokenize"], data)] or
              [["tokenize.reasoning", "not recorded (a tokenize run before the setting)"]], ["", "value"]),
        "<h2>Extraction</h2>", figure_html(figures["extraction"]),
        table([["tokens", extract["num_tokens"]], ["samples", extract["num_samples"]],
               ["shards", len(extract["shards"])],
               ["tokens/s, whole run (from before the target loaded to the last shard)",
                overall or "none extracted: this run resumed every shard"],
               ["tokens/s, generate calls alone (the shards' tokens / their seconds; the chart)",
                in_generate or "not recorded"],
               ["where the run's seconds went (one engine)", time_split_text(extract.get("time_split"))],
               ["resumed shards", extract.get("resumed_shards", "")],
               ["bytes per token on disk", extract["bytes_per_token"]["on_disk"]],
               ["wall seconds", extract.get("wall_seconds", "")]], ["extraction", "value"]),
        "<h2>Loadability</h2>", vllm_html,
        "<h2>Provenance</h2>",
        table(stack_rows(manifests), ["stages", "versions", "speculators patches applied",
                                      "vLLM patches applied"]),
        table(provenance_rows(manifests), ["stage", "config sha256", "git", "python", "host", "wall s"]),
    ]
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{STYLE}</style></head><body>{''.join(sections)}</body></html>\n")
