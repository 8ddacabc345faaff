"""Loading a tokenizer from local files only (no hub): a HF tokenizer.json (or a folder with
one), or GPT-2 style vocab.json + merges.txt as Megatron's GPT2BPETokenizer takes them."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import UserError

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
GPT2_SPECIAL_TOKENS = ("<|endoftext|>",)


class TokenizerError(UserError, ValueError):
    pass


class TokenizerNotFoundError(UserError, FileNotFoundError):
    """The tokenizer to export or generate with cannot be found."""


class TokenizerMismatchError(UserError, ValueError):
    """Two things that must share a tokenizer (datasets, a checkpoint, a tokenizer file) record
    different ones: their ids mean different tokens."""
    same_on_every_rank = True


# ------------------------------------------------------------------ one identity for a tokenizer
#
# Token ids mean something only through the id -> token table that made them. The identity of
# a tokenizer is a hash of that table (every id's token string and whether it is special), so
# the same vocabulary loaded from a tokenizer.json or from GPT-2's vocab.json + merges.txt, or
# copied to another folder, has the same identity, and any other vocabulary another one. It is
# written into every dataset sidecar ("tokenizer_id"), checkpoint client state and export
# (config.json "megatron_id_tokenizer_id"), and `check_same_tokenizer` compares two of them.
# Merges and normalizers are left out on purpose: they change how text is cut, not what an
# id means, so data cut differently with one vocabulary still trains one embedding table.

MISMATCH_FLAG = "--allow-tokenizer-mismatch"          # the command-line way to mix on purpose
MISMATCH_KEY = "data.allow_tokenizer_mismatch=true"   # the training config's


def tokenizer_identity(tokenizer) -> str:
    """'vocab:<16 hex digits>': sha256 of the tokenizer's id -> (token, special) table."""
    import hashlib
    import json
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special} \
        if hasattr(tokenizer, "get_added_tokens_decoder") else set()
    table = sorted((i, t) for t, i in tokenizer.get_vocab(with_added_tokens=True).items())
    text = json.dumps([[i, t, t in special] for i, t in table], ensure_ascii=False)
    return "vocab:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def null_tokenizer_identity(vocab_size: int) -> str:
    """Megatron's NullTokenizer (ids written as text): the vocabulary is its size alone."""
    return f"null:{vocab_size}"


_FACTS_OF_FILE: dict = {}


def _facts_of_file(path) -> tuple[str, int]:
    """(identity, number of tokens with the added ones) of the tokenizer.json at `path` (a file
    or a folder holding one), loaded once per file version: the training checks ask both before
    any work, and a load of GPT-2's tokenizer.json takes ~0.2 s. A missing or broken file raises
    load_tokenizer's one-line error naming it."""
    p = Path(path)
    file = (p / "tokenizer.json" if p.is_dir() else p).resolve()
    if not file.is_file():
        load_tokenizer(str(path))   # raises the error naming what was looked for
    stat = file.stat()
    key = (str(file), stat.st_mtime_ns, stat.st_size)
    if key not in _FACTS_OF_FILE:
        tokenizer = load_tokenizer(str(file))
        _FACTS_OF_FILE[key] = (tokenizer_identity(tokenizer), tokenizer.get_vocab_size(with_added_tokens=True))
    return _FACTS_OF_FILE[key]


def identity_of_loaded(tokenizer, file) -> str:
    """The identity of `tokenizer`, just loaded from the tokenizer.json `file`: computed once per
    file version (hashing GPT-2's table takes ~0.3 s, and the tests preprocess with one file many
    times in one process), and remembered for identity_of_file / size_of_file."""
    file = Path(file).resolve()
    stat = file.stat()
    key = (str(file), stat.st_mtime_ns, stat.st_size)
    if key not in _FACTS_OF_FILE:
        _FACTS_OF_FILE[key] = (tokenizer_identity(tokenizer), tokenizer.get_vocab_size(with_added_tokens=True))
    return _FACTS_OF_FILE[key][0]


def identity_of_file(path) -> str:
    """The identity of the tokenizer.json at `path` (loaded once per file version)."""
    return _facts_of_file(path)[0]


def size_of_file(path) -> int:
    """The number of tokens (added tokens included) of the tokenizer.json at `path`."""
    return _facts_of_file(path)[1]


def dataset_tokenizer(prefix) -> tuple[str | None, str | None]:
    """(identity, tokenizer path) the sidecar of the dataset at `prefix` records; the identity
    is None when neither it nor the tokenizer file it names is known (no sidecar, a moved file)."""
    from .indexed_dataset import read_meta
    meta = read_meta(prefix) or {}
    identity, path = meta.get("tokenizer_id"), meta.get("tokenizer")
    if identity is None and path and Path(path).is_file():   # data written before identities were
        identity = identity_of_file(path)                    # recorded: the tokenizer file it names
    return identity, path


def describe_identity(identity: str | None, path: str | None = None) -> str:
    where = f" ({path})" if path else ""
    return f"tokenizer {identity}{where}" if identity else f"an unrecorded tokenizer{where}"


def check_same_tokenizer(first: tuple, second: tuple, fix: str, allow: bool = False, warn=None) -> bool:
    """Refuse two sides whose tokenizer identities are both known and differ.

    Each side is (what, identity, path): e.g. ("checkpoint runs/x/checkpoints", "vocab:1a2b...",
    "/data/gpt2/tokenizer.json"). `fix` ends the message. With `allow` (the user's flag to mix
    on purpose) the mismatch is a warning instead. Returns True when they are known to match."""
    (what_a, id_a, path_a), (what_b, id_b, path_b) = first, second
    if id_a is None or id_b is None:
        return False
    if id_a == id_b:
        return True
    if path_a and path_b and _same_file(path_a, path_b):   # one path, another content: the file was replaced
        message = (f"the tokenizer file {path_b} changed since {what_a} recorded it (replaced or edited at the "
                   f"same path): {what_a} was made with tokenizer {id_a} but the tokenizer file now holds tokenizer "
                   f"{id_b}; their token ids mean different tokens. Restore the original file (or point to a copy of "
                   f"it). {fix}")
    else:
        message = (f"{what_a} was made with {describe_identity(id_a, path_a)} but {what_b} with "
                   f"{describe_identity(id_b, path_b)}: their token ids mean different tokens. {fix}")
    if not allow:
        raise TokenizerMismatchError(message)
    (warn or (lambda m: print(f"warning: {m}", file=sys.stderr)))(message + " (mixed on purpose: allowed)")
    return False


def _same_file(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):
        return False


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
            raise TokenizerError(f"{file} is not a valid HF tokenizer.json: {_what_file(file) or err}") from None
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


def _what_file(file: Path) -> str | None:
    """What a file given as a tokenizer.json is instead, with the way to a tokenizer.json, when it
    is one half of GPT-2's vocab.json + merges.txt (the files Megatron's GPT2BPETokenizer takes)."""
    try:
        with open(file, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    make = ("python -c \"from megatron_id.data.tokenizer import load_tokenizer; load_tokenizer(vocab_file="
            "'vocab.json', merge_file='merges.txt').save('tokenizer.json')\" makes one from the pair "
            "(data_tools.preprocess also takes them as --vocab-file and --merge-file)")
    if head.lstrip().startswith(b"#version") or (b"\n" in head and not head.lstrip().startswith((b"{", b"["))
                                                and all(len(line.split()) == 2 for line in head.splitlines()[1:5])):
        return f"it is a GPT-2 style merges.txt (one merge per line), not a tokenizer.json; {make}"
    if head.lstrip().startswith(b"{"):
        try:
            table = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if isinstance(table, dict) and table and all(isinstance(v, int) for v in table.values()):
            return (f"it is a GPT-2 style vocab.json (token -> id, {len(table):,} tokens), which needs its "
                    f"merges.txt to tokenize, not a tokenizer.json; {make}")
    return None


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


def check_tokenizer_for_model(tokenizer, tokenizer_path, model_vocab: int, recorded: str | None, source,
                              allow: bool = False, recorded_path=None) -> str:
    """A tokenizer about to be used with a trained model (generate, eval, export): it is the one
    the model was trained with (`recorded`: the identity its checkpoint or export records;
    None for older ones) and no id of it falls outside the model's embedding table. Returns
    the tokenizer's identity. Raises TokenizerMismatchError naming both and the fix."""
    own = tokenizer_identity(tokenizer)
    same = recorded_path is not None and _same_file(recorded_path, tokenizer_path)   # (path named only then)
    check_same_tokenizer((f"the model of {source}", recorded, recorded_path if same else None),
                         (f"the tokenizer {tokenizer_path}", own, tokenizer_path if same else None),
                         "Pass the tokenizer the model was trained with (--tokenizer), or "
                         f"{MISMATCH_FLAG} to use this one on purpose.", allow=allow)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > model_vocab:
        raise TokenizerMismatchError(
            f"the tokenizer {tokenizer_path} has {size:,} tokens but the model of {source} embeds "
            f"{model_vocab:,} (model.vocab_size): ids {model_vocab}..{size - 1} would fail on the first text "
            f"that uses them. Use the tokenizer the model was trained with, or train with model.vocab_size >= {size}.")
    return own


def chat_template_of(tokenizer_path) -> str | None:
    """The chat template kept beside a tokenizer.json, as transformers keeps it: chat_template.jinja,
    or tokenizer_config.json's "chat_template" (a string, or a list of named templates: the one
    named "default"). None when there is none."""
    folder = Path(tokenizer_path).parent
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (json.JSONDecodeError, AttributeError):
        return None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) and template.strip() else None
