"""The text a generation answers (cut at end-of-text or a stop string), and that text streamed token by token as soon as nothing can take it back."""

from __future__ import annotations

from typing import Callable, Optional

# How many earlier tokens decode with a token to find its share of the text: enough for a character split
# over several byte-level tokens to land whole in one piece.
PIECE_WINDOW = 6


def token_piece(tok, ids: list[int], i: int) -> str:
    """Token i's share of the decoded text of `ids` (depends on ids[:i + 1] only, so a streamed prefix's
    pieces are the whole text's first pieces)."""
    s = max(0, i - PIECE_WINDOW)
    before = tok.decode(ids[s:i])
    return tok.decode(ids[s:i + 1])[len(before):]


def pieces(tok, ids: list[int]) -> list[str]:
    """Every token's piece; they concatenate to the decoded text."""
    return [token_piece(tok, ids, i) for i in range(len(ids))]


def finish(tok, gen: list[int], stops: list[str]) -> dict:
    """The continuation up to the end-of-text token or the earliest stop string (neither is returned)."""
    eot = tok.eos_token_id
    reason, count = "length", len(gen)
    if eot in gen:
        count = gen.index(eot) + 1
        gen, reason = gen[:count - 1], "stop"
    kept = all_pieces = pieces(tok, gen)
    text = "".join(kept)
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        cut, kept, at = min(hits), [], 0
        for piece in all_pieces:  # the tokens before the stop string's start, the last one's text cut there
            if at >= cut:
                break
            kept.append(piece[:cut - at])
            at += len(piece)
        gen, count, reason = gen[:len(kept)], len(kept), "stop"
    return {"continuation": "".join(kept), "gen_ids": gen, "gen_pieces": kept, "completion_tokens": count,
            "finish_reason": reason}


def held_from(text: str, stops: list[str]) -> int:
    """Where the text may still turn into a stop string: the earliest position whose tail is the start of
    one (len(text) when none is), so everything before it is final."""
    longest = max((len(s) for s in stops), default=0)
    for p in range(max(0, len(text) - longest + 1), len(text)):
        if any(s.startswith(text[p:]) for s in stops):
            return p
    return len(text)


class RowFeed:
    """One request's generated tokens -> the pieces `finish` will answer, sent to `sink` as
    {"pieces": [...]} once final. It stops at the end-of-text token or a completed stop string: whatever the
    result then cuts or keeps comes with the result, which says how many pieces the stream already had."""

    def __init__(self, tok, *, eot: Optional[int], stops: list[str], sink: Callable[[dict], None]):
        self.tok, self.eot, self.stops, self.sink = tok, eot, stops, sink
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self.text, self.ends, self.sent, self.done = "", [], 0, False

    def add(self, token: int) -> None:
        if self.done:
            return
        if token == self.eot:
            self.done = True
            return
        self.ids.append(token)
        self.pieces.append(token_piece(self.tok, self.ids, len(self.ids) - 1))
        self.text += self.pieces[-1]
        self.ends.append(len(self.text))
        if any(s in self.text for s in self.stops):
            self.done = True  # the result cuts the text there
            return
        hold = held_from(self.text, self.stops)
        first = self.sent
        # A piece is final when it ends before any stop string can start (and, if empty, starts before it):
        # `finish` keeps whole every piece that starts before the cut and ends at or before it.
        while self.sent < len(self.ends) and self.ends[self.sent] <= hold and (
                self.pieces[self.sent] or self.ends[self.sent] < hold):
            self.sent += 1
        if self.sent > first:
            self.sink({"pieces": self.pieces[first:self.sent]})


class BatchStreamer:
    """The streamer `generate()` calls: put(prompt ids) once, then put(the batch's next tokens) per step; each
    row's token goes to its RowFeed (None: a request that is not streamed)."""

    def __init__(self, feeds: list[Optional[RowFeed]]):
        self.feeds, self.prompt_seen = feeds, False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for feed, t in zip(self.feeds, value.reshape(-1).tolist()):
            if feed is not None:
                feed.add(int(t))

    def end(self) -> None:
        pass


def streamer(feeds: list[Optional[RowFeed]]) -> Optional[BatchStreamer]:
    """A streamer for generate(), or None when no row is streamed (generate() then runs as without one)."""
    return BatchStreamer(feeds) if any(f is not None for f in feeds) else None
