"""Reading one decoder-store entry written by the C++ front, trusting nothing in it.

An entry is a directory with
  entry.json         {"format": "hetero-store-v1", "family", "fingerprint", "B", "T",
                      "layers", "ids": [B token ids]}
  cache.safetensors  per layer `layers.{i}.keys` / `layers.{i}.values`, [kv_heads, B, head_dim]
Every field is checked against the request and the loaded decoder before anything is mounted.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from . import STORE_FORMAT
from .errors import bad_request, conflict
from .llama import array_names, dtype_name

ENTRY_JSON = "entry.json"
CACHE_FILE = "cache.safetensors"


@dataclass
class Entry:
    n_tokens: int  # B: the prefix the arrays cover
    arrays: Dict[str, mx.array]


def resolve(entry: str, store: Optional[Path]) -> Path:
    """The entry directory; with a store configured, only directories inside it are accepted."""
    path = Path(entry)
    if store is None:
        return path
    path = (store / path).resolve()
    if store.resolve() not in path.parents:
        raise bad_request("entry_outside_store", f"entry {entry} is not inside the store {store}")
    return path


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        meta = json.loads((path / ENTRY_JSON).read_text())
    except (OSError, ValueError) as e:
        raise bad_request("bad_entry", f"cannot read {path / ENTRY_JSON}: {e}") from None
    if not isinstance(meta, dict):
        raise bad_request("bad_entry", f"{ENTRY_JSON} is not a JSON object")
    return meta


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_meta(meta: Dict[str, Any], ids: List[int], desc: Dict[str, Any]) -> int:
    """Validates entry.json against the request ids and the decoder; returns B."""
    if meta.get("format") != STORE_FORMAT:
        raise bad_request("bad_entry", f"format {meta.get('format')!r} is not {STORE_FORMAT!r}")
    if meta.get("family") != desc["family"]:
        raise conflict(
            "family_mismatch", f"entry family {meta.get('family')!r} != decoder {desc['family']!r}"
        )
    if meta.get("fingerprint") != desc["fingerprint"]:
        raise conflict(
            "fingerprint_mismatch",
            f"entry fingerprint {meta.get('fingerprint')!r} != decoder fingerprint "
            f"{desc['fingerprint']!r}",
        )
    n, total = meta.get("B"), meta.get("T")
    if not (_is_int(n) and _is_int(total) and 1 <= n <= total):
        raise bad_request("bad_entry", f"need integers 1 <= B <= T, got B={n!r} T={total!r}")
    if n > len(ids) - 1:
        # The decoder must process at least one token itself to produce the first logits.
        raise bad_request(
            "prefix_too_long", f"B={n} leaves no token to decode: request has {len(ids)} ids"
        )
    if meta.get("layers") != desc["layers"]:
        raise conflict(
            "layout_mismatch", f"entry layers {meta.get('layers')!r} != decoder {desc['layers']}"
        )
    if meta.get("ids") != ids[:n]:
        raise conflict("ids_mismatch", f"entry ids are not the request's first {n} ids")
    return n


def _load_arrays(path: Path) -> Dict[str, mx.array]:
    try:
        arrays = mx.load(str(path / CACHE_FILE))
    except Exception as e:  # mx.load raises several types for missing or corrupt files
        raise bad_request("bad_entry", f"cannot load {path / CACHE_FILE}: {e}") from None
    if not isinstance(arrays, dict):
        raise bad_request("bad_entry", f"{CACHE_FILE} is not a safetensors file")
    return arrays


def _check_arrays(arrays: Dict[str, mx.array], n: int, desc: Dict[str, Any]) -> None:
    expected = array_names(desc["layers"])
    missing = [name for name in expected if name not in arrays]
    if missing:
        raise bad_request("missing_array", f"{CACHE_FILE} lacks {missing[:4]}")
    extra = sorted(set(arrays) - set(expected))
    if extra:
        raise bad_request("unexpected_array", f"{CACHE_FILE} has unexpected arrays {extra[:4]}")
    shape = [desc["kv_heads"], n, desc["head_dim"]]
    for name in expected:
        array = arrays[name]
        if list(array.shape) != shape:
            raise conflict("layout_mismatch", f"{name} has shape {list(array.shape)}, want {shape}")
        if dtype_name(array.dtype) != desc["dtype"]:
            raise conflict(
                "dtype_mismatch", f"{name} is {dtype_name(array.dtype)}, decoder is {desc['dtype']}"
            )


def read_entry(path: Path, ids: List[int], desc: Dict[str, Any]) -> Entry:
    """Reads and fully validates an entry for a request whose prompt is `ids`."""
    if not path.is_dir():
        raise bad_request("bad_entry", f"entry {path} is not a directory")
    n = _check_meta(_read_json(path), ids, desc)
    arrays = _load_arrays(path)
    _check_arrays(arrays, n, desc)
    return Entry(n_tokens=n, arrays=arrays)
