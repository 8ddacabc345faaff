"""Loading a tokenizer from local files only (no hub): a HF tokenizer.json (or a folder with
one), or GPT-2 style vocab.json + merges.txt as Megatron's GPT2BPETokenizer takes them."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
GPT2_SPECIAL_TOKENS = ("<|endoftext|>",)


class TokenizerError(UserError, ValueError):
    pass


class TokenizerNotFoundError(UserError, FileNotFoundError):
    """The tokenizer to export or generate with cannot be found."""


def tokenizer_file(path) -> Path | None:
    """The tokenizer.json that --tokenizer names (a file, or a folder holding one), absolute;
    None when no path is given. Recorded in the dataset's .meta.json sidecar."""
    if not path:
        return None
    p = Path(path)
    return (p / "tokenizer.json" if p.is_dir() else p).resolve()


def load_tokenizer(path=None, vocab_file=None, merge_file=None):
    from tokenizers import Tokenizer
    if path:
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            where = f"{p}/tokenizer.json" if p.is_dir() else str(p)
            raise TokenizerError(f"tokenizer file not found: {where}. Pass a HF tokenizer.json or "
                                 f"a folder holding one (--tokenizer).")
        try:
            return Tokenizer.from_file(str(file))
        except Exception as err:
            raise TokenizerError(f"{file} is not a valid HF tokenizer.json: {err}") from None
    if vocab_file and merge_file:
        from tokenizers import decoders, models, pre_tokenizers
        for f in (vocab_file, merge_file):
            if not Path(f).is_file():
                raise TokenizerError(f"tokenizer file not found: {f}.")
        try:
            tok = Tokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        except Exception as err:
            raise TokenizerError(f"--vocab-file {vocab_file} / --merge-file {merge_file} are not a GPT-2 style "
                                 f"vocab.json and merges.txt: {err}") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        # the end-of-text token is special, as in GPT-2's tokenizer.json and Megatron's
        # GPT2BPETokenizer: a literal "<|endoftext|>" in a document is one id (50256), not 7
        specials = [t for t in GPT2_SPECIAL_TOKENS if tok.token_to_id(t) is not None]
        if specials:
            tok.add_special_tokens(specials)
        return tok
    raise TokenizerError("no tokenizer given: pass --tokenizer tokenizer.json (or "
                         "--vocab-file and --merge-file).")


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte (what
    tokenizers' ByteLevel pre-tokenizer maps bytes to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer) -> list[int]:
    """How many bytes of text each id stands for (0 for special tokens such as the EOD): for
    byte-level BPE exactly, from the byte alphabet; else from decoding the id alone."""
    import json
    spec = json.loads(tokenizer.to_str())
    special = {t["id"] for t in spec.get("added_tokens") or [] if t.get("special")}
    byte_level = (spec.get("pre_tokenizer") or {}).get("type") == "ByteLevel"
    decoder = byte_decoder()
    out = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        token = tokenizer.id_to_token(i)
        if token is None or i in special:
            out.append(0)
        elif byte_level and all(ch in decoder for ch in token):
            out.append(len(token))
        else:
            out.append(len(tokenizer.decode([i]).encode("utf-8")))
    return out


def eod_id(tokenizer, token: str | None = None) -> int:
    candidates = [token] if token else list(EOD_CANDIDATES)
    for c in candidates:
        i = tokenizer.token_to_id(c)
        if i is not None:
            return i
    raise TokenizerError(f"no end-of-document token in the vocabulary (tried {', '.join(candidates)}); "
                         f"name one with --eod-token.")


def find_tokenizer(given, recorded, source: Path) -> Path:
    """--tokenizer, else the one the checkpoint records; an error with the fix when neither is a file."""
    fix = "pass --tokenizer path/to/tokenizer.json (the one the data was preprocessed with)"
    if given:
        if not Path(given).is_file():
            raise TokenizerNotFoundError(f"--tokenizer {given} not found: {fix}.")
        return Path(given)
    if not recorded:
        raise TokenizerNotFoundError(f"{source} records no tokenizer (data.tokenizer was not set in training): {fix}.")
    if not Path(recorded).is_file():
        raise TokenizerNotFoundError(f"tokenizer {recorded} (recorded in {source}) not found: it was moved or "
                                     f"deleted; {fix}.")
    return Path(recorded)
