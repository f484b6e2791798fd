"""Fine-tuning examples for `raytrain prepare format=prompt_completion|chat`: records -> one canonical document each,
documents -> token ids with a loss mask (chat through transformers' apply_chat_template), packed or padded rows.

A record becomes a compact JSON document (`{"p": prompt, "c": completion}` or `{"m": [[role, content], ...]}`, each
text normalised), so the pipeline's normalisation, filters and exact / near de-duplication work on whole examples.
Each row of an example dataset holds three equal-length columns: `tokens`, `loss_mask` (1: a token to learn, i.e.
a completion or an assistant turn; 0: prompt and padding) and `segment_ids` (1, 2, ... per example in the row,
0 for padding), which the trainer uses to keep attention and positions inside an example (data.document_mask).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Optional

import numpy as np

from raytrain.data.quality import normalise
from raytrain.errors import UserError

FORMATS = ("prompt_completion", "chat")
COLUMNS = ("tokens", "loss_mask", "segment_ids")
ROLES = ("system", "user", "assistant", "tool", "developer")


def record_to_doc(rec: dict, *, fmt: str, fields: dict, where: str) -> str:
    """One JSONL record -> its canonical document (normalised texts, compact JSON). Malformed records are a one-line
    UserError naming the file and line: a fine-tuning set with holes is a data bug, never silently skipped."""
    if fmt == "prompt_completion":
        p, c = fields["prompt_field"], fields["completion_field"]
        for name, key in ((p, "prompt_field"), (c, "completion_field")):
            if name not in rec:
                raise UserError(f"input {where}: record has no {name!r} field (set {key}=...)")
        prompt, completion = normalise(str(rec[p])), normalise(str(rec[c]))
        if not completion:
            raise UserError(f"input {where}: empty completion ({c!r}): there is nothing to learn from this record")
        return json.dumps({"p": prompt, "c": completion}, ensure_ascii=True, separators=(",", ":"))
    m = fields["messages_field"]
    msgs = rec.get(m)
    if not isinstance(msgs, list) or not msgs:
        raise UserError(f"input {where}: record has no {m!r} list of messages (set messages_field=...)")
    out = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise UserError(f"input {where}: message {i} needs 'role' and 'content'")
        if msg["role"] not in ROLES:
            raise UserError(f"input {where}: message {i} has unknown role {msg['role']!r} (allowed: {', '.join(ROLES)})")
        out.append([msg["role"], normalise(str(msg["content"] or ""))])
    if not any(r == "assistant" and t for r, t in out):
        raise UserError(f"input {where}: no assistant message with content: there is nothing to learn from this record")
    return json.dumps({"m": out}, ensure_ascii=True, separators=(",", ":"))


def plain_text(doc: str) -> str:
    """The text of a document, for training a tokenizer on examples."""
    d = json.loads(doc)
    return d["p"] + "\n" + d["c"] if "p" in d else "\n".join(t for _, t in d["m"])


class Encoder:
    """Documents -> (token ids int32, loss mask uint8). prompt_completion: prompt (0), completion (1), eot (1: the
    model learns to stop). chat: the conversation rendered by the chat template; tokens that start inside an
    assistant turn are learned, and an eot (learned after an assistant turn) closes the example."""

    def __init__(self, tok, *, eot_id: int, chat_template: Optional[str]):
        self.tok, self.eot_id, self.template = tok, eot_id, chat_template
        self._hf = None

    def __call__(self, doc: str) -> tuple[np.ndarray, np.ndarray]:
        d = json.loads(doc)
        if "p" in d:
            # The prompt as any document starts (a tokenizer's BOS, if it adds one); the completion continues it.
            p, c = self.tok.encode(d["p"]).ids, self.tok.encode(d["c"], add_special_tokens=False).ids
            ids = np.array([*p, *c, self.eot_id], np.int32)
            mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(c) + 1, np.uint8)])
            return ids, mask
        msgs = [{"role": r, "content": t} for r, t in d["m"]]
        text, spans = self.render(msgs)
        enc = self.tok.encode(text, add_special_tokens=False)
        starts = np.array([a for a, _ in enc.offsets], np.int64)
        mask = np.zeros(len(enc.ids), np.uint8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        last = 1 if msgs[-1]["role"] == "assistant" else 0
        return np.array([*enc.ids, self.eot_id], np.int32), np.concatenate([mask, np.array([last], np.uint8)])

    def render(self, msgs: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of its assistant turns: each turn is what rendering up
        to it adds to the rendering of the turns before it with the generation prompt."""
        text, spans = self._apply(msgs, False), []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before, upto = self._apply(msgs[:i], True), self._apply(msgs[:i + 1], False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise UserError("chat_template: it does not render a conversation as the rendering of its first turns "
                                "followed by the next one, so the assistant turns cannot be located; use a template "
                                "that appends turns")
            spans.append((len(before), len(upto)))
        return text, spans

    def _apply(self, msgs: list[dict], gen: bool) -> str:
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast(tokenizer_object=self.tok)
        try:
            return self._hf.apply_chat_template(msgs, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=gen)
        except Exception as e:  # noqa: BLE001 - jinja raises many kinds
            raise UserError(f"chat_template: it failed to render a conversation ({str(e).splitlines()[0]}); fix "
                            "the template (prepare key chat_template)") from None


def pack(examples: list[tuple[np.ndarray, np.ndarray]], *, window: int, packed: bool, too_long: str,
         pad_id: int, counts: Counter) -> np.ndarray:
    """Examples -> rows [n, 3, window] (tokens, loss_mask, segment_ids), in the given order. packed: examples go one
    after another into a row while they fit whole (never split across rows); else one example per row. The rest
    of a row is padding (pad_id, mask 0, segment 0). Longer than a row: truncated to it or dropped, counted."""
    rows: list[np.ndarray] = []
    cur = np.zeros((3, window), np.int32)
    used, seg = 0, 0

    def flush():
        nonlocal cur, used, seg
        if used:
            cur[0, used:] = pad_id
            counts["pad_tokens"] += window - used
            rows.append(cur)
        cur, used, seg = np.zeros((3, window), np.int32), 0, 0

    for ids, mask in examples:
        if len(ids) > window:
            if too_long == "drop":
                counts["dropped_too_long"] += 1
                continue
            ids, mask = ids[:window], mask[:window]
            counts["truncated"] += 1
        if not mask[1:].any():  # the first token is never a target: nothing would be learned
            counts["dropped_no_learned_tokens"] += 1
            continue
        if used + len(ids) > window or (used and not packed):
            flush()
        seg += 1
        cur[0, used:used + len(ids)], cur[1, used:used + len(ids)], cur[2, used:used + len(ids)] = ids, mask, seg
        used += len(ids)
        counts["examples"] += 1
        counts["learned_tokens"] += int(mask[1:].sum())
        counts["masked_tokens"] += len(ids) - int(mask[1:].sum())
    flush()
    return np.stack(rows) if rows else np.zeros((0, 3, window), np.int32)


def chat_template(configured: Optional[str], tokenizer: Optional[str]) -> str:
    """The template chat examples are rendered with: the prepare config's, else the Hugging Face tokenizer
    directory's own, else raytrain's default (the one `raytrain serve` falls back to, so training and serving
    render conversations alike)."""
    if configured:
        return configured
    import os

    if tokenizer and os.path.isdir(tokenizer):
        jinja = os.path.join(tokenizer, "chat_template.jinja")
        if os.path.exists(jinja):
            with open(jinja) as f:
                return f.read()
        cfg_path = os.path.join(tokenizer, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                found = json.load(f).get("chat_template")
            if isinstance(found, str) and found:
                return found
    from raytrain.serving.openai_api import DEFAULT_CHAT_TEMPLATE

    return DEFAULT_CHAT_TEMPLATE
