"""The data report of a prepared dataset (report.json, report.md, a review sample) and drift checks."""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

from raytrain import storage
from raytrain.errors import UserError

REPORT = "report.json"
HISTOGRAM = "doc_lengths.png"
MAX_LENGTH_SAMPLE = 20_000  # document lengths kept in report.json for later drift checks


def ks_statistic(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    if len(a) == 0 or len(b) == 0:
        return float("nan")
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, side="right") / len(a)
    cdf_b = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.max(np.abs(cdf_a - cdf_b)))


def length_stats(lengths) -> dict:
    x = np.asarray(lengths, float)
    if len(x) == 0:
        return {"documents": 0}
    return {"documents": int(len(x)), "tokens": int(x.sum()), "mean": float(x.mean()),
            "p50": float(np.percentile(x, 50)), "p95": float(np.percentile(x, 95)), "max": int(x.max())}


def split_stats(s: dict) -> dict:
    """Exact totals (documents, tokens, mean, max) and percentiles of the bottom-k length sample, which are
    approximate when the sample holds fewer documents than the split."""
    lens = [n for _, n in s.get("lengths", [])]
    out = {**length_stats(lens), "documents": s.get("documents", 0), "tokens": s.get("tokens", 0),
           "max": s.get("max", 0)}
    if out["documents"]:
        out["mean"] = out["tokens"] / out["documents"]
    if len(lens) < out["documents"]:
        out["approximate"] = ["p50", "p95"]
    return out


def write_report(out: str, counts: dict, splits: dict[str, dict], summary: dict, seed: int,
                 near: Optional[dict] = None) -> dict:
    """`splits`: per split the exact totals and the bottom-k samples of (hash draw, document length) and of
    (hash draw, text) that the pipeline merged from its partitions; `near`: the near-duplicate summary
    (settings, pairs, removed documents' Jaccard bins, review pairs), None when near-dedup is off."""
    doc_lengths = {name: [n for _, n in s.get("lengths", [])] for name, s in splits.items()}
    approx = any(len(doc_lengths[n]) < s.get("documents", 0) for n, s in splits.items())
    report = {
        "filters": dict(counts),
        "splits": {name: {**summary.get(name, {}), "doc_tokens": split_stats(s)} for name, s in splits.items()},
        "ks_train_val_doc_tokens": ks_statistic(doc_lengths.get("train", []), doc_lengths.get("val", [])),
        "ks_approximate": approx,
        "doc_token_lengths_sample": doc_lengths,
    }
    if summary.get("decontaminate"):  # what the contamination filter looked for (its drops are in filters)
        report["decontaminate"] = summary["decontaminate"]
    review = [{"text": t} for _, t in splits.get("train", {}).get("review", [])]
    if near is not None:
        report["near_duplicates"] = near_section(near, removed=counts.get("dropped_near_duplicate", 0))
        review += [{"text": a, "removed_as_near_duplicate_of": b, "jaccard": round(j, 4)}
                   for _, a, b, j in near["review"]]
    storage.write_text(storage.join(out, REPORT), json.dumps(report, indent=1))
    storage.write_text(storage.join(out, "review_sample.jsonl"), "".join(json.dumps(r) + "\n" for r in review))
    storage.write_bytes(storage.join(out, HISTOGRAM), histogram_png(doc_lengths))
    storage.write_text(storage.join(out, "report.md"), render_markdown(report))
    return report


def near_section(near: dict, *, removed: int) -> dict:
    """report.json's near-duplicate section: settings, pair counts, and removed documents by their best match's
    exact Jaccard (bins of 0.01 that hold any)."""
    bins = near["jaccard_bins"]
    return {"threshold": near["threshold"], "bands": near["bands"], "rows": near["rows"], "removed": removed,
            "candidate_pairs": near["candidate_pairs"], "verified_pairs": near["verified_pairs"],
            "rejected_pairs": near["rejected_pairs"],
            "removed_by_jaccard": {f"{i / len(bins):.2f}": n for i, n in enumerate(bins) if n},
            "s_curve": near["s_curve"]}


def histogram_png(doc_lengths: dict[str, list[int]]) -> bytes:
    """Document-length histogram per split, as fractions so splits of any size compare (log-spaced bins)."""
    import io

    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    everything = [n for lens in doc_lengths.values() for n in lens if n > 0]
    if everything:
        bins = np.geomspace(max(1, min(everything)), max(everything) + 1, 40)
        for name, lens in doc_lengths.items():
            if lens:
                ax.hist(lens, bins=bins, alpha=0.6, weights=np.full(len(lens), 1 / len(lens)),
                        label=f"{name} ({len(lens)} documents)")
        ax.set_xscale("log")
        ax.legend()
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("fraction of documents")
    ax.set_title("Document lengths")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def render_markdown(r: dict) -> str:
    lines = ["# Data report", "", "## Filters", "", "| step | documents |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in r["filters"].items()]
    lines += ["", "## Splits (document lengths in tokens)", "",
              "| split | documents | tokens | mean | p50 | p95 | max | sequences |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in r["splits"].items():
        d = s["doc_tokens"]
        if d.get("documents"):
            t = "~" if d.get("approximate") else ""
            lines.append(f"| {name} | {d['documents']} | {d['tokens']} | {d['mean']:.1f} | {t}{d['p50']:.0f} | "
                         f"{t}{d['p95']:.0f} | {d['max']} | {s.get('samples', '')} |")
    if any("learned_tokens" in s for s in r["splits"].values()):  # fine-tuning examples (format=prompt_completion|chat)
        lines += ["", "## Examples (loss mask)", "", "| split | examples | learned tokens | masked tokens | padding tokens |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {s.get('examples', 0)} | {s.get('learned_tokens', 0)} | {s.get('masked_tokens', 0)} | "
                  f"{s.get('pad_tokens', 0)} |" for name, s in r["splits"].items()]
        lines += ["", f"Truncated: {r['filters'].get('truncated', 0)}; dropped as too long: "
                  f"{r['filters'].get('dropped_too_long', 0)}; dropped with nothing to learn: "
                  f"{r['filters'].get('dropped_no_learned_tokens', 0)}."]
    ks = r["ks_train_val_doc_tokens"]
    approx = r.get("ks_approximate")
    lines += ["", f"Train / val drift (Kolmogorov-Smirnov statistic on document lengths): **{ks:.3f}** "
              "(0 = same distribution; above ~0.1 the splits look different)."
              + (f" Approximate: percentiles, the histogram and this statistic come from a sample of at most "
                 f"{MAX_LENGTH_SAMPLE} documents per split drawn by content hash." if approx else ""), "",
              f"![document lengths per split]({HISTOGRAM})", "",
              "A reproducible sample of documents for review is in `review_sample.jsonl`.", ""]
    if "near_duplicates" in r:
        lines += near_markdown(r["near_duplicates"])
    return "\n".join(lines)


def near_markdown(n: dict) -> list[str]:
    lines = ["## Near duplicates", "",
             f"MinHash LSH ({n['bands']} bands of {n['rows']} rows) proposed {n['candidate_pairs']} candidate pairs; "
             f"{n['verified_pairs']} had an exact shingle Jaccard >= {n['threshold']} (verified), "
             f"{n['rejected_pairs']} were rejected. {n['removed']} documents were removed; "
             "`review_sample.jsonl` shows a few beside the document that caused the removal.", "",
             "| best match's Jaccard | removed documents |", "| --- | --- |"]
    lines += [f"| {j} | {c} |" for j, c in n["removed_by_jaccard"].items()]
    lines += ["", "| pair's Jaccard | P(candidate) | P(removed) |", "| --- | --- | --- |"]
    lines += [f"| {p['jaccard']} | {p['candidate']:.3f} | {p['removed']:.3f} |" for p in n["s_curve"]]
    return lines + [""]


def compare(a: str, b: str, split: str = "train") -> dict:
    """Drift between two prepared datasets: KS statistic on their document-length samples."""
    out = {}
    reps = []
    for uri in (a, b):
        uri = storage.absolute(uri)
        rurl = storage.join(uri, REPORT)
        if not storage.exists(rurl):
            raise UserError(f"{uri} has no {REPORT}; prepare it with this version of raytrain first")
        reps.append(json.loads(storage.read_text(rurl)))
    la, lb = (r["doc_token_lengths_sample"].get(split, []) for r in reps)
    out["ks_doc_tokens"] = ks_statistic(la, lb)
    out["a"], out["b"] = length_stats(la), length_stats(lb)
    return out


def drift_verdict(ks: Optional[float]) -> str:
    if ks is None or ks != ks:
        return "unknown"
    return "similar" if ks < 0.1 else "different"
