"""VlmSeam: the /hetero/ endpoints' work on mlx-vlm's runtime (vlm_serve.py installs the routes).

mlx-vlm's only cross-request prompt cache is APC (mlx_vlm/apc.py); for DeepSeek-V4's windowed
and pooled caches APC keeps whole-prefix checkpoints (`APCManager._exact_cache`), and the seam
mounts into exactly that, reads it (cached_prefix, cache) and clears it. The tokenize dry run is
vlm_tokenize.py's.

Tenants: a body's "hetero_cache_salt" becomes mlx-vlm's own tenant header (SeamGate), which
APC mixes into every checkpoint's extra_hash; the seam's endpoints take the salt from their body
and use that partition's extra_hash (VlmSeam.partition).

Pins: the generator's own lookup (APCManager.lookup_exact_cache, called per request) is wrapped
on the manager instance so that a pinned checkpoint evicted since its mount is stored again
before the lookup; APC may still decline it for memory, which the front door's confirmation
against the decoder's usage catches.
"""

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
from fastapi import Request
from mlx_vlm import apc as vlm_apc
from mlx_vlm.version import __version__ as mlx_vlm_version

from . import STORE_FORMAT, dsv4
from .access import RequestAuth, dumps_dir, write_dump
from .bounds import DEFAULT_MAX_BODY_MB, ConnectionBounds
from .cancel import Liveness
from .errors import SeamError, bad_request, conflict
from .pins import Pins
from .store import Layout, dump_request, entry_path, read_entry, request_ids
from .tenants import take_salt
from .vlm_gate import Admissions, ModelNotServed, tenant_of
from .vlm_tokenize import SeamResponseGenerator, server_module, tokenize_dry_run

log = logging.getLogger("hetero_mlx")

# Model types served through mlx-vlm, and the family module of each.
FAMILIES = {"deepseek_v4": dsv4}


class VlmSeam:
    """What the seam endpoints share: mlx-vlm's runtime, its prefix cache and the family."""

    def __init__(
        self,
        model_path: str,
        store: Optional[Path],
        test_faults: bool = False,
        secret: Optional[str] = None,
        max_body_mb: int = DEFAULT_MAX_BODY_MB,
    ):
        self.model_path = model_path
        self.store = store
        self.dumps = dumps_dir(store)  # where /hetero/cache writes (access.py)
        # Every request on the port must be signed (access.py; checked by SeamGate).
        self.auth = RequestAuth(secret) if secret else None
        self.max_body_bytes = max_body_mb << 20
        self.adapter_path: Optional[str] = None  # the served model's adapter, once attached
        self.pins = Pins(faults_enabled=test_faults)
        self.runtime = server_module("runtime").runtime
        self.generator: Any = None
        self.manager: Any = None
        self.family: Any = None
        self.desc: Dict[str, Any] = {}
        self.extra_hash = 0
        self._salted_hashes: Dict[str, int] = {}
        self.admissions = Admissions()  # requests in flight by clear epoch (vlm_gate.py)
        self.liveness = Liveness()  # generations in flight, stopped on hang-up (vlm_cancel.py)
        self.bounds: Optional[ConnectionBounds] = None  # the port's (vlm_port.py), once serving
        self._store: Any = None  # APC's own store_exact_cache, for the seam's mounts
        self._hash_inputs: Dict[str, Any] = {}
        self.media_ids: set = set()

    def attach(self) -> None:
        """After mlx-vlm's startup: describe the loaded model and check the prefix cache."""
        generator, manager = self.runtime.response_generator, self.runtime.apc_manager
        if not isinstance(generator, SeamResponseGenerator) or generator.model is None:
            raise RuntimeError("mlx-vlm loaded no text model through the seam's generator")
        if manager is None:
            raise RuntimeError("mlx-vlm's prefix cache (APC) is off; the seam needs APC_ENABLED=1")
        if manager.disk is not None:
            raise RuntimeError("APC's disk tier is on; the seam needs APC_DISK_ENABLED=0")
        if manager._exact_cache_max < 1:
            raise RuntimeError("APC keeps no checkpoints in memory (APC_CHECKPOINT_ENTRIES=0)")
        lm = dsv4.language_model(generator.model)
        model_type = getattr(lm.config, "model_type", None)
        if model_type not in FAMILIES:
            raise RuntimeError(f"no seam family for model_type {model_type!r}")
        if vlm_apc.model_apc_mode(lm) != "exact":
            raise RuntimeError("APC does not keep whole-prefix checkpoints for this model")
        self.family = FAMILIES[model_type]
        self.desc = self.family.describe(generator.model)
        self.generator, self.manager = generator, manager
        loaded = server_module("app")._model_cache_registry().for_kind("text_generation")
        self.adapter_path = (loaded or {}).get("adapter_path")
        # The salt generate() gives a text-only request without tenant headers (the front
        # forwards none): mlx-vlm's default tenant, no media, the model's own key dependencies.
        tenant = server_module("app")._read_tenant_id(None)
        self._hash_inputs = dict(
            image_hash=0, media={"audio": None, "video": None}, model=lm,
            processor=generator.processor,
        )
        self.extra_hash = vlm_apc.semantic_extra_hash(tenant=tenant, **self._hash_inputs)
        self.media_ids = vlm_apc.multimodal_token_ids_from_config(lm.config)
        self._guard_stores(manager)
        self._honour_pins(manager)
        log.info(
            "seam: %s fingerprint %s, store %s, APC checkpoints %d (interval %d, guard %d)",
            self.desc["family"],
            self.desc["fingerprint"],
            self.store,
            manager._exact_cache_max,
            manager.checkpoint_interval_tokens,
            manager.exact_cache_guard_tokens,
        )

    def partition(self, salt: str) -> int:
        """APC's extra_hash for a tenant's salt (tenants.py): the hash mlx-vlm computes for a
        text-only request whose tenant header is tenant_of(salt); no salt, the default one."""
        if not salt:
            return self.extra_hash
        if salt not in self._salted_hashes:
            self._salted_hashes[salt] = vlm_apc.semantic_extra_hash(
                tenant=tenant_of(salt), **self._hash_inputs
            )
        return self._salted_hashes[salt]

    def generation_alive(self) -> bool:
        """mlx-vlm's generation thread is running (once it dies, every request waits forever
        on a queue nobody fills)."""
        generator = self.generator
        thread = getattr(generator, "_thread", None)
        return generator is None or thread is None or thread.is_alive()

    def _guard_stores(self, manager: Any) -> None:
        """Wraps APC's checkpoint store (on this instance) so that nothing computed for a request
        admitted before the last /hetero/clear is stored after it (Admissions). The seam's own
        stores (mounts, pins) call the original."""
        store = self._store = manager.store_exact_cache

        def store_unless_stale(token_ids: Any, prompt_cache: Any, **kwargs: Any) -> bool:
            if self.admissions.older_in_flight():
                self.admissions.dropped += 1
                return False
            return store(token_ids, prompt_cache, **kwargs)

        manager.store_exact_cache = store_unless_stale

    def _honour_pins(self, manager: Any) -> None:
        """Wraps the manager's lookup (on this instance only) so pins hold until it runs; a
        lookup takes only the pins of its own partition (extra_hash)."""
        lookup = manager.lookup_exact_cache

        def lookup_with_pins(token_ids: Any, *args: Any, **kwargs: Any):
            extra_hash = kwargs.get("extra_hash", args[0] if args else 0)
            fault = self.pins.take_fault()
            if fault:  # a test's eviction, right before the lookup (pins.py)
                manager.clear()
                if fault == "drop-mount":
                    self.pins.clear()
            pins = self.pins.take_matching(
                [int(t) for t in token_ids], lambda p: p.payload[0] == extra_hash
            )
            for pin in pins:
                with manager.lock:
                    held = any(
                        e.token_ids == pin.prefix and e.extra_hash == extra_hash
                        for e in manager._exact_cache.values()
                    )
                if not held:  # evicted since the mount: store it again (APC keeps a copy)
                    self._store(list(pin.prefix), pin.payload[1], extra_hash=extra_hash)
            return lookup(token_ids, *args, **kwargs)

        manager.lookup_exact_cache = lookup_with_pins

    def check_load(self, model_path: Any, adapter_path: Any, model_kind: str) -> None:
        """Refuses, once attached, a load of anything but the served text model: mlx-vlm would
        first unload the served one (get_cached_model). Other kinds (embeddings, audio,
        images) would load a second model beside it; this decoder serves one."""
        if self.generator is None:
            return  # mlx-vlm's own startup, loading the served model
        if model_path != self.model_path or model_kind not in ("auto", "text_generation"):
            raise ModelNotServed(
                404,
                "model_not_served",
                f"model {model_path!r} ({model_kind}) is not served here; this decoder serves "
                f"{self.model_path!r} for text generation and loads no other",
            )
        inherit = server_module("app")._INHERIT_ADAPTER
        if adapter_path is not inherit and adapter_path != self.adapter_path:
            raise ModelNotServed(
                400, "adapter_not_served", f"adapter {adapter_path!r} is not served here"
            )

    def _live(self) -> Any:
        """The generator the seam attached to, while it is still the one serving."""
        generator = self.runtime.response_generator
        if generator is None or generator is not self.generator or generator.model is None:
            # mlx-vlm unloads its model for /unload or a request naming another model.
            raise SeamError(503, "no_model", "the decoder no longer serves its starting model")
        if not self.generation_alive():
            raise SeamError(
                503, "generation_dead", "the decoder's generation thread has died; restart it"
            )
        return generator

    # ---- endpoints ---------------------------------------------------------------------

    def info(self) -> Dict[str, Any]:
        generator = self._live()
        info = {k: v for k, v in self.desc.items()}
        manager = self.manager
        config = dsv4.language_model(generator.model).config
        info.update(
            model=self.model_path,
            # The exact `model` string requests must carry (mlx-vlm unloads its model for any
            # other name); the front door forwards it.
            forward_model=self.model_path,
            prefill_step_size=generator._effective_prefill_step_size(),
            # How this server prefills the prefix it checkpoints at B (the ids before the last),
            # from 0 or from a cached prefix: calls of `step` counted from where it starts, also
            # cut at its interval checkpoints (multiples of the interval, rounded up to the
            # block, the latest checkpoint_entries - 1 of them, none under min_tokens), and the
            # last token runs alone after the checkpoint. The cache program replays this.
            prefill={
                "step": generator._effective_prefill_step_size(),
                "checkpoint_interval": manager.checkpoint_interval_tokens,
                "checkpoint_entries": manager._exact_cache_max,
                "block_size": manager.block_size,
                "min_tokens": manager.exact_cache_min_tokens,
                "last_alone": False,
            },
            store_format=STORE_FORMAT,
            store=str(self.store) if self.store else None,
            versions={"mlx": mx.__version__, "mlx_vlm": mlx_vlm_version},
            context_window=getattr(config, "max_position_embeddings", None),
            min_mount_tokens=manager.exact_cache_min_tokens,
            apc={
                "checkpoint_entries": manager._exact_cache_max,
                "checkpoint_interval_tokens": manager.checkpoint_interval_tokens,
                "checkpoint_guard_tokens": manager.exact_cache_guard_tokens,
                "block_size": manager.block_size,
            },
        )
        with manager.lock:
            entries = list(manager._exact_cache.values())
            info["prompt_cache"] = {
                "sequences": len(entries),
                "bytes": sum(vlm_apc._cache_nbytes(e.prompt_cache) for e in entries),
            }
        admissions = self.admissions
        info["partitions"] = {
            "epoch": admissions.epoch,
            "in_flight": admissions.in_flight(),
            "dropped_inserts": admissions.dropped,
        }
        info["requests"] = self.liveness.stats()
        if self.bounds is not None:
            info["connections"] = self.bounds.stats()
        return info

    async def tokenize(self, request: Request, body: Dict[str, Any]) -> Dict[str, Any]:
        """The request's ids as mlx-vlm's chat endpoint makes them: a dry run (vlm_tokenize.py)."""
        self._live()
        take_salt(body)  # the ids do not depend on the partition
        return await tokenize_dry_run(request, body, self.model_path)

    def cached_prefix(self, body: Dict[str, Any]) -> Dict[str, Any]:
        self._live()
        extra_hash = self.partition(take_salt(body))
        ids = request_ids(body, self.desc["vocab_size"])
        return {"cached_tokens": self.reuse_length(ids, extra_hash), "n": len(ids)}

    def reuse_length(self, ids: List[int], extra_hash: Optional[int] = None) -> int:
        """How many leading ids the next request for `ids` reuses from the prefix cache.

        The decision of BatchGenerator._apc_pick_for (apc_lookup_plan in checkpoint mode and
        APCManager.lookup_exact_cache's choice of entry), made on the live entries without
        cloning or reordering them. Not predicted: lookup_exact_cache declining a hit when
        restoring it would exceed APC's memory budget.
        """
        n = len(ids)
        if n < 2:
            return 0
        extra_hash = self.extra_hash if extra_hash is None else extra_hash
        tokens = tuple(ids)
        safe_min = max(0, vlm_apc.media_safe_prefix_min(ids, self.media_ids) - 1)
        best, manager = 0, self.manager
        with manager.lock:
            for entry in manager._exact_cache.values():
                if entry.extra_hash != extra_hash:
                    continue
                trimmable = vlm_apc._dense_checkpoint_trimmable(
                    entry.prompt_cache, len(entry.token_ids)
                )
                length = vlm_apc._checkpoint_match_len(
                    tokens, entry.token_ids, n - 1, manager.block_size, trimmable
                )
                if length > max(safe_min, best):
                    best = length
        text_tail = vlm_apc.prefix_leaves_text_only_suffix(ids, best, self.media_ids)
        return best if 0 < best < n and text_tail else 0

    def _layout(self, n_tokens: int, start: int, extra: Dict[str, int]) -> Layout:
        shapes = self.family.array_shapes(self.desc, n_tokens, extra["window_idx"], start)
        return Layout(shapes, self.desc["dtype"])

    def _checkpoint(self, prefix: List[int], extra_hash: int) -> Optional[Any]:
        """APC's own checkpoint of exactly these tokens (in this partition), or None."""
        key, manager = tuple(prefix), self.manager
        with manager.lock:
            entries = list(manager._exact_cache.values())
        found = [e for e in entries if e.extra_hash == extra_hash and e.token_ids == key]
        return found[0] if found else None

    def _extend(self, ids: List[int], entry: Any, extra_hash: int) -> Dict[str, mx.array]:
        """A tail's arrays on top of the decoder's own checkpoint of ids[:start]: its pooled rows
        first, then the tail's; the window and buffers are the tail's (those at B). The tail was
        computed for exactly these ids and this fingerprint (read_entry checked both) from the
        prefill host's own state at start; a decoder that no longer holds that checkpoint
        refuses, and the request goes on without the bridge."""
        start = entry.start
        found = self._checkpoint(ids[:start], extra_hash)
        if found is None:
            raise conflict(
                "prefix_not_cached",
                f"the tail extends the decoder's checkpoint of {start} tokens, which it no "
                "longer holds",
            )
        try:
            prefix, _ = self.family.cache_arrays(found.prompt_cache, start)
        except ValueError as e:
            raise conflict("prefix_not_cached", f"the decoder's checkpoint: {e}") from None
        arrays = dict(entry.arrays)
        for name, rows in entry.arrays.items():
            if name.endswith(".pooled"):
                arrays[name] = mx.concatenate([prefix[name], rows], axis=1)
        return arrays

    def mount(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """Builds the family's cache objects from a store entry and stores them as an APC
        checkpoint for ids[:B], through APCManager.store_exact_cache (which keeps a copy). A
        tail's entry (start > 0) extends the decoder's own checkpoint of ids[:start]."""
        generator = self._live()
        extra_hash = self.partition(take_salt(body))
        ids = request_ids(body, self.desc["vocab_size"])
        entry = read_entry(
            entry_path(body, self.store),
            ids,
            self.desc,
            self._layout,
            extra_ints=("window_idx",),
            tails=True,
        )
        n, window_idx = entry.n_tokens, entry.extra["window_idx"]
        manager = self.manager
        if n < manager.exact_cache_min_tokens:
            raise bad_request(
                "prefix_too_short",
                f"B={n}: mlx-vlm keeps no checkpoint under {manager.exact_cache_min_tokens} tokens",
            )
        arrays = self._extend(ids, entry, extra_hash) if entry.start > 0 else entry.arrays
        _check_window(arrays, self.desc["layers"], n, window_idx)
        try:
            cache = self.family.build_cache(generator.model, arrays, n, window_idx)
        except (ValueError, IndexError) as e:
            raise conflict("layout_mismatch", f"cannot build the decoder's cache: {e}") from None
        if not self._store(ids[:n], cache, extra_hash=extra_hash):
            raise conflict(
                "mount_refused",
                f"mlx-vlm's prefix cache did not keep the entry (budget {manager.memory_max_bytes} "
                "bytes; APC_MEMORY_MAX_GB raises it)",
            )
        pin = self.pins.add(ids[:n], (extra_hash, cache))
        log.info("mounted %d tokens from %s (pin %s)", n, body["entry"], pin)
        return {"mounted": n, "pin": pin}

    def cache_dump(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """The server's own checkpoint for exactly ids[:B], as store arrays (the truth for tests).

        DeepSeek-V4 checkpoints cannot be trimmed to a shorter prefix, so only a B at which the
        server took a checkpoint (the prompt minus its guard token, or an interval boundary) or
        at which one was mounted can be dumped. Entries are copies no request mutates.
        """
        self._live()
        extra_hash = self.partition(take_salt(body))
        ids = request_ids(body, self.desc["vocab_size"])
        n, out = dump_request(body, ids, self.dumps)
        prefix, manager = tuple(ids[:n]), self.manager
        with manager.lock:
            entries = list(manager._exact_cache.values())
        ours = [e for e in entries if e.extra_hash == extra_hash]
        found = [e for e in ours if e.token_ids == prefix]
        if not found:
            # The checkpoints along these ids: the B values that would have worked.
            lengths = [len(e.token_ids) for e in ours]
            held = sorted(k for e, k in zip(ours, lengths) if e.token_ids == tuple(ids[:k]))
            raise SeamError(
                404, "not_cached", f"no checkpoint of exactly {n} of these tokens (held: {held})"
            )
        arrays, window_idx = self.family.cache_arrays(found[0].prompt_cache, n)
        metadata = {"format": STORE_FORMAT, "B": str(n), "window_idx": str(window_idx)}
        write_dump(out, lambda tmp: mx.save_safetensors(tmp, arrays, metadata=metadata))
        return {"B": n, "path": str(out), "window_idx": window_idx}

    def evict(self, pin: Any) -> bool:
        """Drops the checkpoint of exactly the pin's prefix (a mount the bridge could not
        confirm), by APCManager's own key, under its lock."""
        manager = self.manager
        with manager.lock:
            keys = [
                k
                for k, e in manager._exact_cache.items()
                if e.token_ids == pin.prefix and e.extra_hash == pin.payload[0]
            ]
            for k in keys:
                del manager._exact_cache[k]
        return bool(keys)

    def clear(self) -> Dict[str, Any]:
        self._live()
        manager = self.manager
        with manager.lock:
            n = len(manager._exact_cache)
            self.admissions.new_epoch()  # before emptying: no stale store lands in between
            manager.clear()
        self.pins.clear()
        return {"cleared": n}


def _check_window(arrays: Dict[str, mx.array], layers: int, n: int, window_idx: int) -> None:
    """The window rows must agree across layers, as the decoder's own caches always do (one
    mask, built from layer 0, serves every layer), and the slot index must fall inside them."""
    rows = {arrays[f"layers.{i}.window"].shape[2] for i in range(layers)}
    if len(rows) != 1:
        raise conflict("layout_mismatch", f"window rows differ across layers: {sorted(rows)}")
    (s,) = rows
    if not 1 <= s <= n or window_idx > s:
        raise conflict(
            "layout_mismatch", f"window holds {s} rows with slot index {window_idx} for B={n}"
        )
