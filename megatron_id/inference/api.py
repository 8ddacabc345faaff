"""OpenAI's completions request as `megatron-id serve` reads it: the body decoded strictly (UTF-8,
standard JSON, bounded depth), every field checked before any work (finite, in range, of its
type), and `stop` strings matched on the decoded text. Nothing here touches the model or the
event loop; the server (server.py) turns BadRequest into a 4xx with OpenAI's error body."""
from __future__ import annotations

import json
import math
import secrets

from .batching import Request
from .generate import GREEDY_BELOW, Sampling

# OpenAI parameters accepted only at their neutral value: anything else is refused, not ignored
NEUTRAL = {"suffix": None}
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_k", "seed", "stream", "user", "stream_options",
         "stop", "ignore_eos", "include_stop_str_in_output", "n", "best_of", "echo", "logprobs", "top_p", "min_p",
         "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", *NEUTRAL}
MAX_LOGIT_BIAS = 300     # OpenAI's limit on logit_bias entries
MAX_LOGPROBS = 20        # the most top_logprobs a token (vLLM's default bound; OpenAI's legacy completions: 5)
MAX_CHOICES = 128        # prompts x n in one request (each is a sequence of the engine)
# booleans, false when absent (vLLM's extras: the end-of-text token not ending the completion; the
# stop string that ended it kept in the text; echo: the prompt's text before the completion's)
FLAGS = ("stream", "ignore_eos", "include_stop_str_in_output", "echo")
MAX_STOPS = 4            # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 1000    # per stop string: each is matched against the text's tail at every token
SEED_RANGE = (0, 2**64 - 1)   # what torch.Generator.manual_seed takes


class BadRequest(Exception):
    """A request refused before any work: `status` (400, 413, 415 ...), the message, the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def check_content_type(content_type: str, charset: str | None) -> None:
    """JSON in UTF-8 only: a text/plain or form POST (what a web page may send to another origin
    without asking first) is refused with 415, as is a charset other than UTF-8."""
    if content_type != "application/json":
        raise BadRequest(f"Content-Type {content_type or '(none)'!r}: send the body as JSON with "
                         f"'Content-Type: application/json'", status=415)
    if charset is not None and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
        raise BadRequest(f"charset {charset!r}: this server reads UTF-8 only; send the body in UTF-8 "
                         f"(Content-Type: application/json; charset=utf-8)", status=415)


def _refuse_constant(name: str):
    raise BadRequest(f"the body is not JSON: {name} is not a JSON value (send a number)")


def decode_body(raw: bytes):
    """The JSON object of a request body, or BadRequest: not UTF-8, not standard JSON (NaN and
    Infinity are Python's extensions, refused), nested past the decoder's recursion limit."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not UTF-8 (byte {e.start}): send JSON in UTF-8") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    except RecursionError:   # (the C decoder stops at Python's recursion limit, ~1,000 levels)
        raise BadRequest("the body is nested too deep: a completions request is an object of strings, numbers "
                         "and lists") from None


def check_text(value: str, name: str) -> None:
    """A JSON string may hold a lone surrogate (\\ud800), which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{name} holds a lone surrogate ({value[e.start]!r} at character {e.start}): "
                         f"send valid Unicode text", name) from None


def parse_stop(value) -> list[str]:
    """OpenAI's `stop`: null, a string, or a list of up to 4 strings ([] means none)."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"stop must be a string or a list of strings, not {value!r}", "stop")
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"stop has {len(stops)} strings: at most {MAX_STOPS}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"stop holds a string of {max(map(len, stops)):,} characters: at most {MAX_STOP_CHARS:,}",
                         "stop")
    if any(s == "" for s in stops):
        raise BadRequest("stop holds an empty string: every stop string needs at least one character", "stop")
    for s in stops:
        check_text(s, "stop")
    return stops


def number(body: dict, name: str, default, kind, low, high=None):
    """body[name] (default when absent or null) of `kind`, finite and within [low, high]."""
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f"{name} must be {'a number' if kind is float else 'an integer'}, not {value!r}", name)
    if isinstance(value, float) and not math.isfinite(value):   # (decode_body refuses NaN already)
        raise BadRequest(f"{name}={value} is not a finite number", name)
    if value < low or (high is not None and value > high):
        raise BadRequest(f"{name}={value} is out of range [{low}, {high if high is not None else 'inf'}]", name)
    return kind(value)


def parse_completion(body, max_model_len: int, default_max_tokens: int | None = 16) -> tuple[dict, str]:
    """(the request's settings, its prompt text) from a completions body, or BadRequest naming
    the field; every check but the prompt's token count (which needs the tokenizer, off the event
    loop: `check_length`). default_max_tokens: OpenAI's 16 for completions; None (chat): what the
    context leaves after the prompt, set by to_request. Without a seed, a sampled request draws a
    fresh one (OpenAI's and vLLM's behaviour; a fixed default gave every such request one text)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] != neutral and body[name] is not None:
            raise BadRequest(f"{name}={body[name]!r} is not supported (only {neutral!r})", name)
    prompts = parse_prompts(body.get("prompt"))
    n = number(body, "n", 1, int, 1, MAX_CHOICES)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:   # (vLLM's V1 engine dropped it too)
        raise BadRequest(f"best_of={best_of!r} is not supported (only null or equal to n, {n})", "best_of")
    if n * len(prompts) > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts x n {n} make {n * len(prompts)} completions: at most {MAX_CHOICES} "
                         f"in one request (send the rest in another)", "n")
    max_tokens = body.get("max_tokens")
    settings = {"max_tokens": default_max_tokens if max_tokens is None else number(body, "max_tokens", 16, int, 1),
                "temperature": number(body, "temperature", 1.0, float, 0.0, 2.0),   # OpenAI's default and range
                "top_k": number(body, "top_k", 0, int, 0),
                "seed": None if body.get("seed") is None else number(body, "seed", 0, int, *SEED_RANGE),
                "stop": parse_stop(body.get("stop"))}
    if 0 < settings["temperature"] < GREEDY_BELOW:   # 1e-300: logits / t overflow; the draw is the argmax anyway
        raise BadRequest(f"temperature={settings['temperature']} is below {GREEDY_BELOW:g}, where sampling is "
                         f"greedy to float precision: send 0 for greedy", "temperature")
    for flag in FLAGS:
        value = body.get(flag, False)
        if not isinstance(value, bool):
            raise BadRequest(f"{flag} must be true or false, not {value!r}", flag)
        settings[flag] = value
    stream = settings["stream"]
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict) or set(options) - {"include_usage"} or not stream:
        raise BadRequest("stream_options takes only {\"include_usage\": true|false}, with stream", "stream_options")
    settings["include_usage"] = bool(options.get("include_usage"))
    settings["n"] = n
    # logprobs: the log-probability of each completion token (with echo, of the prompt's too) and
    # the `logprobs` likeliest at each place, from the model's own distribution (before temperature
    # and top_k, as vLLM gives them); lm-eval scores with echo + logprobs
    settings["logprobs"] = None if body.get("logprobs") is None else number(body, "logprobs", 0, int, 0, MAX_LOGPROBS)
    settings["sampling"] = parse_sampling(body)
    return settings, prompts


def parse_sampling(body: dict) -> Sampling:
    """top_p, min_p, the penalties and logit_bias (OpenAI's ranges; repetition_penalty vLLM's)."""
    top_p = number(body, "top_p", 1.0, float, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("top_p=0 keeps no token: send a value in (0, 1] (1: all)", "top_p")
    repetition = number(body, "repetition_penalty", 1.0, float, 0.0, 10.0)
    if repetition == 0:
        raise BadRequest("repetition_penalty=0 divides by zero: send a value in (0, 10] (1: none)",
                         "repetition_penalty")
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias must be an object of up to {MAX_LOGIT_BIAS} token ids (as strings) to numbers in "
                         f"[-100, 100]", "logit_bias")
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        pairs.append((token, number({"logit_bias": value}, "logit_bias", 0.0, float, -100.0, 100.0)))
    return Sampling(top_p=top_p, min_p=number(body, "min_p", 0.0, float, 0.0, 1.0),
                    presence_penalty=number(body, "presence_penalty", 0.0, float, -2.0, 2.0),
                    frequency_penalty=number(body, "frequency_penalty", 0.0, float, -2.0, 2.0),
                    repetition_penalty=repetition, logit_bias=tuple(sorted(pairs)))


def is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)   # (JSON's true is Python's int too)


def parse_prompts(value) -> list:
    """OpenAI's `prompt`: a string, a list of strings, a list of token ids, or a list of lists of
    token ids -> a non-empty list of prompts, each a string or a list of ids (ids checked against
    the vocabulary once the tokenizer is at hand: `check_ids`)."""
    def one(item, where: str):
        if isinstance(item, str):
            if not item:
                raise BadRequest(f"{where} gives no tokens: send some text", "prompt")
            check_text(item, where)
            return item
        if isinstance(item, list) and item and all(map(is_token_id, item)):
            return item
        raise BadRequest(f"{where} must be a string or a non-empty list of token ids (integers), not "
                         f"{str(item)[:100]}", "prompt")
    if isinstance(value, str):
        return [one(value, "prompt")]
    if isinstance(value, list) and value and all(map(is_token_id, value)):
        return [value]   # one prompt of token ids
    if isinstance(value, list) and value:
        return [one(item, f"prompt[{i}]") for i, item in enumerate(value)]
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids "
                     "(and not empty)", "prompt")


def check_ids(ids: list[int], vocabulary: int, where: str, param: str = "prompt") -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocabulary:
            raise BadRequest(f"{where}[{i}] = {token}: token ids are integers from 0 to {vocabulary - 1} (this "
                             f"model's vocabulary)", param)


def longest_token_bytes(tokenizer) -> int | None:
    """The most bytes one token stands for, when the tokenizer is byte-level (GPT-2's, NeoX's:
    every character of a vocabulary entry stands for one byte): a prompt of B bytes then has at
    least B / this many tokens, so a prompt far past the limit is refused on its bytes, without
    tokenizing it. None for other tokenizers (an unknown-word token may stand for any length)."""
    if type(tokenizer.decoder).__name__ != "ByteLevel":
        return None
    # (not max(data.tokenizer.token_bytes): it counts special tokens as 0 bytes, but a prompt that
    # spells one out, "<|endoftext|>", is one token for all its bytes; every entry's text counts)
    return max(len(token) for token in tokenizer.get_vocab()) or 1


def check_length(prompt_tokens: int, max_tokens: int, max_model_len: int, size: int | None = None) -> None:
    """Refuse a prompt + max_tokens over --max-model-len, blaming what the client should change:
    the prompt when it leaves no room for a completion on its own, else max_tokens, with the most
    it may be. `size`: the prompt's bytes, when prompt_tokens is only the least they can be (then
    only a prompt too long on its own is refused: the rest waits for the exact count)."""
    limit = f"this server's --max-model-len of {max_model_len:,} tokens (prompt + max_tokens)"
    if prompt_tokens >= max_model_len:
        prompt = (f"the prompt's {size:,} bytes are at least {prompt_tokens:,} tokens" if size is not None else
                  f"the prompt is {prompt_tokens:,} tokens")
        also = (f" (and max_tokens {max_tokens:,} alone is over it too: ask for fewer)"
                if max_tokens >= max_model_len else "")
        raise BadRequest(f"{prompt}, which leaves no room for a completion under {limit}: send a shorter "
                         f"prompt{also}", "prompt")
    if size is None and prompt_tokens + max_tokens > max_model_len:
        # (a shorter prompt helps only where max_tokens is below the limit on its own)
        shorter = " (or send a shorter prompt)" if max_tokens < max_model_len else ""
        raise BadRequest(f"max_tokens {max_tokens:,} after the prompt's {prompt_tokens:,} "
                         f"token{'s' if prompt_tokens != 1 else ''} makes {prompt_tokens + max_tokens:,} tokens, "
                         f"over {limit}: ask for at most {max_model_len - prompt_tokens:,} max_tokens{shorter}",
                         "max_tokens")


def check_prompt_bytes(prompt, settings: dict, max_model_len: int, bytes_per_token: int | None) -> None:
    """A prompt too long on its bytes alone, refused before it is tokenized (a byte-level
    tokenizer's token covers at most `bytes_per_token` bytes): megabytes are not tokenized.
    (A prompt of token ids is checked on its length by to_request.)"""
    if bytes_per_token is None or not isinstance(prompt, str):
        return
    size = len(prompt.encode("utf-8"))
    check_length(-(-size // bytes_per_token), settings["max_tokens"] or 1, max_model_len, size)


def to_request(ids: list[int], settings: dict, max_model_len: int, sample: int = 0) -> Request:
    """The engine's Request once the prompt is tokenized (its length checked against the limit;
    max_tokens None: all the room the prompt leaves; seed None: a fresh one; `sample`: the
    prompt's j-th of n completions, seeded seed + j, so that a request's n samples differ and
    the same request gives them again)."""
    if not ids:
        raise BadRequest("prompt gives no tokens: send some text", "prompt")
    max_tokens = settings["max_tokens"]
    check_length(len(ids), max_tokens or 1, max_model_len)
    if max_tokens is None:
        max_tokens = max_model_len - len(ids)
    seed = (settings["seed"] + sample) % (SEED_RANGE[1] + 1) if settings["seed"] is not None else \
        secrets.randbelow(SEED_RANGE[1] + 1)
    # a stream's logprobs are the engine's, token by token; without stream the answer's are scored
    # at the end in one pass over prompt + completion (OpenAIApp.logprobs)
    return Request(ids, max_tokens, settings["temperature"], settings["top_k"], seed,
                   ignore_eos=settings["ignore_eos"], sampling=settings["sampling"],
                   logprobs=settings["logprobs"] if settings["stream"] else None)


class StopText:
    """The text of a completion as it grows, cut at the first `stop` string (which is not
    returned, as OpenAI does; `keep`: it is, vLLM's include_stop_str_in_output). `ready()` is
    what can be sent now: the text less any tail that could still become a stop string."""

    def __init__(self, stops: list[str], keep: bool = False):
        self.stops, self.keep = stops, keep
        self.text = ""
        self.stopped = False

    def update(self, text: str) -> None:
        if self.stopped:
            return
        cuts = [(i, i + len(s) if self.keep else i) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if cuts:
            text, self.stopped = text[:min(cuts)[1]], True
        self.text = text

    def ready(self, final: bool = False) -> str:
        if final or self.stopped or not self.stops:
            return self.text
        hold = 0   # the longest tail of the text that begins a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if s.startswith(self.text[-n:]):
                    hold = n
                    break
        return self.text[:len(self.text) - hold]


# ---------------------------------------------------------------- chat completions

CHAT_KNOWN = (KNOWN - {"prompt", "echo", "suffix", "best_of"}) | {"messages", "max_completion_tokens", "top_logprobs"}
ROLES = ("system", "developer", "user", "assistant")   # developer: OpenAI's newer name of system


class ChatTemplate:
    """A Jinja chat template rendered as transformers renders it (a sandboxed environment, the
    messages, add_generation_prompt=True and the special tokens' names); an error of the
    template becomes the request's 400."""

    def __init__(self, source: str, special_tokens: dict):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise BadRequest(f"the chat template refused the messages: {message}", "messages")
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        self.template = environment.from_string(source)
        self.special_tokens = special_tokens

    def render(self, messages: list[dict]) -> str:
        from jinja2 import TemplateError
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except TemplateError as e:
            raise BadRequest(f"the chat template could not render the messages: {e}", "messages") from None


def parse_chat(body, max_model_len: int, template: ChatTemplate | None) -> tuple[dict, str]:
    """(settings, prompt text) from a chat completions body: the messages rendered by the
    tokenizer's chat template, the rest checked as for completions."""
    if template is None:
        raise BadRequest("this model's tokenizer has no chat template (tokenizer_config.json \"chat_template\" or "
                         "chat_template.jinja beside tokenizer.json): use /v1/completions with a prompt")
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - CHAT_KNOWN)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}", unknown[0])
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    contents = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):   # content parts, as the openai client sends them: text parts only
            if not content or not all(isinstance(part, dict) and part.get("type") == "text" and set(part) ==
                                      {"type", "text"} and isinstance(part["text"], str) for part in content):
                raise BadRequest(f"messages[{i}].content: a list of parts must hold text parts only, "
                                 f"{{\"type\": \"text\", \"text\": a string}} (this model reads text), not "
                                 f"{str(content)[:200]}", "messages")
            content = "".join(part["text"] for part in content)
        if not isinstance(message, dict) or message.get("role") not in ROLES or \
                not isinstance(content, str) or set(message) - {"role", "content", "name"}:
            raise BadRequest(f"messages[{i}] must be {{\"role\": one of {', '.join(ROLES)}, \"content\": a string "
                             f"or a list of text parts}}, not {str(message)[:200]}", "messages")
        check_text(content, "messages")
        contents.append(content)
    # chat's logprobs is a boolean, top_logprobs how many alternatives (completions' logprobs number)
    wants, top = body.get("logprobs"), body.get("top_logprobs")
    if wants not in (None, True, False):
        raise BadRequest(f"logprobs must be true or false, not {wants!r}", "logprobs")
    if top is not None and wants is not True:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None:
        number(body, "top_logprobs", 0, int, 0, MAX_LOGPROBS)
    body = {**{k: v for k, v in body.items() if k != "top_logprobs"}, "logprobs": (top or 0) if wants else None}
    if "max_completion_tokens" in body:
        if "max_tokens" in body:
            raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        body = {**{k: v for k, v in body.items() if k != "max_completion_tokens"},
                "max_tokens": body["max_completion_tokens"]}
    # (a template knows system, user and assistant: developer is read as system)
    prompt = template.render([{"role": "system" if m["role"] == "developer" else m["role"], "content": content}
                              for m, content in zip(messages, contents)])
    rest = {k: v for k, v in body.items() if k != "messages"}
    # chat has no cap of its own on max_tokens (OpenAI's): without one, what the context leaves
    return parse_completion({**rest, "prompt": prompt}, max_model_len, default_max_tokens=None)
