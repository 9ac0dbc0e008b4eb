"""`serve`: mlx-lm's own OpenAI server, built as mlx_lm.server.run builds it, plus the seam.

Construction, in order:
  1. mlx_lm.server.main() parses the command line with mlx-lm's own parser, so every server
     option keeps mlx-lm's default (and any extra mlx-lm option passes through); main() ends
     by calling mlx_lm.server.run(host, port, ModelProvider(args)), which is swapped for the
     duration of that call to capture the provider instead of serving.
  2. As run() does: a prompt cache of cli_args.prompt_cache_size entries (here the locked
     subclass) and a ResponseGenerator, whose generation thread loads the model.
  3. Wait until the model is loaded, so /health and the seam only answer once it can serve.
  4. As run() does: _run_http_server(host, port, generator), here with the seam's handler.
     (run() accepts a handler_class but does not pass it on, so it cannot be used directly.)

Models whose config.json names a model_type that mlx-vlm serves (DeepSeek-V4) go to
vlm_serve.serve instead: mlx-vlm's own server with the same seam.
"""

import functools
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx_lm.server as mlx_server
from mlx_lm.server import ModelProvider, ResponseGenerator

from .access import RequestAuth, dumps_dir, read_secret
from .bounds import (
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_REQUEST_DEADLINE_S,
    SeamHTTPServer,
)
from .llama import describe
from .pins import Pins
from .prompt_cache import LockedPromptCache
from .schedule import CallRecorder
from .seam import Seam, SeamHandler, run_capturing
from .tenants import Tenants

log = logging.getLogger("hetero_mlx")

LOAD_TIMEOUT_S = 3600.0


def mlx_provider(argv: List[str]) -> ModelProvider:
    """A ModelProvider from mlx-lm's own CLI parser and startup (logging, wired limit)."""
    args, _ = run_capturing(mlx_server, "run", mlx_server.main, ["mlx_lm.server", *argv])
    return args[2]  # run(host, port, provider, ...)


def _signal_when_loaded(provider: ModelProvider) -> threading.Event:
    """An event set once the generation thread's load_default() returns (or fails)."""
    loaded = threading.Event()
    load_default = provider.load_default

    def load_and_signal():
        try:
            load_default()
        finally:
            loaded.set()

    provider.load_default = load_and_signal
    return loaded


def _wait_for_model(provider: ModelProvider, generator: ResponseGenerator, loaded) -> None:
    if not loaded.wait(LOAD_TIMEOUT_S) or provider.model is None:
        generator.stop_and_join()
        raise SystemExit(f"hetero_mlx: model {provider.cli_args.model} did not load")


# config.json model types whose decoder is mlx-vlm's server (see vlm_serve.py).
VLM_MODEL_TYPES = ("deepseek_v4",)


def _model_type(argv: List[str]) -> Optional[str]:
    """model_type from config.json of a local --model directory (None for anything else)."""
    model = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--model"), None)
    try:
        return json.loads((Path(model) / "config.json").read_text()).get("model_type")
    except (TypeError, OSError, ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class PortLimits:
    """serve's bounds on the decoder's port (bounds.py)."""

    request_deadline_s: float = DEFAULT_REQUEST_DEADLINE_S
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT
    max_body_mb: int = DEFAULT_MAX_BODY_MB


def serve(
    argv: List[str],
    store: Optional[Path],
    test_faults: bool = False,
    secret_file: Optional[Path] = None,
    limits: PortLimits = PortLimits(),
) -> None:
    """Runs the server until interrupted; argv is the decoder server's options. test_faults
    enables POST /hetero/fault (pins.py), for the front door's tests only; with secret_file,
    every request must be signed with the secret it holds (access.py)."""
    if _model_type(argv) in VLM_MODEL_TYPES:
        from .vlm_serve import serve as serve_vlm

        return serve_vlm(argv, store, test_faults, secret_file, limits)
    secret = read_secret(secret_file) if secret_file else None
    dumps = dumps_dir(store)
    provider = mlx_provider(argv)
    log.info("mlx-lm options: %s", vars(provider.cli_args))
    group = mx.distributed.init()
    loaded = _signal_when_loaded(provider)
    pins = Pins(faults_enabled=test_faults)
    tenants = Tenants()
    prompt_cache = LockedPromptCache(
        provider.cli_args.prompt_cache_size, pins=pins, tenants=tenants
    )
    generator = ResponseGenerator(provider, prompt_cache)
    tenants.attach(generator)  # before the port opens: no request has come yet
    _wait_for_model(provider, generator, loaded)
    if group.rank() != 0:
        generator.join()
        return
    try:
        desc = describe(provider.model)
    except ValueError as e:
        generator.stop_and_join()
        raise SystemExit(f"hetero_mlx: {e}") from None
    log.info(
        "seam: %s fingerprint %s, store %s, %s",
        desc["model_type"],
        desc["fingerprint"],
        store,
        "every request signed" if secret else "open (no --secret-file)",
    )
    log.info("port bounds: %s", limits)
    # Tests compare the calls the seam predicts with those the model gets (schedule.py).
    calls = CallRecorder(provider.model) if test_faults else None
    auth = RequestAuth(secret) if secret else None
    seam = Seam(provider, prompt_cache, desc, store, dumps=dumps, auth=auth, calls=calls)
    args = provider.cli_args
    handler = functools.partial(SeamHandler, seam=seam)
    server_class = SeamHTTPServer.configured(
        limits.request_deadline_s, limits.max_connections_per_client, limits.max_body_mb
    )
    mlx_server._run_http_server(
        args.host, args.port, generator, server_class=server_class, handler_class=handler
    )
