"""POST /hetero/tokenize on mlx-vlm: its own chat endpoint run dry, with generate() tokenizing the
request and stopping, and the substitutions in mlx-vlm's server modules that make a dry run
possible (vlm_serve.py installs them before the model loads):

  - the response generator class: SeamResponseGenerator, which inside a dry run tokenizes and
    stops, and outside one watches each generation for its caller's hang-up (vlm_cancel.py);
  - the metrics store: SeamMetricsStore, which does not count the dry runs;
  - the context compactor, wrapped (compaction_aware) so a dry run knows when it is compacting.
"""

import functools
import importlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, List, Optional

from fastapi import HTTPException, Request
from mlx_vlm.server.generation import (
    GenerationArguments,
    ResponseGenerator,
    ServerMetricsStore,
    _check_configured_context_budget,
    _count_prompt_tokens,
    get_server_max_tokens,
)

from .errors import SeamError, bad_request
from .vlm_cancel import WATCH


def server_module(name: str) -> Any:
    # mlx_vlm.server re-exports its `app` module's names, so `mlx_vlm.server.app` is the FastAPI
    # object, not the module; importlib returns the module itself.
    return importlib.import_module(f"mlx_vlm.server.{name}")



@dataclass
class _Probe:
    """One dry run of the chat endpoint: what the seam learns from it."""

    ids: Optional[List[int]] = None
    media: bool = False  # the request carries images, audio or video
    compacting: bool = False  # inside mlx-vlm's context compaction
    compacted: bool = False  # compaction wanted to summarize (the prompt does not fit)


_PROBE: ContextVar[Optional[_Probe]] = ContextVar("hetero_probe", default=None)


class _ProbeDone(BaseException):
    """Ends a dry run once the request is tokenized.

    A BaseException, so the endpoint's `except Exception` handlers (which log a traceback and
    answer 500) let it through to the seam.
    """


class SeamResponseGenerator(ResponseGenerator):
    """mlx-vlm's ResponseGenerator; inside a dry run, generate() tokenizes and stops; outside
    one, a generation for a caller that has hung up is not queued and each one's token iterator
    is watched (vlm_cancel.py).

    The tokenization is generate()'s own: the request's prompt through _preprocess_request with
    the request's preprocessing arguments, under the tokenizer lock, then the configured context
    budget check. Outside a dry run every call goes to mlx-vlm unchanged.
    """

    def generate(self, prompt, images=None, audio=None, args=None, videos=None):
        probe = _PROBE.get()
        if probe is None:
            # A request's generation, watched for its caller's hang-up (vlm_cancel.py).
            watch = WATCH.get()
            if watch is not None:
                watch.check()
            ctx, tokens = super().generate(
                prompt, images=images, audio=audio, args=args, videos=videos
            )
            return ctx, (watch.track(tokens) if watch is not None else tokens)
        if probe.compacting:
            probe.compacted = True
            raise _ProbeDone()
        if images or audio or videos:
            probe.media = True
            raise _ProbeDone()
        self.wait_until_ready()
        args = args or GenerationArguments(max_tokens=get_server_max_tokens())
        with self._tokenizer_lock:
            raw_inputs = self._preprocess_request(prompt, **args.preprocessing_kwargs())
        probe.ids = [int(t) for t in raw_inputs["input_ids"].reshape(-1).tolist()]
        _check_configured_context_budget(_count_prompt_tokens(raw_inputs), args.max_tokens)
        raise _ProbeDone()


class SeamMetricsStore(ServerMetricsStore):
    """mlx-vlm's request metrics, without the seam's dry runs."""

    def begin_request(self, **kwargs: Any):
        if _PROBE.get() is None:
            super().begin_request(**kwargs)

    def record_success(self, envelope: dict):
        if _PROBE.get() is None:
            super().record_success(envelope)

    def record_failure(self, **kwargs: Any):
        if _PROBE.get() is None:
            super().record_failure(**kwargs)



def compaction_aware(compact: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """mlx-vlm compacts a chat whose prompt exceeds the context window by generating a summary
    through the same generate(); a dry run must not take that summary's ids for the request's."""

    @functools.wraps(compact)
    async def wrapper(*args: Any, **kwargs: Any):
        probe = _PROBE.get()
        if probe is None:
            return await compact(*args, **kwargs)
        probe.compacting = True
        try:
            return await compact(*args, **kwargs)
        finally:
            probe.compacting = False

    return wrapper


def _check_chat_body(body: Dict[str, Any], model: str) -> None:
    """Checks the server itself would skip or could only answer by reloading."""
    if "messages" not in body:
        if "prompt" in body:
            raise bad_request(
                "unsupported_endpoint", "mlx-vlm serves /v1/chat/completions only (no prompt)"
            )
        raise bad_request("missing_prompt", "body has neither messages nor prompt")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad_request("bad_messages", "messages must be a non-empty list")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise bad_request("bad_messages", "each message must be an object with a role")
    # mlx-vlm unloads the served model to load any other one a request names.
    if "model" in body and body["model"] != model:
        raise SeamError(
            404,
            "model_not_served",
            f"model {body['model']!r} is not served here; this is {model!r}",
        )
    if body.get("adapter_path") is not None:
        raise bad_request("adapter_not_served", "requests naming an adapter are not bridged")


async def tokenize_dry_run(
    request: Request, body: Dict[str, Any], model: str
) -> Dict[str, Any]:
    """Runs mlx-vlm's chat endpoint on the body with generate() tokenizing and stopping.

    Everything before generation is the server's own: request validation, message
    normalization, tools, compaction, the chat template, generation arguments and the
    processor call. Streaming is off for the dry run only; it changes nothing before it.
    """
    _check_chat_body(body, model)
    schemas, openai = server_module("schemas"), server_module("openai")
    try:
        chat = schemas.ChatRequest.model_validate(body)
    except Exception as e:  # pydantic's ValidationError: FastAPI would answer 422
        message = f"mlx-vlm rejected the request: {e}"
        raise SeamError(422, "rejected_by_server", message) from None
    chat = chat.model_copy(update={"stream": False})
    probe = _Probe()
    token = _PROBE.set(probe)
    try:
        await openai.chat_completions_endpoint(chat, request)
    except _ProbeDone:
        pass
    except HTTPException as e:
        if 400 <= e.status_code < 500:
            message = f"mlx-vlm rejected the request: {e.detail}"
            raise SeamError(e.status_code, "rejected_by_server", message) from None
        raise bad_request("tokenize_failed", str(e.detail)) from None
    finally:
        _PROBE.reset(token)
    if probe.media:
        raise bad_request("images_unsupported", "prompts with images are not bridged")
    if probe.compacted:
        raise bad_request(
            "context_exceeded", "the prompt exceeds the context window; mlx-vlm compacts it"
        )
    if probe.ids is None:
        raise SeamError(500, "internal", "the dry run ended before tokenization")
    # mlx-vlm does not split prompts into segments: one covers the whole prompt.
    n = len(probe.ids)
    return {"ids": probe.ids, "n": n, "segments": [{"type": "prompt", "n": n}]}
