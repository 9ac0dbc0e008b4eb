"""Completion bodies that would kill mlx-lm's generation thread, refused before they reach it.

mlx-lm 0.32.2 validates the kinds of most fields in its handler (APIHandler.
validate_model_parameters), but parts of a request are first used on the one generation thread,
outside any try: an exception there ends the thread for good (ResponseGenerator.
generation_available() is False, /health says "unavailable", every later request fails), and an
out-of-range index there is a write past the logits, or a segfault. Found by
scripts/explore_decoder_killers.py on the tiny llama (docs/design/decoder-seam.md, "Bounds and
liveness"); each rule below names what it prevents:

  stop               not a string or a list of strings (5, true, [1], [["x"]], [{}], [null]):
                     _make_state_machine hashes tuple(stop_words) -> TypeError, thread dead;
  logit_bias         a key outside [0, vocab): 2**70 does not fit mx.array (thread dead), 2**40
                     is a segfault, vocab + 1000 a silent write past the logits; a value that
                     is not a finite number (null, [1]: the handler dies without a reply);
  min_p (and every   NaN: min_p = NaN killed the thread (apply_min_p); the other sampling and
  float field)       penalty numbers are held to finite values too;
  integer fields     outside int64 (seed outside [0, 2**64): mx.random.seed raises and the
                     handler dies without a reply);
  chat_template_kwargs  a key that is apply_chat_template's own parameter rather than a template
                     variable: return_tensors makes the prompt an array, thread dead; others
                     (tokenize, add_generation_prompt, tools, return_dict, chat_template, ...)
                     change what the call returns or which template runs;
  prompt             "" (text completion): an empty prompt, thread dead;
  messages           an image part with a URL that is not a data: URL: mlx-lm's handler
                     downloads http(s) URLs itself (any host, unbounded size) before anything
                     else; a text decoder has no use for it;
  stream_options     not an object: the handler dies after generating, without a reply.

mlx-vlm 0.7.10 (DeepSeek-V4 tiny, same script with --vlm) validates its bodies with pydantic,
and its generation thread survived every body above but one: a logit_bias key of 2**40, a
segfault of the whole process (check_vlm_body). It, too, fetches (or opens, for a file path)
whatever an image part names.
"""

import math
from typing import Any, Dict, Optional

from .errors import bad_request

INT64 = 1 << 63
FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "xtc_probability", "xtc_threshold",
)
INT_FIELDS = (
    "max_tokens", "max_completion_tokens", "top_k", "num_draft_tokens",
    "repetition_context_size", "presence_context_size", "frequency_context_size", "top_logprobs",
)
# apply_chat_template's own parameters (transformers), which mlx-lm lets chat_template_kwargs
# override or add: none of them is a template variable.
TEMPLATE_CALL_PARAMETERS = frozenset((
    "conversation", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
))
IMAGE_PART_TYPES = ("image_url", "input_image", "image")


def check_completion_body(body: Dict[str, Any], vocab_size: int) -> None:
    """400 for a completion body (chat or text) that would kill the generation thread, or
    crash its handler without a reply; the rules are the module docstring's."""
    _check_stop(body.get("stop"))
    _check_logit_bias(body.get("logit_bias"), vocab_size)
    for name in FLOAT_FIELDS:
        value = body.get(name)
        if _is_number(value) and not math.isfinite(value):
            raise bad_request("bad_number", f"{name} must be a finite number")
    for name in INT_FIELDS:
        value = body.get(name)
        if _is_int(value) and not -INT64 <= value < INT64:
            raise bad_request("bad_integer", f"{name} must fit in 64 bits")
    seed = body.get("seed")
    if _is_int(seed) and not 0 <= seed < 2 * INT64:
        raise bad_request("bad_seed", "seed must be an integer in [0, 2**64)")
    _check_template_kwargs(body.get("chat_template_kwargs"))
    if "prompt" in body and "messages" not in body:
        if not isinstance(body["prompt"], str) or not body["prompt"]:
            raise bad_request("bad_prompt", "prompt must be a non-empty string")
    _check_images(body.get("messages"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("bad_stream_options", "stream_options must be an object")


def check_vlm_body(body: Dict[str, Any], vocab_size: int) -> None:
    """400 for an mlx-vlm request body (chat, responses, messages) that would crash the decoder
    or make it fetch an image: logit_bias outside the vocabulary, images not inline."""
    _check_logit_bias(body.get("logit_bias"), vocab_size)
    for field in ("messages", "input"):
        _check_images(body.get(field))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_stop(stop: Any) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("bad_stop", "stop must be a string or a list of strings")


def _check_logit_bias(bias: Any, vocab_size: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise bad_request("bad_logit_bias", "logit_bias must be an object of token id to number")
    for key, value in bias.items():
        token = _token_id(key)
        if token is None or not 0 <= token < vocab_size:
            raise bad_request(
                "bad_logit_bias", f"logit_bias key {key!r} is not a token id in [0, {vocab_size})"
            )
        if not _is_number(value) or not math.isfinite(value):
            raise bad_request("bad_logit_bias", f"logit_bias[{key!r}] must be a finite number")


def _token_id(key: str) -> Optional[int]:
    """The id a logit_bias key names: plain ASCII decimal digits only (int() would also take
    signs, '_' and other scripts' digits)."""
    if not (key.isascii() and key.isdigit()) or len(key) > 19:
        return None
    return int(key)


def _check_template_kwargs(kwargs: Any) -> None:
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise bad_request("bad_chat_template_kwargs", "chat_template_kwargs must be an object")
    reserved = sorted(TEMPLATE_CALL_PARAMETERS.intersection(kwargs))
    if reserved:
        raise bad_request(
            "bad_chat_template_kwargs",
            f"chat_template_kwargs may hold template variables only, not {', '.join(reserved)}",
        )


def _check_images(messages: Any) -> None:
    if not isinstance(messages, list):
        return
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
                continue
            url = part.get("image_url", part.get("image"))
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:"):
                raise bad_request(
                    "remote_image_refused",
                    "image parts must carry data: URLs; the decoder fetches no URL",
                )
