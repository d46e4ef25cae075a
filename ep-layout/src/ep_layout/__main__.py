"""``python -m ep_layout --includes | --cmakedir | --version | --sizes``."""

from __future__ import annotations

import argparse
import sys

from . import LAYOUT_VERSION, EPLayoutError, WorkspaceLayout, __version__, get_cmake_dir, get_include


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ep_layout", description="ep-layout: headers and CMake package."
    )
    parser.add_argument(
        "--includes", action="store_true", help="print the include flag (-I<dir>) for the headers"
    )
    parser.add_argument("--include-dir", action="store_true", help="print the include directory")
    parser.add_argument(
        "--cmakedir",
        action="store_true",
        help="print the CMake config directory, ideal for setting -Dep_layout_DIR or -Dep_layout_ROOT",
    )
    parser.add_argument("--version", action="store_true", help="print the package and layout versions")
    parser.add_argument("--workspace", action="store_true", help="print the workspace regions")
    args = parser.parse_args(argv)
    if not any(vars(args).values()):
        parser.print_help()
        return 0
    try:
        _print(args)
    except EPLayoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _print(args: argparse.Namespace) -> None:
    if args.version:
        print(f"ep-layout {__version__} (layout {LAYOUT_VERSION[0]}.{LAYOUT_VERSION[1]})")
    if args.includes:
        print(f"-I{get_include()}")
    if args.include_dir:
        print(get_include())
    if args.cmakedir:
        print(get_cmake_dir())
    if args.workspace:
        for r in WorkspaceLayout.regions():
            print(f"{r.name:32s} offset {r.offset:>10d}  {r.num_elems:>8d} x {r.dtype}")
        print(
            f"{'end':32s} offset {WorkspaceLayout.NUM_BYTES:>10d}  (aligned {WorkspaceLayout.NUM_ALIGNED_BYTES})"
        )


if __name__ == "__main__":
    sys.exit(main())
