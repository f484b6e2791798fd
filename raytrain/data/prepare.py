"""`raytrain prepare`: documents -> byte-level BPE tokenizer -> packed sequences -> Parquet / WebDataset shards + manifest.

Layout written under `out`:
    tokenizer.json
    prepare.yaml                the resolved settings
    train/shard-00000.parquet   columns: sample_id int64, tokens fixed_size_list<int32>[seq_len+1]
    train/shard-00000.tar       WebDataset: <sample_id>.tokens.npy per sample, same rows in the same order
    train/_written/             one record per shard file written (sha256 of its rows and of its bytes):
                                a re-run skips shard files already written and verified
    train/manifest.json         written last: a split without it is incomplete and is refused
    train/provenance/           each row's documents (docs-*.parquet per partition, spans-*.parquet per shard;
                                raytrain/data/provenance.py)
    val/...
    report.json, report.md, doc_lengths.png, review_sample.jsonl
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, Optional

import yaml
from pydantic import Field

from raytrain import storage
from raytrain.config import Section, key_rows, load_tree
from raytrain.data import manifest as mf
from raytrain.data import pipeline, provenance
from raytrain.data.corpus import BUILTIN
from raytrain.data.examples import COLUMNS, plain_text
from raytrain.data.report import write_report
from raytrain.data.shards import SHARD_LAYOUT, WRITTEN  # noqa: F401 - where callers have always found them
from raytrain.errors import UserError

EOT = "<|endoftext|>"


class DecontaminateSection(Section):
    tasks: list[str] = Field(default_factory=list, description="lm-evaluation-harness tasks whose documents must not be trained on: documents sharing a long n-gram with them are dropped (counted)")
    files: list[str] = Field(default_factory=list, description="evaluation files (.txt a document per line, .jsonl, .parquet) treated like tasks")
    include_path: Optional[str] = Field(None, description="a directory of your own lm-eval task YAMLs (as eval.include_path)")
    ngram: int = Field(13, ge=1, description="words in a shared n-gram that marks a document contaminated (GPT-3 and lm-eval use 13)")


class PrepareConfig(Section):
    inputs: list[str] = Field(default_factory=lambda: ["python-docs"], min_length=1,
                              description="local or s3:// files, globs or directories of .txt / .jsonl / .parquet, or the built-in corpus 'python-docs'")
    out: str = Field("data/python-docs", description="output dataset URI (local path or s3://)")
    formats: list[Literal["parquet", "webdataset"]] = Field(default_factory=lambda: ["parquet"], min_length=1,
                                                           description="shard formats to write (both allowed; same samples, same order)")
    tokenizer: Optional[str] = Field(None, description="existing tokenizer.json, or a local Hugging Face tokenizer directory, to use instead of training one")
    vocab_size: int = Field(2048, ge=260, description="tokens of a trained tokenizer (ignored with `tokenizer`)")
    special_tokens: list[str] = Field(default_factory=list, description="extra special tokens for a trained tokenizer (eot_token is always one)")
    eot_token: str = Field(EOT, description="end-of-text token placed between packed documents")
    tokenizer_sample_docs: int = Field(20_000, ge=0, description="train the tokenizer on this many train documents drawn by hash with the seed (and at most 200 MB of text); 0: all")
    seq_len: int = Field(128, ge=2, description="tokens per training sequence (rows hold seq_len+1: inputs and the next-token targets); a run's model.seq_len must equal it")
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="share of the documents held out for validation, chosen by hash with the seed")
    shard_rows: int = Field(1024, ge=1, description="sequences per shard file")
    text_mode: Literal["file", "line"] = Field("file", description="plain-text inputs: one document per file, or per non-blank line")
    invalid_utf8: Literal["replace", "drop"] = Field("replace", description="documents with invalid UTF-8: replace the bad bytes (U+FFFD) or drop the document (counted)")
    partition_mb: float = Field(8.0, gt=0, description="input MB per output partition: the unit of de-duplication, tokenizing and packing (one task each, its memory grows with it); part of what the output depends on, never the cluster")
    engine: Literal["auto", "local", "ray"] = Field("auto", description="run every stage as one Ray Data pipeline on the cluster's CPUs (ray), in this process (local), or ray for inputs of 32 MB and more (auto)")
    min_chars: int = Field(1, ge=0, description="documents shorter than this (after normalising) are dropped (counted)")
    max_doc_chars: int = Field(0, ge=0, description="documents longer than this are dropped (counted); 0: no limit")
    near_dup_threshold: float = Field(0.9, gt=0.0, le=1.0, description="MinHash Jaccard above which a document is a near duplicate; 1.0 disables")
    pii_scrub: bool = Field(False, description="replace e-mail addresses, phone numbers and IPv4 addresses (counted)")
    review_samples: int = Field(20, ge=0, description="documents written to review_sample.jsonl for a person to read")
    text_field: str = Field("text", description="JSONL field / Parquet column holding the text")
    max_chars: int = Field(3_000_000, ge=1, description="cap on the built-in corpus size")
    format: Literal["text", "prompt_completion", "chat"] = Field("text", description="text: documents for pre-training (every token learned); prompt_completion / chat: JSONL fine-tuning examples, written with a loss mask (1 on completions / assistant turns) and segment ids per example")
    prompt_field: str = Field("prompt", description="format=prompt_completion: the JSONL field holding the prompt (not learned)")
    completion_field: str = Field("completion", description="format=prompt_completion: the JSONL field holding the completion (learned)")
    messages_field: str = Field("messages", description="format=chat: the JSONL field holding the OpenAI-shape list of {role, content} messages")
    chat_template: Optional[str] = Field(None, description="format=chat: a Jinja chat template (as in transformers); null: the tokenizer's own (a Hugging Face tokenizer directory), else raytrain's default (the one `raytrain serve` uses)")
    pack: bool = Field(True, description="examples: several whole examples per sequence (true) or one, padded (false); an example is never split across sequences")
    too_long: Literal["truncate", "drop"] = Field("truncate", description="examples longer than seq_len+1 tokens: cut to it or leave out (either is counted in the report)")
    decontaminate: DecontaminateSection = Field(default_factory=DecontaminateSection, description="drop training documents that share an n-gram with evaluation data (raytrain/data/contamination.py)")
    provenance: bool = Field(True, description="write each packed row's documents (source file, record, token span) beside the shards, for `raytrain data trace`, and the inputs' sha256 for lineage (raytrain/data/provenance.py)")
    seed: int = Field(0, ge=0, lt=2**32, description="the hash seed of the validation split and the tokenizer's sample")


def reference_markdown() -> str:
    """Every prepare key with type, default and meaning (docs/CONFIG.md's last table; `raytrain config --reference`)."""
    rows = [f"| `{k}` | `{t}` | `{d}` | {m} |" for k, t, d, m in key_rows(PrepareConfig)]
    return "\n".join(["## `raytrain prepare` keys", "", "Set in a YAML file (`raytrain prepare --config FILE`) or as "
                      "overrides (`raytrain prepare inputs=[docs] seq_len=1024`).", "",
                      "| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""])


def load_prepare_config(path: Optional[str], overrides: list[str]) -> PrepareConfig:
    """Prepare settings: a YAML file (optional) + dotted overrides, validated (raytrain.config.load_tree)."""
    return load_tree(path, overrides, root=PrepareConfig, what="prepare",
                     top_level="of prepare keys (inputs:, out:, ...)")


def train_tokenizer(docs: list[str], vocab_size: int, special_tokens: list[str] = (EOT,)):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(dict.fromkeys(special_tokens)),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def load_tokenizer(uri: str):
    """A tokenizer.json (local or s3://) or a local Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer

    uri = storage.absolute(uri)
    if not storage.is_remote(uri) and os.path.isdir(uri):
        if os.path.exists(os.path.join(uri, "tokenizer.json")):
            uri = os.path.join(uri, "tokenizer.json")
        else:
            from transformers import AutoTokenizer

            try:
                hf = AutoTokenizer.from_pretrained(uri, local_files_only=True)
            except Exception as e:  # noqa: BLE001 - transformers raises many kinds
                raise UserError(f"tokenizer {uri}: not a Hugging Face tokenizer directory ({str(e).splitlines()[0]})") from None
            if not getattr(hf, "is_fast", False):
                raise UserError(f"tokenizer {uri}: only fast (tokenizers-backed) tokenizers are supported")
            return hf.backend_tokenizer
    try:
        return Tokenizer.from_str(storage.read_text(uri))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed file
        raise UserError(f"tokenizer {uri}: not a tokenizer.json ({str(e).splitlines()[0]})") from None


def prepare(cfg: PrepareConfig, log=print) -> dict:
    out = storage.absolute(cfg.out)
    # Re-running over an earlier output: its manifests go first, so a crash midway can never leave an
    # old manifest vouching for new shards.
    for split in ("train", "val"):
        storage.delete_file(storage.join(out, split, mf.MANIFEST))

    if cfg.format != "text" and any(spec in BUILTIN for spec in cfg.inputs):
        raise UserError(f"format={cfg.format} needs JSONL inputs of examples; the built-in corpus is plain text")

    def make_tokenizer(sample):
        if sample is not None and cfg.format != "text":
            sample = [plain_text(d) for d in sample]  # the tokenizer learns the examples' text, not their JSON
        tok = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else train_tokenizer(
            sample, cfg.vocab_size, [cfg.eot_token, *cfg.special_tokens])
        eot_id = tok.token_to_id(cfg.eot_token)
        if eot_id is None:
            raise UserError(f"tokenizer has no {cfg.eot_token} token; set eot_token= to its end-of-text token")
        storage.write_text(storage.join(out, "tokenizer.json"), tok.to_str())
        storage.write_text(storage.join(out, "prepare.yaml"), yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return tok, eot_id

    r = pipeline.run(cfg, out, make_tokenizer, log)
    tok, counts, splits = r["tok"], r["counts"], r["splits"]
    for split, (reused, written) in r["reuse"].items():
        if reused:
            log(f"prepare: {storage.join(out, split)}: {reused} shard file(s) already written and verified, "
                f"{written} written")
    extra = {"vocab_size": tok.get_vocab_size(), "eot_id": r["eot_id"], "tokenizer": "../tokenizer.json"}
    report: dict[str, Any] = {"out": out, "documents": counts["input"], "kept": counts["kept"],
                              "vocab_size": tok.get_vocab_size(), "engine": r["engine"]}
    window = cfg.seq_len + 1
    for split in ("train", "val"):
        s = splits.get(split, {"documents": 0, "rows": 0})
        shards = {fmt: r["shards"][split].get(fmt, []) for fmt in dict.fromkeys(cfg.formats)}
        manifest = {
            "format": cfg.formats[0],
            "formats": list(shards),
            "seq_len": cfg.seq_len,
            "num_samples": int(s["rows"]),
            "num_tokens": int(s["rows"]) * window,
            "shards": shards,
            **extra,
            "documents": int(s["documents"]),
            "prepare": cfg.model_dump(mode="json"),
        }
        prov = r["provenance"][split]
        manifest["provenance"] = {"version": provenance.VERSION, "inputs": r["inputs"],  # None: provenance=false
                                  "documents": prov["documents"] if cfg.provenance else [],
                                  "spans": prov["spans"] if cfg.provenance else []}
        if not manifest["provenance"]["spans"]:
            manifest["provenance"]["spans_missing"] = (
                "it was prepared with provenance=false" if not cfg.provenance else
                f"format={cfg.format} rows hold whole examples; their spans are not recorded" if cfg.format != "text"
                else "the split has no rows")
        ex = {k: int(s.get(k, 0)) for k in pipeline.EXAMPLE_STATS}
        if cfg.format != "text":  # fine-tuning rows: tokens | loss_mask | segment_ids (raytrain/data/examples.py)
            manifest.update({"columns": list(COLUMNS), "example_format": cfg.format, **ex})
        # Manifest last: its presence is what makes the split complete. No timestamp: the same inputs and
        # settings give the same bytes.
        storage.write_text(storage.join(out, split, mf.MANIFEST), json.dumps(manifest, indent=1))
        report[split] = {"documents": int(s["documents"]), "samples": int(s["rows"]),
                         "tokens": int(s["rows"]) * window, "shards": len(shards[cfg.formats[0]]),
                         **(ex if cfg.format != "text" else {})}
    if r.get("decontaminate"):
        report["decontaminate"] = r["decontaminate"]
    data_report = write_report(out, counts, splits, report, cfg.seed, near=r["near"])
    report["filters"] = dict(counts)
    report["ks_train_val_doc_tokens"] = data_report["ks_train_val_doc_tokens"]
    return report
