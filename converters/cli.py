"""``w12``: convert BF16 checkpoints to the lossless W12 format, check them, inspect them, undo them.

A thin layer over ``w12.convert``; every job is also a library function. Exit status: 0 on
success, 1 on a failed check or a bad input (one line naming the file and tensor), 2 on a usage
error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

RULE = """\
Which tensors are converted (by default): every floating tensor of rank >= 2 whose name ends
in ".weight" and that is not an embedding table, i.e. the weights of linear layers, including a
tied lm_head.weight stored as its own tensor. A name is an embedding if it contains "embed"
(embed_tokens, word_embeddings, position_embeddings, token_type_embeddings, embed_in, ...) or
is wte/wpe/shared ".weight". 1-D tensors (norms, biases) and everything else are copied byte
for byte. --embeddings adds the embedding tables. --include REGEX replaces the name rule: then
exactly the rank >= 2 tensors matching some --include are converted. --exclude REGEX removes
matches from either. Regexes use Python's re.search on the full tensor name.

Weights chosen for conversion must be BF16. FP32/FP16 ones are refused unless --cast bf16 is
given; casting is lossy, so such a W12 folder is bit-identical to the BF16 cast, not to the
source (verify then compares with the cast).

Output: a Hugging Face folder (format spec section 6): same shard file names as the source,
each converted NAME stored as STEM.w12_records/_base/_esc_ptr/_esc_col/_esc_val (STEM = NAME
without ".weight"), shard metadata format=w12, w12_version=1, w12_tensors; the index lists the
new names; config.json gains quantization_config {quant_method: w12, version: 1}; tokenizer
and other files are copied. It is written into a hidden folder beside DST and renamed into
place at the end: a failed or interrupted run leaves no DST.
"""


def _progress(args) -> bool:
    return not args.quiet and sys.stderr.isatty() or args.progress


def _emit(args, data: dict, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if getattr(args, "json", False) else text)


def cmd_convert(args) -> int:
    from w12.convert import convert, verify

    s = convert(
        args.src,
        args.dst,
        include=args.include,
        exclude=args.exclude,
        embeddings=args.embeddings,
        cast=args.cast,
        force=args.force,
        progress=_progress(args),
    )
    data = s.to_dict()
    data.pop("per_tensor")
    text = f"converted {args.src} -> {args.dst}\n{s.table()}"
    if s.cast:
        print(f"w12 convert: note: weights were cast to {s.cast} before encoding (lossy)", file=sys.stderr)
    if args.verify:
        r = verify(args.src, args.dst, progress=_progress(args))
        data["verify"] = {"ok": r.ok, "message": r.message, "mismatch": r.mismatch}
        text += f"\nverify: {r.message}"
        _emit(args, data, text)
        return 0 if r.ok else 1
    _emit(args, data, text)
    return 0


def cmd_verify(args) -> int:
    from w12.convert import verify

    r = verify(args.src, args.dst, progress=_progress(args))
    data = {"ok": r.ok, "tensors": r.tensors_checked, "weights": r.weights_checked, "seconds": r.seconds}
    data.update(message=r.message, mismatch=r.mismatch)
    if args.json:
        _emit(args, data, "")
    elif r.ok:
        print(f"{r.message} ({r.seconds:.1f} s)")
    else:
        print(f"w12 verify: MISMATCH: {r.message}", file=sys.stderr)
    return 0 if r.ok else 1


def cmd_info(args) -> int:
    from w12.convert import info, info_table

    d = info(args.path)
    _emit(args, d, info_table(d, per_tensor=not args.totals))
    return 0


def cmd_restore(args) -> int:
    from w12.convert import restore

    r = restore(args.dst, args.out, force=args.force, progress=_progress(args))
    print(
        f"restored {args.dst} -> {args.out}: {r.tensors_decoded} tensors decoded, {r.tensors_copied} copied, "
        f"{r.weights:,} weights, {r.output_bytes:,} bytes in {r.seconds:.1f} s"
    )
    return 0


def cmd_demo(args) -> int:
    from w12.convert import compare_plain, convert, info, info_table, restore, verify
    from w12.synthetic import build_llama_checkpoint

    with tempfile.TemporaryDirectory(prefix="w12-demo-") as tmp:
        root = Path(args.dir) if args.dir else Path(tmp)
        if args.dir and root.exists() and any(root.iterdir()):
            raise FileExistsError(f"{root}: not empty; give a new or empty folder")
        t0 = time.perf_counter()
        src, dst, back = root / "bf16", root / "w12", root / "restored"
        b = build_llama_checkpoint(src, "demo", seed=args.seed)
        print(f"1. built a Llama-shaped BF16 checkpoint: {b['weights']:,} weights in {len(b['files'])} shards at {src}")
        s = convert(src, dst, progress=_progress(args))
        print(f"2. converted to W12 at {dst}:\n{s.table()}")
        r = verify(src, dst, progress=False)
        print(f"3. verify (decode every W12 tensor, compare bits with the source): {r.message}")
        print("4. info:\n" + "\n".join("   " + ln for ln in info_table(info(dst), per_tensor=False).splitlines()))
        restore(dst, back, progress=False)
        c = compare_plain(src, back)
        print(f"5. restored plain BF16 at {back} and compared with the source: {c.message}")
        ok = r.ok and c.ok
        print(
            f"demo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s"
            + ("" if args.dir else " (temporary folder removed)")
        )
        return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="w12",
        description="Lossless 12-bit (W12) checkpoints: convert BF16 safetensors, verify, inspect, restore.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'w12 COMMAND --help' for each command's options. Environment: W12_CPU_ENCODER "
        "(auto|c|torch), W12_ENCODE_THREADS, W12_FSYNC (1|0), W12_CACHE_DIR.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(q, json_out=True):
        g = q.add_mutually_exclusive_group()
        g.add_argument("--progress", action="store_true", help="always show progress bars (default: on a terminal)")
        g.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
        if json_out:
            q.add_argument("--json", action="store_true", help="print the result as JSON")

    q = sub.add_parser(
        "convert",
        help="convert a BF16 safetensors checkpoint to W12",
        description="Convert SRC (a Hugging Face model folder, single or sharded with model.safetensors.index.json, "
        "or one .safetensors file) into a W12 folder DST. Streams tensor by tensor: memory is a small multiple "
        "of the largest tensor.",
        epilog=RULE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    q.add_argument("src", metavar="SRC", help="source folder or .safetensors file (BF16)")
    q.add_argument("dst", metavar="DST", help="destination folder (must not exist unless --force)")
    q.add_argument(
        "--include", action="append", metavar="REGEX", help="convert exactly the tensors matching (repeatable)"
    )
    q.add_argument("--exclude", action="append", metavar="REGEX", help="never convert tensors matching (repeatable)")
    q.add_argument("--embeddings", action="store_true", help="also convert embedding tables")
    q.add_argument(
        "--cast", choices=["bf16"], help="cast FP32/FP16 weights to BF16 first (LOSSY: W12 then keeps the cast)"
    )
    q.add_argument("--force", action="store_true", help="replace DST if it exists (only once the new one is complete)")
    q.add_argument("--verify", action="store_true", help="run 'w12 verify SRC DST' afterwards")
    common(q)
    q.set_defaults(fn=cmd_convert)

    q = sub.add_parser(
        "verify",
        help="decode every W12 tensor and compare bits with the source",
        description="Decode every W12 tensor of DST and compare its bits with SRC; compare copied tensors byte for "
        "byte. Exit 1 and name the first mismatching tensor, row and column on failure.",
    )
    q.add_argument("src", metavar="SRC", help="the source the folder was converted from")
    q.add_argument("dst", metavar="DST", help="the W12 folder")
    common(q)
    q.set_defaults(fn=cmd_verify)

    q = sub.add_parser(
        "info",
        help="sizes, bits/weight and escape rates of a W12 folder",
        description="Per-tensor and total bytes, bits/weight (all five W12 tensors' bytes x 8 / weights) and escape "
        "rate, read from the shard headers (nothing is decoded).",
    )
    q.add_argument("path", metavar="PATH", help="a W12 folder or .safetensors file")
    q.add_argument("--totals", action="store_true", help="totals only, no per-tensor table")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(fn=cmd_info)

    q = sub.add_parser(
        "restore",
        help="write plain BF16 safetensors back from a W12 folder",
        description="Decode a W12 folder DST into a plain BF16 folder OUT whose tensors are bit-identical to the "
        "source (shard names, index, config without quantization_config, and side files kept).",
    )
    q.add_argument("dst", metavar="DST", help="the W12 folder")
    q.add_argument("out", metavar="OUT", help="output folder (must not exist unless --force)")
    q.add_argument("--force", action="store_true", help="replace OUT if it exists")
    common(q, json_out=False)
    q.set_defaults(fn=cmd_restore)

    q = sub.add_parser(
        "demo",
        help="build a small Llama-shaped checkpoint and run convert, verify, info, restore on it",
        description="The whole job on a built-in example (~19 M weights, 2 shards, seeded normal std 0.02 weights): "
        "convert, verify, info, restore and compare with the source. Takes seconds.",
    )
    q.add_argument("dir", metavar="DIR", nargs="?", help="keep the folders here (default: a temporary folder)")
    q.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights (default 0)")
    common(q, json_out=False)
    q.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from w12.weight import W12FormatError

    try:
        return args.fn(args)
    except (W12FormatError, OSError) as e:
        print(f"w12 {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"w12 {args.command}: interrupted; nothing was left half-written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
