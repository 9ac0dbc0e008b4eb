"""Reading one decoder-store entry written by the C++ front, trusting nothing in it; and the
request fields that name ids, entries and dump files, checked the same way for every decoder.

An entry is a directory with
  entry.json         {"format": "hetero-store-v1", "family", "fingerprint", "B", "T",
                      "layers", "ids": [B token ids]} plus any integers the family needs
                      (deepseek_v4: "window_idx", the rotating window's slot index), and for a
                      tail "start": the rows begin there (llama), the decoder holding the rest
  cache.safetensors  the family's arrays for the prefix (llama: per layer `layers.{i}.keys` /
                     `layers.{i}.values`, [kv_heads, B - start, head_dim])
Every field is checked against the request and the loaded decoder before anything is mounted.
The family says which arrays it expects and their shapes (`Layout`); llama's is the default.
An entry whose arrays would pass the decoder's memory budget for a mount (`set_mount_budget`:
`serve --mount-budget-mb`; by default what the host has free) is declined with both numbers
before it is read.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from . import STORE_FORMAT
from .access import dump_target
from .errors import bad_request, conflict, insufficient_storage
from .llama import array_names, dtype_name

ENTRY_JSON = "entry.json"
CACHE_FILE = "cache.safetensors"

_mount_budget = 0  # bytes a mount may take; 0: what the host has free when it is asked


def set_mount_budget(megabytes: int) -> None:
    """The decoder's memory budget for one mount, in MiB (0: what the host has free)."""
    global _mount_budget
    if megabytes < 0:
        raise ValueError("--mount-budget-mb must be >= 0")
    _mount_budget = megabytes << 20


def host_available_bytes() -> Optional[int]:
    """The kernel's MemAvailable (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_mount_budget(path: Path, n_tokens: int) -> None:
    """Mounting reads the arrays into the decoder's memory, which then holds them in its prompt
    cache: an entry larger than the budget is declined before a byte of it is read."""
    try:
        need = (path / CACHE_FILE).stat().st_size
    except OSError:
        return  # _load_arrays says what is wrong with it
    budget, what = _mount_budget, "the decoder's mount budget (--mount-budget-mb)"
    if budget == 0:
        budget, what = host_available_bytes(), "the host's available memory"
        if budget is None:
            return
    if need > budget:
        mib = 1 << 20
        raise insufficient_storage(
            "over_memory_budget",
            f"mounting {n_tokens} tokens needs {need} bytes ({need / mib:.1f} MiB) of the "
            f"decoder's memory; {what} is {budget} bytes ({budget / mib:.1f} MiB)",
        )


@dataclass
class Entry:
    n_tokens: int  # B: the prefix the arrays end at
    arrays: Dict[str, mx.array]
    extra: Dict[str, int] = field(default_factory=dict)  # the family's integers from entry.json
    start: int = 0  # a tail: the arrays hold rows [start, B); the decoder's own cache the rest


@dataclass(frozen=True)
class Layout:
    """What a family expects in cache.safetensors for one prefix.

    shapes: every expected array and its shape; -1 on an axis accepts any length there (a
    length the family's builder checks itself). dtype: the decoder's cache dtype, which every
    array must have.
    """

    shapes: Dict[str, List[int]]
    dtype: str


# A family's expected layout for an entry of the rows [start, B) (start 0: the whole prefix),
# given B, start and the entry's family integers.
LayoutFn = Callable[[int, int, Dict[str, int]], Layout]


def llama_layout(desc: Dict[str, Any]) -> LayoutFn:
    def layout(n_tokens: int, start: int, extra: Dict[str, int]) -> Layout:
        shape = [desc["kv_heads"], n_tokens - start, desc["head_dim"]]
        return Layout({name: shape for name in array_names(desc["layers"])}, desc["dtype"])

    return layout


def resolve(entry: str, store: Optional[Path]) -> Path:
    """The entry directory; with a store configured, only directories inside it are accepted."""
    path = Path(entry)
    if store is None:
        return path
    path = (store / path).resolve()
    if store.resolve() not in path.parents:
        raise bad_request("entry_outside_store", f"entry {entry} is not inside the store {store}")
    return path


def entry_path(body: Dict[str, Any], store: Optional[Path]) -> Path:
    """The request's "entry" field as a directory, inside the store when one is configured."""
    if not isinstance(body.get("entry"), str) or not body["entry"]:
        raise bad_request("bad_entry", "entry must be a directory path")
    return resolve(body["entry"], store)


def request_ids(body: Dict[str, Any], vocab_size: int) -> List[int]:
    """The request's "ids": a non-empty list of token ids of the decoder's vocabulary."""
    ids = body.get("ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
        raise bad_request("bad_ids", "ids must be a non-empty list of integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request("ids_out_of_vocab", f"ids {bad[:4]} are outside [0, {vocab_size})")
    return ids


def dump_request(
    body: Dict[str, Any], ids: Sequence[int], dumps: Optional[Path]
) -> Tuple[int, Path]:
    """The (B, file to write) of a truth-dump request for `ids`: the file is the request's
    plain name "out" inside the seam's dump directory (access.dump_target)."""
    n = body.get("B")
    if not _is_int(n) or not 1 <= n <= len(ids):
        raise bad_request("bad_prefix_length", f"B must be an integer in [1, {len(ids)}]")
    return n, dump_target(body, dumps)


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


def _extra_ints(meta: Dict[str, Any], names: Sequence[str]) -> Dict[str, int]:
    extra = {}
    for name in names:
        value = meta.get(name)
        if not _is_int(value) or value < 0:
            raise bad_request("bad_entry", f"{ENTRY_JSON} needs a non-negative integer {name!r}")
        extra[name] = value
    return extra


def _shape_matches(shape: Sequence[int], want: Sequence[int]) -> bool:
    return len(shape) == len(want) and all(w in (-1, s) for s, w in zip(shape, want))


def _check_arrays(arrays: Dict[str, mx.array], layout: Layout) -> None:
    expected = list(layout.shapes)
    missing = [name for name in expected if name not in arrays]
    if missing:
        raise bad_request("missing_array", f"{CACHE_FILE} lacks {missing[:4]}")
    extra = sorted(set(arrays) - set(expected))
    if extra:
        raise bad_request("unexpected_array", f"{CACHE_FILE} has unexpected arrays {extra[:4]}")
    for name in expected:
        array, shape = arrays[name], layout.shapes[name]
        if not _shape_matches(array.shape, shape):
            raise conflict("layout_mismatch", f"{name} has shape {list(array.shape)}, want {shape}")
        if dtype_name(array.dtype) != layout.dtype:
            raise conflict(
                "dtype_mismatch", f"{name} is {dtype_name(array.dtype)}, decoder is {layout.dtype}"
            )


def _start(meta: Dict[str, Any], n: int, tails: bool) -> int:
    """The entry's "start" (0 when absent): a tail's first row, below B."""
    start = meta.get("start", 0)
    if not _is_int(start) or not 0 <= start < n:
        raise bad_request("bad_entry", f"start must be an integer in [0, {n}), got {start!r}")
    if start > 0 and not tails:
        raise conflict(
            "tail_not_mountable",
            f"the entry holds rows from {start}: this decoder's cache is mounted whole only",
        )
    return start


def read_entry(
    path: Path,
    ids: List[int],
    desc: Dict[str, Any],
    layout: Optional[LayoutFn] = None,
    extra_ints: Sequence[str] = (),
    tails: bool = False,
) -> Entry:
    """Reads and fully validates an entry for a request whose prompt is `ids`.

    layout: the family's expected arrays (llama's when omitted), given the rows the entry holds;
    extra_ints: the integer fields the family needs in entry.json besides the common ones;
    tails: whether an entry may hold a tail (rows from "start" on).
    """
    if not path.is_dir():
        raise bad_request("bad_entry", f"entry {path} is not a directory")
    meta = _read_json(path)
    n = _check_meta(meta, ids, desc)
    start = _start(meta, n, tails)
    extra = _extra_ints(meta, extra_ints)
    _check_mount_budget(path, n - start)
    arrays = _load_arrays(path)
    _check_arrays(arrays, (layout or llama_layout(desc))(n, start, extra))
    return Entry(n_tokens=n, arrays=arrays, extra=extra, start=start)
