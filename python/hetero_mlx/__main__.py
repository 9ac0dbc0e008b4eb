"""Command line: python -m hetero_mlx {serve,export,tiny-llama,tiny-dsv4} ...

serve options not listed here are passed to mlx-lm's own server parser unchanged.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hetero_mlx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="mlx-lm's OpenAI server plus the /hetero/ seam")
    serve.add_argument("--model", required=True, help="model directory (HF or MLX layout)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8011)
    serve.add_argument("--prefill-step-size", type=int, help="mlx-lm default when omitted")
    serve.add_argument("--store", type=Path, help="decoder store root; mounts only inside it")
    serve.add_argument(
        "--test-faults", action="store_true", help="enable POST /hetero/fault and /hetero/calls (tests only)"
    )
    serve.add_argument(
        "--mount-budget-mb",
        type=int,
        default=int(os.environ.get("HETERO_DECODER_MOUNT_BUDGET_MB", "0") or 0),
        help="the most memory one mount may take, in MiB; a larger entry is declined (HTTP 507) "
        "with both numbers (0: what the host has free; env HETERO_DECODER_MOUNT_BUDGET_MB)",
    )
    serve.add_argument(
        "--secret-file",
        type=Path,
        help="file holding the shared secret (mode 0600, at least 32 characters); every request "
        "must then be signed with it (Hetero-HMAC-SHA256, docs/design/auth.md)",
    )
    serve.add_argument(
        "--allow-remote",
        action="store_true",
        help="serve a --host that is not a loopback address (the front door is on this machine)",
    )
    serve.add_argument(
        "--request-deadline-s",
        type=float,
        default=10.0,
        help="a whole request (line, headers, body) must arrive within this many seconds of the "
        "connection's start or its last response, else the connection is closed",
    )
    serve.add_argument(
        "--max-connections-per-client",
        type=int,
        default=64,
        help="connections one client address may hold at once; more are closed at once",
    )
    serve.add_argument(
        "--max-body-mb", type=int, default=64, help="the largest request body, in MiB (413)"
    )

    export = sub.add_parser("export", help="decoder weights + decoder.json for the prefill host")
    export.add_argument("--model", required=True)
    export.add_argument("--out", required=True, type=Path)

    tiny = sub.add_parser("tiny-llama", help="tiny random llama checkpoint for tests")
    tiny.add_argument("--tokenizer", required=True, type=Path, help="dir with tokenizer files")
    tiny.add_argument("--out", required=True, type=Path)
    tiny.add_argument("--seed", type=int, default=0, help="same seed and shape, same bytes")
    tiny.add_argument(
        "--model-type", default="llama", choices=("llama", "mistral", "qwen2", "qwen3")
    )
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--hidden", type=int, default=64)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--head-dim", type=int, default=0, help="0: hidden // heads")
    tiny.add_argument("--intermediate", type=int, default=128)
    tiny.add_argument(
        "--tie", action=argparse.BooleanOptionalAction, default=True, help="tie lm_head to embed"
    )
    tiny.add_argument("--rope-theta", type=float, default=100000.0)
    tiny.add_argument(
        "--rope-scaling",
        default="",
        help='the config\'s rope_scaling as JSON, e.g. \'{"rope_type": "llama3", "factor": 8.0}\'',
    )
    tiny.add_argument("--rope-traditional", action="store_true", help="llama/qwen2 only")
    tiny.add_argument(
        "--rope-parameters",
        action="store_true",
        help="qwen3: rope_theta and the scaling in a transformers-v5 rope_parameters block",
    )
    tiny.add_argument("--max-position-embeddings", type=int, default=32768)
    tiny.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="llama/mistral: > 0 makes the odd layers sliding_attention over this many positions",
    )

    dsv4 = sub.add_parser(
        "tiny-dsv4", help="tiny random DeepSeek-V4 checkpoint: fp8/ (official), bf16/, mxfp4/"
    )
    dsv4.add_argument("--tokenizer", required=True, type=Path, help="dir with tokenizer files")
    dsv4.add_argument("--out", required=True, type=Path, help="writes OUT/{fp8,bf16,mxfp4,native}")
    dsv4.add_argument("--seed", type=int, default=0, help="same seed and shape, same bytes")
    dsv4.add_argument("--variants", default="fp8,bf16,mxfp4,native", help="fp8 is always written")
    dsv4.add_argument("--layers", type=int, default=6)
    dsv4.add_argument(
        "--ratios",
        help="per-layer compress ratios (0, 4, 128), comma-separated; "
        "default: 0,0 then 4,128 alternating, as in DeepSeek-V4-Flash",
    )
    dsv4.add_argument("--hidden", type=int, default=256)
    dsv4.add_argument("--heads", type=int, default=4)
    dsv4.add_argument("--head-dim", type=int, default=128)
    dsv4.add_argument("--rope-dim", type=int, default=64, help="qk_rope_head_dim")
    dsv4.add_argument("--q-lora-rank", type=int, default=128)
    dsv4.add_argument("--o-groups", type=int, default=2)
    dsv4.add_argument("--o-lora-rank", type=int, default=128)
    dsv4.add_argument("--experts", type=int, default=8, help="n_routed_experts")
    dsv4.add_argument("--top-k", type=int, default=2, help="num_experts_per_tok")
    dsv4.add_argument("--moe-intermediate", type=int, default=128)
    dsv4.add_argument("--hash-layers", type=int, default=2, help="num_hash_layers")
    dsv4.add_argument("--index-heads", type=int, default=4)
    dsv4.add_argument("--index-head-dim", type=int, default=128)
    dsv4.add_argument("--index-topk", type=int, default=16)
    dsv4.add_argument("--sliding-window", type=int, default=128)
    dsv4.add_argument("--hc-mult", type=int, default=4)
    dsv4.add_argument("--mtp-layers", type=int, default=1, choices=(0, 1))
    dsv4.add_argument(
        "--yarn-factor",
        type=int,
        default=16,
        help="YaRN factor over 65,536 positions: 16 (Flash's 1,048,576), 32 (2,097,152)",
    )
    return parser


def _tiny_dsv4(args: argparse.Namespace) -> dict:
    from .dsv4_tiny import Dsv4Shape, default_ratios, make_tiny_dsv4

    if args.ratios:
        ratios = tuple(int(r) for r in args.ratios.split(","))
    else:
        ratios = default_ratios(args.layers)
    if args.yarn_factor < 1:
        raise ValueError("--yarn-factor must be at least 1")
    shape = Dsv4Shape(
        layers=args.layers,
        ratios=ratios,
        hidden=args.hidden,
        heads=args.heads,
        head_dim=args.head_dim,
        rope_dim=args.rope_dim,
        q_lora_rank=args.q_lora_rank,
        o_groups=args.o_groups,
        o_lora_rank=args.o_lora_rank,
        experts=args.experts,
        top_k=args.top_k,
        moe_intermediate=args.moe_intermediate,
        hash_layers=args.hash_layers,
        index_heads=args.index_heads,
        index_head_dim=args.index_head_dim,
        index_topk=args.index_topk,
        sliding_window=args.sliding_window,
        hc_mult=args.hc_mult,
        mtp_layers=args.mtp_layers,
        yarn_factor=args.yarn_factor,
    )
    variants = tuple(v for v in args.variants.split(",") if v)
    return make_tiny_dsv4(args.tokenizer, args.out, args.seed, shape, variants)


def _mlx_argv(args: argparse.Namespace, extra: List[str]) -> List[str]:
    argv = ["--model", args.model, "--host", args.host, "--port", str(args.port)]
    if args.prefill_step_size is not None:
        argv += ["--prefill-step-size", str(args.prefill_step_size)]
    return argv + extra


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # Imports are per command: mlx-lm's server module is heavy and export does not need it.
    if args.command == "serve":
        from .bounds import check_host
        from .serve import PortLimits, serve
        from .store import set_mount_budget

        try:
            set_mount_budget(args.mount_budget_mb)
        except ValueError as e:
            parser.error(str(e))
        if args.request_deadline_s <= 0 or args.max_connections_per_client < 1:
            parser.error("--request-deadline-s and --max-connections-per-client must be positive")
        if args.max_body_mb < 1:
            parser.error("--max-body-mb must be at least 1")
        check_host(args.host, args.allow_remote)
        limits = PortLimits(
            args.request_deadline_s, args.max_connections_per_client, args.max_body_mb
        )
        serve(_mlx_argv(args, extra), args.store, args.test_faults, args.secret_file, limits)
    elif args.command == "export":
        from .export import export

        print(json.dumps(export(args.model, args.out), sort_keys=True))
    elif args.command == "tiny-dsv4":
        try:
            made = _tiny_dsv4(args)
        except ValueError as e:
            parser.error(str(e))
        print(json.dumps(made, sort_keys=True))
    else:
        from .tiny import TinyShape, make_tiny_llama

        shape = TinyShape(
            model_type=args.model_type,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            intermediate=args.intermediate,
            tie=args.tie,
            rope_theta=args.rope_theta,
            rope_scaling=args.rope_scaling,
            rope_traditional=args.rope_traditional,
            rope_parameters=args.rope_parameters,
            max_position_embeddings=args.max_position_embeddings,
            sliding_window=args.sliding_window,
        )
        try:
            made = make_tiny_llama(args.tokenizer, args.out, args.seed, shape)
        except ValueError as e:
            parser.error(str(e))
        print(json.dumps(made, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
