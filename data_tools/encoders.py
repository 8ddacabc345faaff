"""Which tokenizer a preprocessing command line asks for, and the encoders that run it.

The tokenizer is decided by the files given, and `--tokenizer-type` (Megatron-LM's and
GPT-NeoX's names) is checked against them: a type that this tool cannot run exactly is
refused with the reason and the way out, never replaced by another tokenizer in silence.

    tokenizer.json:     --tokenizer / --tokenizer-model FILE-or-FOLDER   (HuggingFaceTokenizer)
                        --vocab-file tokenizer.json                      (NeoX's HFTokenizer)
    GPT-2 vocab/merges: --vocab-file vocab.json --merge-file merges.txt  (GPT2BPETokenizer,
                        NeoX's HFGPT2Tokenizer); "<|endoftext|>" is a special token, as in
                        GPT-2's tokenizer.json, so both routes give the same ids
    ids as text:        --tokenizer-type NullTokenizer --vocab-size N    (Megatron's: "3 1 4")

Encoders turn a list of texts into lists of ids:
- `TokenizersEncoder`: HF `tokenizers` (encode_batch_fast, threads in Rust), the reference;
- `TiktokenEncoder`: the same byte-level BPE run by OpenAI's `tiktoken` (several times faster
  on GPT-2 style vocabularies), built from the tokenizer.json's own vocabulary and used only
  once it has given the reference's ids on a probe text and on the corpus' first batch
  (preprocess.py makes that check; any difference falls back to `tokenizers`, with a note);
- `GigatokenEncoder`: the tokenizer.json run by `gigatoken` (Rust, its own thread pool; what
  Megatron-LM's preprocess_data_fast.py uses), ~15M tokens per CPU-second on GPT-2 and NeoX
  vocabularies here against tokenizers' ~0.5M; the default when installed, under the same two
  checks as tiktoken (a probe text at start, the corpus' first batch), falling back with a note;
- `NullEncoder`: Megatron's NullTokenizer.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_id.allocator import release_freed_memory, resident_bytes
from megatron_id.data.tokenizer import TokenizerError, byte_decoder, eod_id, load_tokenizer

# --tokenizer-type values: Megatron-LM's (tools/preprocess_data.py, TokenizerConfig) and
# GPT-NeoX's (tools/datasets/preprocess_data.py), each with what this tool does with it
JSON_TYPES = {"HuggingFaceTokenizer", "HFTokenizer"}               # a tokenizer.json
BPE_PAIR_TYPES = {"GPT2BPETokenizer", "HFGPT2Tokenizer"}           # vocab.json + merges.txt
SENTENCEPIECE_TYPES = {"SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                       "SPMTokenizer"}
REFUSED_TYPES = {
    "BertWordPieceLowerCase": "a WordPiece tokenizer for BERT-style models (this stack trains decoder-only "
                              "models); a BERT vocabulary converted to tokenizer.json runs with "
                              "--tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json",
    "BertWordPieceCase": "a WordPiece tokenizer for BERT-style models (this stack trains decoder-only models); "
                         "a BERT vocabulary converted to tokenizer.json runs with --tokenizer-type "
                         "HuggingFaceTokenizer --tokenizer-model tokenizer.json",
    "TikTokenizer": "Megatron's tiktoken vocabulary file format is not read here; pass the tokenizer.json of "
                    "the same vocabulary (--tokenizer-model), and --tokenizer-backend tiktoken for tiktoken's speed",
    "TiktokenTokenizer": "NeoX's TiktokenTokenizer downloads its encoding from the internet; pass the "
                         "tokenizer.json of the same vocabulary (--tokenizer-model), and --tokenizer-backend "
                         "tiktoken for tiktoken's speed",
    "CharLevelTokenizer": "NeoX's character-level tokenizer is not implemented here; train a byte-level "
                          "tokenizer.json with `python -m data_tools.train_tokenizer` instead",
    "MultimodalTokenizer": "multimodal tokenizers are not for pretraining text",
    "NullMultimodalTokenizer": "multimodal tokenizers are not for pretraining text",
    "SFTTokenizer": "SFT conversations are not pretraining text; tokenize plain documents",
}
TOKENIZER_TYPES = sorted(JSON_TYPES | BPE_PAIR_TYPES | SENTENCEPIECE_TYPES | set(REFUSED_TYPES) | {"NullTokenizer"})


def _is_tokenizer_json(path: Path) -> bool:
    """A HF tokenizer.json (an object whose "model" is an object), as opposed to GPT-2's flat
    vocab.json (token -> id; its token "model" maps to a number)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("model"), dict)


class TokenizerSpec:
    """What the flags ask for, resolved to files and checked before any work."""

    def __init__(self, kind: str, tokenizer=None, vocab_size: int | None = None, file: Path | None = None):
        self.kind, self.tokenizer, self.vocab_size, self.file = kind, tokenizer, vocab_size, file

    def eod(self, token: str | None, null_eod: int | None) -> int:
        if self.kind == "null":
            return self.vocab_size - 1 if null_eod is None else null_eod
        return eod_id(self.tokenizer, token)


def resolve_tokenizer(args) -> TokenizerSpec:
    """--tokenizer/--tokenizer-model, --vocab-file/--merge-file and --tokenizer-type -> a spec."""
    kind = args.tokenizer_type
    if kind in REFUSED_TYPES:
        raise TokenizerError(f"--tokenizer-type {kind}: not supported here: {REFUSED_TYPES[kind]}.")
    if kind == "NullTokenizer":
        if args.vocab_size is None or args.vocab_size < 1:
            raise TokenizerError("--tokenizer-type NullTokenizer reads ids written as text (\"3 1 4\"): it needs "
                                 "--vocab-size N (the ids must be below N; the end-of-document id is N-1 unless "
                                 "--null-tokenizer-eod-id says otherwise).")
        if args.tokenizer or args.vocab_file or args.merge_file:
            raise TokenizerError("--tokenizer-type NullTokenizer takes no tokenizer files: drop --tokenizer-model/"
                                 "--vocab-file/--merge-file, or choose the type of those files.")
        return TokenizerSpec("null", vocab_size=args.vocab_size)
    model = args.tokenizer
    vocab, merges = args.vocab_file, args.merge_file
    if model and (vocab or merges):
        raise TokenizerError(f"two tokenizers given: --tokenizer-model {model} and --vocab-file/--merge-file. "
                             f"Pass one of them.")
    # NeoX's HFTokenizer (and a careless GPT2BPETokenizer): --vocab-file is a tokenizer.json
    if vocab and not merges and Path(vocab).is_file() and _is_tokenizer_json(Path(vocab)):
        if kind in BPE_PAIR_TYPES:
            raise TokenizerError(f"--tokenizer-type {kind} takes --vocab-file vocab.json with --merge-file "
                                 f"merges.txt, but {vocab} is a HF tokenizer.json: pass --tokenizer-type "
                                 f"HFTokenizer (or HuggingFaceTokenizer --tokenizer-model {vocab}).")
        model, vocab = vocab, None
    if kind in JSON_TYPES | SENTENCEPIECE_TYPES and not model:
        if vocab or merges:
            raise TokenizerError(f"--tokenizer-type {kind} reads one tokenizer.json (--tokenizer-model, or "
                                 f"NeoX's --vocab-file tokenizer.json), not {vocab or merges}.")
        raise TokenizerError(f"--tokenizer-type {kind} needs --tokenizer-model: a tokenizer.json or a folder "
                             f"holding one (hub names cannot be downloaded here).")
    if kind in BPE_PAIR_TYPES and not (vocab and merges) and not model:
        raise TokenizerError(f"--tokenizer-type {kind} needs --vocab-file vocab.json and --merge-file merges.txt "
                             f"(or a tokenizer.json: --tokenizer-type HuggingFaceTokenizer --tokenizer-model FILE).")
    if model:
        p = Path(model)
        if kind in SENTENCEPIECE_TYPES and p.is_file() and p.suffix == ".model":
            raise TokenizerError(f"--tokenizer-model {model}: SentencePiece .model files are not read here. Convert "
                                 f"it once to tokenizer.json (transformers: AutoTokenizer.from_pretrained(folder)"
                                 f".save_pretrained(out) writes out/tokenizer.json) and pass that.")
        if not p.exists() and not p.is_absolute() and len(p.parts) <= 2 and "/" in model and not p.suffix:
            raise TokenizerError(f"--tokenizer-model {model}: not found. It looks like a hub name, and nothing can "
                                 f"be downloaded here: give a local tokenizer.json or a folder holding one.")
        tokenizer = load_tokenizer(model)
        return TokenizerSpec("tokenizers", tokenizer, tokenizer.get_vocab_size(with_added_tokens=True),
                             (p / "tokenizer.json" if p.is_dir() else p).resolve())
    if vocab and not merges:
        raise TokenizerError(f"--vocab-file {vocab} is a GPT-2 style vocab.json: it needs --merge-file merges.txt "
                             f"(or pass a tokenizer.json).")
    if merges and not vocab:
        raise TokenizerError(f"--merge-file {merges} needs --vocab-file vocab.json.")
    tokenizer = load_tokenizer(None, vocab, merges)
    return TokenizerSpec("tokenizers", tokenizer, tokenizer.get_vocab_size(with_added_tokens=True))


# ---------------------------------------------------------------- encoders

class TokenizersEncoder:
    name = "tokenizers"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips the character offsets we do not need and releases the GIL
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


class NullEncoder:
    """Megatron's NullTokenizer: the text is ids separated by single spaces."""
    name = "null"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        out = []
        for text in texts:
            try:
                ids = [int(x) for x in text.split(" ")] if text else []
            except ValueError:
                raise TokenizerError(f"--tokenizer-type NullTokenizer: a document is not ids separated by "
                                     f"single spaces: {text[:60]!r}. This type reads pre-tokenized ids as text; "
                                     f"for ordinary text pass a tokenizer.json instead.") from None
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                raise TokenizerError(f"NullTokenizer: id {max(ids) if max(ids) >= self.vocab_size else min(ids)} "
                                     f"is outside 0..{self.vocab_size - 1} (--vocab-size {self.vocab_size}).")
            out.append(ids)
        return out


# the split pattern of GPT-2's byte-level pre-tokenizer (what tokenizers' ByteLevel(use_regex=True)
# applies), in tiktoken's spelling
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# a text that exercises every part of the pattern and of byte-level BPE: contractions, letters of
# several scripts, digits, punctuation runs, whitespace runs before words and at the end, tabs,
# newlines, combining marks, emoji (multi-byte), the special token inside and beside words
PROBE_TEXT = ("I'm sure they'll say it's 'fine'; we've 12,345.67 reasons--don't we?\n\n  Indented\tline "
              "with   three spaces\r\nCafé naïve façade ünïcödé e\u0301 Ελληνικά Русский 日本語の文章 한국어 "
              "العربية עברית हिन्दी 😀👍🏽 <|endoftext|>after<|endoftext|> x  \n\n\n   trailing   ")


def tiktoken_unavailable(tokenizer) -> str | None:
    """Why `tokenizer` cannot run under tiktoken exactly (None: it can): tiktoken applies one
    split pattern, then merges by rank, so the tokenizer must be a byte-level BPE with GPT-2's
    pattern, no normalizer, and merges whose results' ids rise with the merge order."""
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return "the tiktoken package is not installed (pip install tiktoken)"
    spec = json.loads(tokenizer.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not byte-level BPE"
    if spec.get("normalizer"):
        return "it has a normalizer"
    if pre != {**pre, "type": "ByteLevel", "add_prefix_space": False, "use_regex": True}:
        return "its pre-tokenizer is not GPT-2's (ByteLevel, no prefix space, GPT-2's split pattern)"
    if model.get("dropout") or model.get("byte_fallback") or model.get("continuing_subword_prefix") or \
            model.get("end_of_word_suffix"):
        return "its BPE uses dropout, byte fallback or subword affixes"
    for token in spec.get("added_tokens") or []:
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return f"its added token {token['content']!r} strips spaces or matches single words only"
    vocab, added = model["vocab"], {t["content"] for t in spec.get("added_tokens") or []}
    decoder = byte_decoder()
    if any(ch not in decoder for t in vocab if t not in added for ch in t):
        return "its vocabulary has tokens outside the byte-level alphabet"
    last = -1
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank = vocab.get(left + right)
        if rank is None or rank <= last:
            return "its merge order does not follow its ids (tiktoken merges by id)"
        last = rank
    return None


def gigatoken_unavailable(tokenizer) -> tuple[str | None, object]:
    """(why `tokenizer` cannot run under gigatoken, None if it can; gigatoken's tokenizer or None)."""
    try:
        import gigatoken
    except ImportError:
        return "the gigatoken package is not installed (pip install gigatoken)", None
    try:
        return None, gigatoken.Tokenizer.from_json(tokenizer.to_str())
    except Exception as e:   # a model or component gigatoken does not implement: its own words
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"gigatoken cannot read this tokenizer.json ({type(e).__name__}: {first})", None


# [our choice, measured] gigatoken keeps every distinct pre-token it has encoded in a cache of the
# tokenizer object, unbounded: 10M distinct random words took a process from 65 MB to 847 MB, and a
# web corpus can hold tens of millions (numbers, URLs, hashes). A new tokenizer object starts empty
# (the old one's memory freed and trimmed: 360 -> 144 MB measured), so the encoder renews it when
# the process has grown this much since its first batch (at most once per RENEW_MIN_CHARS
# characters; loading takes ~0.16 s). The cache is also what makes gigatoken fast on repeated
# words: renewing at 24 MB of growth kept 1 GB of Wikipedia 10% flatter but cost 1.5x the CPU, so
# the bound is a guard against runaway growth, which Wikipedia text (+20-30 MB, saturating) never meets.
RENEW_AFTER_BYTES = 256 * 2**20
RENEW_MIN_CHARS = 20_000_000


class GigatokenEncoder:
    """The tokenizer.json run by gigatoken (its Rust thread pool: RAYON_NUM_THREADS, which
    preprocess.py sets from --workers before the first call). Its ids come back as one flat
    array and offsets, straight into numpy: no Python int per token. Its cache is bounded by
    renewing the tokenizer object (RENEW_AFTER_BYTES)."""
    name = "gigatoken"

    def __init__(self, loaded, spec: str | None = None, renew_after_bytes: int = RENEW_AFTER_BYTES):
        self.tokenizer, self.spec = loaded, spec   # spec: the tokenizer.json text, to load it anew
        self.renew_after_bytes = renew_after_bytes
        self.baseline = None   # resident bytes after the first batch
        self.chars_since = 0
        self.renewals = 0

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer.encode_batch_list(texts) if texts else []

    def encode_flat(self, texts: list[str]):
        """(all the texts' ids, one flat uint32 array; each text's count, int64)."""
        import awkward
        import numpy as np
        if not texts:
            return np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.int64)
        layout = awkward.to_layout(self.tokenizer.encode_batch(texts))
        offsets = np.asarray(layout.offsets.data, dtype=np.int64)
        flat = np.asarray(layout.content.data)[offsets[0]:offsets[-1]]
        self._bound_cache(sum(map(len, texts)))
        return flat, np.diff(offsets)

    def _bound_cache(self, chars: int) -> None:
        if self.spec is None:
            return
        self.chars_since += chars
        now = resident_bytes()
        if now is None:
            return
        if self.baseline is None:
            self.baseline = now
        elif now - self.baseline > self.renew_after_bytes and self.chars_since >= RENEW_MIN_CHARS:
            import gigatoken
            self.tokenizer = None   # the old one and its cache freed first, then handed back to the system
            release_freed_memory()
            self.tokenizer = gigatoken.Tokenizer.from_json(self.spec)
            self.renewals += 1
            self.chars_since = 0
            # memory that did not come back was not the cache's: measure growth from here on
            self.baseline = max(self.baseline, resident_bytes() or now)


class TiktokenEncoder:
    """The tokenizer.json's byte-level BPE run by tiktoken: ranks are the vocabulary's ids,
    every added token of the tokenizer.json is matched anywhere in the text (as tokenizers
    does for added tokens)."""
    name = "tiktoken"

    def __init__(self, tokenizer, workers: int):
        import tiktoken
        spec = json.loads(tokenizer.to_str())
        added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
        decoder = byte_decoder()
        ranks = {bytes(decoder[ch] for ch in token): i for token, i in spec["model"]["vocab"].items()
                 if token not in added}
        self.encoding = tiktoken.Encoding("megatron_id-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=added)
        self.allowed = set(added)
        self.workers = workers
        self.pool = ThreadPoolExecutor(workers) if workers > 1 else None

    def _map(self, one, texts):
        """one() over texts on the worker threads, in contiguous slices: a future per slice, not
        per text (tiktoken releases the GIL while it encodes)."""
        if self.pool is None or len(texts) < 2:
            return [one(t) for t in texts]
        step = -(-len(texts) // self.workers)
        slices = [texts[i:i + step] for i in range(0, len(texts), step)]
        return [ids for part in self.pool.map(lambda part: [one(t) for t in part], slices) for ids in part]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self._map(lambda t: self.encoding.encode(t, allowed_special=self.allowed, disallowed_special=()),
                         texts)

    def encode_arrays(self, texts: list[str]) -> list:
        """As encode_many, as numpy arrays (uint32) straight from tiktoken's buffer: no Python int
        per token. The texts must be valid Unicode (preprocess.py skips lone surrogates)."""
        return self._map(lambda t: self.encoding.encode_to_numpy(t, allowed_special=self.allowed,
                                                                disallowed_special=()), texts)
