"""Tokenising very long documents in pieces, with the same ids as tokenising them whole.

Why: `tokenizers` keeps per-byte alignment data for a whole input, so one 50 MB document needs
about 5 GB inside a single encode call (measured: 5.3 GB peak RSS for a 50 MB jsonl line), and a
single call runs on one thread. A document longer than PIECE_CHARS characters is therefore cut
into pieces of at most about PIECE_CHARS characters, which are encoded in ordinary batches (at
most BATCH_CHARS characters per encode call, spread over the --workers threads) and whose ids
are concatenated.

Where to cut, so that the ids are identical to tokenising the whole text: just before a single
space that follows a non-space character and precedes a non-space character ("word| word").
For byte-level BPE tokenizers (GPT-2, GPT-NeoX, Llama 3, ...) that is always a pre-token
boundary: their split patterns only ever put a space at the start of a pre-token or inside a
run of whitespace, and BPE merges never cross pre-tokens; the patterns look ahead (`\\s+(?!\\S)`)
but never behind, and the text on both sides of the cut is unchanged, so both halves split
exactly as they do inside the whole. Normalizers such as NFC do not join a character with a
following space either.

Other tokenizers may differ (a normalizer that prepends "▁" to every input, one that strips
spaces, an added token containing a space), so every cut is also verified: the ~200 characters
on each side are encoded joined and apart, and a cut whose ids differ is not used (the next
candidate is tried). A document in which no verified cut is found within MAX_FAILED_CHECKS
tries is encoded whole from there on, as is a stretch longer than PIECE_CHARS that holds no
candidate at all (e.g. 1 MB without a space): correct ids first, bounded memory where possible.
"""
from __future__ import annotations

PIECE_CHARS = 100_000      # documents longer than this are tokenised in pieces of about this size
CHECK_CHARS = 200          # context on each side of a cut for its verification
MAX_FAILED_CHECKS = 16     # per document: after so many rejected cuts, the rest stays whole


class PieceCutter:
    """Cuts long texts into pieces whose concatenated ids equal those of the whole text."""

    def __init__(self, encoder, piece_chars: int = PIECE_CHARS):
        """encoder: anything with encode_many(texts) -> ids (data_tools/encoders.py), or a
        `tokenizers` Tokenizer."""
        if piece_chars < 2:
            raise ValueError(f"piece_chars must be at least 2, not {piece_chars}")
        from .encoders import TokenizersEncoder
        self.encoder = encoder if hasattr(encoder, "encode_many") else TokenizersEncoder(encoder)
        self.piece_chars = piece_chars
        self.cut_documents = 0       # documents tokenised in more than one piece
        self.uncut_documents = 0     # long documents (or their tails) that had to stay whole

    def _candidates_before(self, text: str, low: int, high: int):
        """Cut positions in (low, high], nearest to `high` first: a single space between two
        non-space characters."""
        i = text.rfind(" ", low + 1, high + 1)
        while i > low:
            if not text[i - 1].isspace() and i + 1 < len(text) and not text[i + 1].isspace():
                yield i
            i = text.rfind(" ", low + 1, i)

    def _candidates_after(self, text: str, low: int):
        i = text.find(" ", low + 1)
        while i != -1:
            if not text[i - 1].isspace() and i + 1 < len(text) and not text[i + 1].isspace():
                yield i
            i = text.find(" ", i + 1)

    def _verified(self, text: str, start: int, cut: int) -> bool:
        left = text[max(start, cut - CHECK_CHARS):cut]
        right = text[cut:cut + CHECK_CHARS]
        joined, a, b = self.encoder.encode_many([left + right, left, right])
        return joined == a + b

    def split(self, text: str) -> list[str]:
        """`text` itself when it is short, else its pieces (their concatenation is `text`)."""
        bounds = self.bounds(text)
        return [text] if len(bounds) == 2 else [text[a:b] for a, b in zip(bounds, bounds[1:])]

    def bounds(self, text: str) -> list[int]:
        """[0, cut_1, ..., len(text)]: where the pieces of `text` start and end (positions,
        not copies: a huge document is sliced only when its piece is encoded)."""
        if len(text) <= self.piece_chars:
            return [0, len(text)]
        bounds, start, failed = [0], 0, 0
        while len(text) - start > self.piece_chars and failed < MAX_FAILED_CHECKS:
            target = start + self.piece_chars
            cut = None
            # prefer the last candidate in the second half of the piece, else the first after it
            for candidates in (self._candidates_before(text, start + self.piece_chars // 2, target),
                               self._candidates_after(text, target)):
                for candidate in candidates:
                    if self._verified(text, start, candidate):
                        cut = candidate
                        break
                    failed += 1
                    if failed >= MAX_FAILED_CHECKS:
                        break
                if cut is not None or failed >= MAX_FAILED_CHECKS:
                    break
            if cut is None:
                break
            bounds.append(cut)
            start = cut
        bounds.append(len(text))
        if len(bounds) > 2:
            self.cut_documents += 1
        if len(text) - start > self.piece_chars:
            self.uncut_documents += 1
        return bounds
