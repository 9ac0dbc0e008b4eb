"""`serve` for DeepSeek-V4: mlx-vlm's own OpenAI server (FastAPI + uvicorn) plus the seam.

The decoder is mlx-vlm 0.7.10, unmodified. Its only cross-request prompt cache is APC
(mlx_vlm/apc.py); for DeepSeek-V4's windowed and pooled caches APC keeps whole-prefix
checkpoints (`APCManager._exact_cache`), and the seam mounts into exactly that.

Construction, in order:
  1. APC on and its disk tier off, unless the environment says otherwise (the seam then
     refuses to start: a disk tier would serve prefixes that cached_prefix and clear cannot see).
  2. mlx_vlm.server.cli.main() parses the command line with mlx-vlm's own parser and publishes
     the options as it always does (environment, runtime.config); its closing uvicorn.run is
     swapped for the duration of that call to capture the server arguments instead.
  3. Three substitutions in mlx-vlm's server modules, before the model loads (vlm_tokenize.py):
     the response generator class (a subclass that can tokenize a request without generating),
     the metrics store (one that does not count those dry runs), and the context compactor
     (wrapped so a dry run knows when it is compacting).
  4. The app's lifespan is wrapped: once mlx-vlm's own startup has loaded the model, the seam
     (VlmSeam.attach, vlm_seam.py) describes it and checks the prefix cache; a failure stops the
     server before its port opens.
  5. The /hetero/ routes are added to mlx-vlm's FastAPI app, which uvicorn then serves, with
     one middleware outside mlx-vlm's own (SeamGate, vlm_gate.py: every request signed, bodies
     bounded and checked, tenant salts as mlx-vlm's own APC tenants, no CORS on /hetero/, no
     unloading, no request for a dead generation thread, a caller's hang-up stopping its
     generations: vlm_cancel.py), on uvicorn's h11 protocol with the port's bounds (vlm_port.py:
     request deadline, per-client and total connection caps, header bytes; no WebSockets) and
     a default executor as large as the connection cap.
  6. mlx-vlm's model loader, as its endpoints reach it, is wrapped: once the seam is attached,
     a request naming another model (or adapter, or kind of model) is refused before it loads
     (mlx-vlm would unload the served model first).

  POST /hetero/tokenize       OpenAI chat body -> {"ids", "n", "segments"} (mlx-vlm's own path)
  GET  /hetero/info           model layout, fingerprint, versions, prefix-cache state
  POST /hetero/cached_prefix  {"ids"} -> {"cached_tokens", "n"} (read-only)
  POST /hetero/mount          {"entry", "ids"} -> {"mounted": B, "pin"} (pins.py)
  POST /hetero/unpin          {"pin", "evict"?} -> {"released": bool, "evicted": bool}
  POST /hetero/cache          {"ids", "B", "out": name} -> {"B", "path", "window_idx"} (truth
                              dump into <store>/dumps/name)
  POST /hetero/clear          -> {"cleared": number of checkpoints dropped} (and every pin)
  POST /hetero/fault          {"kind"} -> {"armed"} (serve --test-faults only; pins.py)

What each endpoint does is VlmSeam's (vlm_seam.py: tenants, pins, mounts); the tokenize dry run
is vlm_tokenize.py's. This module installs them and starts the server.
"""

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List, Optional

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from .access import check_json_body, read_secret
from .bounds import ConnectionBounds
from .errors import SeamError
from .pins import unpin_request
from .seam import parse_body, run_capturing
from .vlm_gate import ModelNotServed, SeamGate, guard_loader
from .vlm_port import port_options
from .vlm_seam import VlmSeam
from .vlm_tokenize import SeamMetricsStore, SeamResponseGenerator, compaction_aware, server_module

log = logging.getLogger("hetero_mlx")

PREFIX = "/hetero/"
# The seam needs APC's in-memory checkpoints and nothing else; see the module docstring.
APC_DEFAULTS = {"APC_ENABLED": "1", "APC_DISK_ENABLED": "0"}


# ---- HTTP --------------------------------------------------------------------------------


def _install_routes(app: Any, seam: VlmSeam) -> None:
    """The /hetero/ routes on mlx-vlm's app. Each answers JSON; nothing raises out of one.

    SeamGate has checked the request's signature (with a secret); without one, every route
    checks mlx-vlm's management API key as mlx-vlm's own management routes do. Then a POST
    body must be JSON (access.py).
    Work that touches MLX arrays or waits on APC's lock runs on a worker thread (arrays made
    there are evaluated there); the tokenize dry run runs on the event loop, as mlx-vlm's
    endpoint does.
    """
    require_key = server_module("app")._require_management_api_key

    def authorize(request: Request) -> None:
        if seam.auth is None:
            require_key(request)

    def route(handler: Callable[..., Awaitable[Dict[str, Any]]], has_body: bool):
        async def endpoint(request: Request) -> JSONResponse:
            headers = {}
            try:
                authorize(request)
                if has_body:
                    check_json_body(request.headers.get("content-type"))
                body = parse_body(await request.body()) if has_body else {}
                status, reply = 200, await handler(request, body)
            except SeamError as e:
                status, reply, headers = e.status, e.body(), e.headers
            except HTTPException as e:
                status = e.status_code
                reply = {"error": {"code": "unauthorized", "message": str(e.detail)}}
            except Exception as e:  # a bug, not a client error: still a JSON reply
                log.exception("seam %s failed", request.url.path)
                status, reply = 500, {"error": {"code": "internal", "message": str(e)}}
            if status == 401 and not headers:  # mlx-vlm's own API key
                headers["WWW-Authenticate"] = "Bearer"
            return JSONResponse(reply, status_code=status, headers=headers)

        return endpoint

    def threaded(fn: Callable[[Dict[str, Any]], Dict[str, Any]]):
        async def handler(request: Request, body: Dict[str, Any]) -> Dict[str, Any]:
            return await asyncio.to_thread(fn, body)

        return handler

    async def not_found(request: Request, body: Dict[str, Any]) -> Dict[str, Any]:
        raise SeamError(404, "not_found", f"no seam endpoint {request.method} {request.url.path}")

    info = threaded(lambda body: seam.info())
    app.add_api_route(PREFIX + "info", route(info, False), methods=["GET"])
    app.add_api_route(PREFIX + "tokenize", route(seam.tokenize, True), methods=["POST"])
    for name, fn in (
        ("cached_prefix", seam.cached_prefix),
        ("mount", seam.mount),
        ("cache", seam.cache_dump),
        ("clear", lambda body: seam.clear()),
        ("unpin", lambda body: unpin_request(seam.pins, body, seam.evict)),
        ("fault", seam.pins.arm),
    ):
        app.add_api_route(PREFIX + name, route(threaded(fn), True), methods=["POST"])
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    app.add_api_route(PREFIX + "{rest:path}", route(not_found, False), methods=methods)

    async def refused(request: Request, exc: ModelNotServed) -> JSONResponse:
        log.warning("refused %s: %s", request.url.path, exc.error.message)
        return JSONResponse(exc.error.body(), status_code=exc.error.status)

    app.add_exception_handler(ModelNotServed, refused)
    app.add_middleware(SeamGate, seam=seam)  # added last: outermost, outside mlx-vlm's CORS


# ---- startup -----------------------------------------------------------------------------


def _vlm_cli(argv: List[str]) -> Dict[str, Any]:
    """mlx-vlm's own CLI on argv; returns the keyword arguments it would give uvicorn.run."""
    import uvicorn

    cli = server_module("cli")
    _, kwargs = run_capturing(uvicorn, "run", cli.main, ["mlx_vlm.server", *argv])
    return kwargs


def _model_arg(argv: List[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    raise SystemExit("hetero_mlx: serve needs --model")


def serve(
    argv: List[str],
    store: Optional[Path],
    test_faults: bool = False,
    secret_file: Optional[Path] = None,
    limits: Any = None,
) -> None:
    """Runs mlx-vlm's server with the seam until interrupted; argv is mlx-vlm server options;
    limits: serve.PortLimits (the request deadline and per-client cap: vlm_port.py; the body
    size: SeamGate)."""
    import uvicorn

    secret = read_secret(secret_file) if secret_file else None
    for name, value in APC_DEFAULTS.items():
        os.environ.setdefault(name, value)
    run_kwargs = _vlm_cli(argv)
    if run_kwargs.pop("reload", False):
        raise SystemExit("hetero_mlx: --reload is not supported with the seam")
    run_kwargs.pop("workers", None)

    app_module = server_module("app")
    app_module.ResponseGenerator = SeamResponseGenerator
    app_module.runtime.metrics = SeamMetricsStore()
    compaction = server_module("compaction")
    compaction.compact_response_context = compaction_aware(compaction.compact_response_context)

    if limits is None:
        from .serve import PortLimits

        limits = PortLimits()
    seam = VlmSeam(_model_arg(argv), store, test_faults, secret, limits.max_body_mb)
    seam.bounds = ConnectionBounds(limits.request_deadline_s, limits.max_connections_per_client)
    run_kwargs.update(port_options(seam.bounds))
    app = app_module.app
    startup = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan_with_seam(app_: Any):
        # mlx-vlm's endpoints run each non-streaming generation, and the seam each of its
        # requests, on the loop's default executor (asyncio.to_thread), whose default size
        # (CPUs + 4) let a few long completions stall every other request: a worker for each
        # connection the port admits (vlm_port.py), made as needed.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=seam.bounds.max_total, thread_name_prefix="vlm-worker")
        )
        async with startup(app_) as state:
            try:
                seam.attach()
            except (RuntimeError, ValueError) as e:
                log.error("hetero_mlx: %s", e)
                # Its generation thread would otherwise die with the interpreter mid-MLX call.
                generator = app_module.runtime.response_generator
                if generator is not None:
                    generator.stop_and_join()
                raise
            yield state

    app.router.lifespan_context = lifespan_with_seam
    _install_routes(app, seam)
    guard_loader(seam)
    log.info("mlx-vlm options: %s", app_module.runtime.config.current())
    log.info("port bounds: %s", limits)
    uvicorn.run(app, **run_kwargs)
