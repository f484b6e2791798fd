"""Document text rules for `raytrain prepare`: normalisation and PII scrubbing (the drop and de-duplication steps are
data/stages.py's; `stages.clean_documents` runs them all in one process)."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

_SPACES = re.compile(r"[ \t\f\v\u00a0]+")
_BLANK_LINES = re.compile(r"\n{3,}")
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
_IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")
_PHONE = re.compile(r"(?<!\w)(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?!\w)")


def normalise(text: str) -> str:
    """Unicode NFC, one space for runs of spaces/tabs, no trailing spaces, at most one blank line."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(_SPACES.sub(" ", line).rstrip() for line in text.split("\n"))
    return _BLANK_LINES.sub("\n\n", text).strip()


def scrub_pii(text: str, counts: Counter) -> str:
    for name, pattern, token in (("pii_email", _EMAIL, "<EMAIL>"), ("pii_ip", _IPV4, "<IP>"),
                                 ("pii_phone", _PHONE, "<PHONE>")):
        text, n = pattern.subn(token, text)
        counts[name] += n
    return text
