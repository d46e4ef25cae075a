"""``python -m ep_jit info|list|clear``: where the cache is, what it holds, and emptying it."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence

from . import __version__, _env
from ._cache import Cache

__all__ = ["main"]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _info(cache: Cache, as_json: bool) -> int:
    entries = cache.list_entries()
    total = sum(e.size_bytes for e in entries)
    info = {
        "ep_jit": __version__,
        "cache_dir": str(cache.root),
        "entries": len(entries),
        "bytes": total,
        "max_bytes": _env.cache_max_bytes(),
        "backend": _env.backend(),
        "knobs": {name: knob.raw() for name, knob in _env.KNOBS.items()},
    }
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"ep-jit {__version__}")
    print(f"cache dir : {cache.root}")
    print(f"entries   : {len(entries)} ({_human(total)})")
    cap = info["max_bytes"]
    print(f"size cap  : {_human(cap) if cap else 'none'} (EPKIT_JIT_CACHE_MAX_BYTES)")
    print(f"backend   : {info['backend']} (EPKIT_JIT_BACKEND)")
    for name, knob in _env.KNOBS.items():
        print(f"  {name:<26} = {knob.raw()!s:<12} {knob.doc}")
    return 0


def _list(cache: Cache, as_json: bool) -> int:
    entries = cache.list_entries()
    if as_json:
        rows = [
            {
                "name": e.name,
                "key": e.key,
                "path": str(e.path),
                "bytes": e.size_bytes,
                "last_used": e.last_used,
                "arch": e.meta.get("key_record", {}).get("arch"),
                "backend": e.meta.get("key_record", {}).get("backend"),
                "compile_seconds": e.meta.get("compile_seconds"),
                "kernels": e.meta.get("kernels", []),
            }
            for e in entries
        ]
        print(json.dumps(rows, indent=2))
        return 0
    if not entries:
        print(f"(no entries in {cache.entries})")
        return 0
    print(f"{'name':<32} {'key':<14} {'arch':<8} {'backend':<7} {'size':>10} {'compile':>8}  last used")
    for e in reversed(entries):
        rec = e.meta.get("key_record", {})
        when = datetime.datetime.fromtimestamp(e.last_used).strftime("%Y-%m-%d %H:%M:%S")
        secs = e.meta.get("compile_seconds")
        print(
            f"{e.name[:32]:<32} {e.key[:12]:<14} {rec.get('arch', '?'):<8} {rec.get('backend', '?'):<7} "
            f"{_human(e.size_bytes):>10} {(f'{secs:.2f} s' if secs is not None else '?'):>8}  {when}"
        )
    print(f"{len(entries)} entries, {_human(sum(e.size_bytes for e in entries))}")
    return 0


def _clear(cache: Cache, as_json: bool) -> int:
    n, size = cache.clear()
    if as_json:
        print(json.dumps({"removed_entries": n, "removed_bytes": size}))
    else:
        print(f"removed {n} entries ({_human(size)}) from {cache.root}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ep_jit", description="Inspect and manage the ep-jit cache."
    )
    parser.add_argument("--cache-dir", help="cache root (default: EPKIT_JIT_CACHE_DIR or ~/.cache/ep/jit)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="cache location, size, settings")
    sub.add_parser("list", help="entries, most recently used first")
    sub.add_parser("clear", help="remove every entry (not the lock files)")
    args = parser.parse_args(argv)
    cache = Cache(args.cache_dir) if args.cache_dir else Cache(_env.cache_dir())
    return {"info": _info, "list": _list, "clear": _clear}[args.command](cache, args.json)


if __name__ == "__main__":
    sys.exit(main())
