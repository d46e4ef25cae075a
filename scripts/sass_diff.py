#!/usr/bin/env python3
"""Compare the machine code (SASS) of ep-core's JIT kernels between the working tree and a git revision.

The development machines and CI have no GPU, but they compile CUDA. A change meant to keep the kernels' behaviour
(device functions shared instead of copied, renames, comments, header moves) is proven by identical machine code:
this script builds every kernel configuration of a list from the headers of REV (default HEAD) and from the working
tree, disassembles both with nvdisasm and compares each kernel's instructions (labels renumbered per kernel, so a
change in one kernel does not show in the next).

    python3 scripts/sass_diff.py [--base REV] [--quick | --config SPEC ...] [--show N] [--arch sm_90a] [--jobs N]
    nox -s sass-diff -- [ARGS]        # installs what it needs, nvdisasm and the NCCL headers included

SPEC names one `KernelConfig` of the dispatch/combine instance: `n8.k8.h7168` (ranks, top-k, hidden; bf16) with
optional fields `.fp8` (FP8 data with one scale per 128 elements, `.p14` another pack count), `.su4` (hybrid: 4 ranks
per node), `.xn4` (direct mode across nodes of 4 ranks), `.nccl` (the nccl transport; with `.su`/`.xn` the GIN
scale-out put); or one of the other JIT instances, which have no configuration: `ll` (V1 low-latency packing,
ll_pack.cuh), `engram` (engram_gather.cuh), `wait` (the bounded signal wait, signal_wait.cuh).

Both sides are built with the working tree's Python (the defines of a `KernelConfig`, ep_jit's flags): a change of
the defines themselves is not what this compares. Exit status: 0 every kernel of the base identical (kernels the
base lacks are listed as new), 1 some kernel differs or is gone (named, with the count of changed instruction lines
and, with --show, the start of the diff), 2 the tools or a build failed.
"""

from __future__ import annotations

import argparse
import difflib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER_DIRS = ("ep-core/include", "ep-layout/include")

DEFAULT_SPECS = (
    "n1.k8.h7168",
    "n2.k8.h7168",
    "n8.k8.h7168",
    "n3.k1.h2048",
    "n8.k32.h7168",
    "n8.k8.h7168.fp8",
    "n8.k8.h7168.fp8.p14",
    "n4.k8.h7168.su2",
    "n8.k8.h7168.su4",
    "n8.k8.h7168.fp8.su4",
    "n4.k8.h7168.xn2",
    "n8.k8.h7168.xn4",
    "n8.k8.h7168.nccl",
    "n8.k8.h7168.nccl.su4",
    "n8.k8.h7168.nccl.xn4",
    "ll",
    "engram",
    "wait",
)
"""Every kernel family (direct, hybrid, direct across nodes; ipc and nccl; bf16 and FP8) at the shapes in use, and
the JIT instances beside them."""

SIDE_INSTANCES = {
    "ll": ("ep_core.ll_pack", "compile_ll_kernels"),
    "engram": ("ep_core.engram_gather", "compile_engram_gather"),
    "wait": ("ep_core.signal_wait", "compile_signal_wait"),
}
"""SPEC -> (module, compile function taking `arch` and `headers`) of the instances without a configuration."""

QUICK_SPECS = ("n2.k8.h2048", "n4.k8.h2048.su2", "n4.k8.h2048.xn2")
"""One configuration of each family over ipc, small: what the CPU test builds."""

_SPEC_FIELD = re.compile(r"^(n|k|h|p|su|xn)(\d+)$")


def parse_spec(spec: str):
    """The `KernelConfig` a SPEC names, or the SPEC itself for an instance of SIDE_INSTANCES (module doc);
    ValueError naming the field for anything else."""
    from ep_core.kernels.plan import KernelConfig

    if spec in SIDE_INSTANCES:
        return spec

    fields: dict[str, int] = {}
    fp8 = nccl = False
    for part in spec.split("."):
        m = _SPEC_FIELD.match(part)
        if m:
            fields[m.group(1)] = int(m.group(2))
        elif part == "fp8":
            fp8 = True
        elif part == "nccl":
            nccl = True
        else:
            raise ValueError(
                f"--config {spec!r}: unknown field {part!r} (expected nN, kN, hN, fp8, pN, suN, xnN, nccl; "
                f"or one of {', '.join(SIDE_INSTANCES)} alone)"
            )
    missing = [f for f in ("n", "k", "h") if f not in fields]
    if missing:
        raise ValueError(f"--config {spec!r}: missing {', '.join(missing)} (e.g. n8.k8.h7168)")
    if "p" in fields and not fp8:
        raise ValueError(f"--config {spec!r}: pN (scale packs) goes with fp8")
    if "su" in fields and "xn" in fields:
        raise ValueError(f"--config {spec!r}: suN (hybrid) and xnN (direct across nodes) exclude each other")
    n, hidden = fields["n"], fields["h"]
    kw: dict = {"transport": "nccl" if nccl else "ipc"}
    if "su" in fields:
        kw["num_scaleup_ranks"] = fields["su"]
    if "xn" in fields:
        kw["num_nvlink_ranks"] = fields["xn"]
    packs = fields.get("p", -(-hidden // 128)) if fp8 else 0
    return KernelConfig(n, fields["k"], hidden, 1 if fp8 else 2, packs, **kw)


# ------------------------------------------------------------------------------------------------ disassembly
_SECTION = re.compile(r"^//-+ \.text\.(\S+)\s+-+$")
_ADDRESS = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*")
_LABEL = re.compile(r"\.L_x_\d+")
_INTERNAL = re.compile(r"\$__internal_\d+_\$")  # compiler helpers, numbered across the whole cubin


def kernels_of(listing: str) -> dict[str, list[str]]:
    """Each function of an `nvdisasm -c` listing: its instruction and label lines, addresses dropped, white space
    folded, labels renumbered in order of first appearance (`.L0`, `.L1`, ...), the cubin-wide number dropped from
    compiler helpers' names (`$__internal_3_$__cuda_sm20_rem_s64` -> `$__internal_$__cuda_sm20_rem_s64`: another
    kernel in the cubin renumbers them)."""
    out: dict[str, list[str]] = {}
    lines: list[str] | None = None
    labels: dict[str, str] = {}

    def label(m: re.Match) -> str:
        return labels.setdefault(m.group(0), f".L{len(labels)}")

    for raw in listing.splitlines():
        m = _SECTION.match(raw.strip())
        if m:
            lines, labels = out.setdefault(_INTERNAL.sub("$__internal_$", m.group(1)), []), {}
            continue
        if lines is None:
            continue
        text = raw.strip()
        if _ADDRESS.match(raw):
            text = _ADDRESS.sub("", raw)
        elif not (text.startswith(".L_x_") and text.endswith(":")):
            continue  # directives, section labels, blank lines
        lines.append(_INTERNAL.sub("$__internal_$", _LABEL.sub(label, " ".join(text.split()))))
    return out


def nvdisasm() -> str:
    """The nvdisasm binary (cuda.pathfinder: CUDA_HOME, the toolkit, or the nvidia-cuda-nvdisasm wheel)."""
    from cuda.pathfinder import find_nvidia_binary_utility

    path = find_nvidia_binary_utility("nvdisasm")
    if not path:
        raise RuntimeError(
            "nvdisasm not found: install the CUDA toolkit or `pip install 'nvidia-cuda-nvdisasm>=13,<14'` "
            "(nox -s sass-diff does)"
        )
    return path


def disassemble(cubin: Path, tool: str) -> dict[str, list[str]]:
    proc = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} -c {cubin} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return kernels_of(proc.stdout)


# ------------------------------------------------------------------------------------------------ the two trees
def headers_at(rev: str, into: Path) -> tuple[str, str]:
    """ep-core's and ep-layout's include directories as they are at `rev`, extracted under `into`."""
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, *HEADER_DIRS], capture_output=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"git archive {rev}: {proc.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(into, filter="data")
    return tuple(str(into / d) for d in HEADER_DIRS)  # type: ignore[return-value]


def working_headers() -> tuple[str, str]:
    return tuple(str(ROOT / d) for d in HEADER_DIRS)  # type: ignore[return-value]


@dataclass(frozen=True)
class KernelDiff:
    spec: str
    kernel: str
    base_lines: int
    work_lines: int
    diff: tuple[str, ...]  # unified diff lines, empty when identical

    new: bool = False  # the base has no such kernel (an added entry point changes none of the others)

    @property
    def identical(self) -> bool:
        return not self.diff

    @property
    def changed(self) -> int:
        """Instruction and label lines removed plus added."""
        return sum(1 for d in self.diff if d[:1] in "+-" and not d.startswith(("+++", "---")))


def build(spec: str, headers: tuple[str, str], arch: str, tool: str) -> dict[str, list[str]]:
    import importlib

    from ep_core.kernels._source import compile_kernels

    config = parse_spec(spec)
    if isinstance(config, str):
        module, function = SIDE_INSTANCES[config]
        art = getattr(importlib.import_module(module), function)(arch=arch, headers=headers)
    else:
        art = compile_kernels(config, arch=arch, headers=headers)
    return disassemble(Path(art.cubin_path), tool)


def compare(spec: str, base: dict[str, list[str]], work: dict[str, list[str]]) -> list[KernelDiff]:
    out = []
    for kernel in sorted(set(base) | set(work)):
        a, b = base.get(kernel, []), work.get(kernel, [])
        if kernel not in base:
            out.append(KernelDiff(spec, kernel, 0, len(b), (), new=True))
            continue
        diff = () if a == b else tuple(difflib.unified_diff(a, b, "base", "work", n=2, lineterm=""))
        out.append(KernelDiff(spec, kernel, len(a), len(b), diff))
    return out


def run(specs: list[str], base_headers, work_headers, arch: str, jobs: int, log=print) -> list[KernelDiff]:
    """Build every spec on both sides (`jobs` compiles at a time), then compare; `log` gets a line per spec."""
    tool = nvdisasm()
    for spec in specs:
        parse_spec(spec)  # every spec valid before the first compile
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {
            (spec, side): pool.submit(build, spec, headers, arch, tool)
            for spec in specs
            for side, headers in (("base", base_headers), ("work", work_headers))
        }
        results: list[KernelDiff] = []
        for spec in specs:
            rows = compare(spec, futures[spec, "base"].result(), futures[spec, "work"].result())
            for row in rows:
                state = (
                    "new (not in the base)"
                    if row.new
                    else "identical"
                    if row.identical
                    else f"DIFFERS: {row.changed} lines changed"
                )
                log(f"{spec:24s} {row.kernel:34s} {row.work_lines:6d} lines  {state}")
            results.extend(rows)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--base", default="HEAD", help="the git revision to compare the working tree with (default HEAD)"
    )
    ap.add_argument(
        "--config", action="append", metavar="SPEC", help="a configuration (repeatable); module doc"
    )
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_SPECS)}")
    ap.add_argument("--arch", default="sm_90a", help="target architecture (default sm_90a, the H200's)")
    ap.add_argument("--jobs", type=int, default=2, help="compiles at a time (default 2)")
    ap.add_argument(
        "--show", type=int, default=0, metavar="N", help="print the first N diff lines of each change"
    )
    args = ap.parse_args(argv)
    specs = args.config or list(QUICK_SPECS if args.quick else DEFAULT_SPECS)
    try:
        with tempfile.TemporaryDirectory(prefix="sass-diff-") as tmp:
            base = headers_at(args.base, Path(tmp))
            print(
                f"comparing the kernels of the working tree with {args.base} ({len(specs)} configurations, {args.arch})"
            )
            rows = run(specs, base, working_headers(), args.arch, args.jobs)
    except Exception as e:  # a build or tool failure: no verdict
        print(f"sass_diff: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    changed = [r for r in rows if not r.identical]
    added = [r for r in rows if r.new]
    for r in changed if args.show else ():
        print(f"\n== {r.spec} {r.kernel}")
        print("\n".join(r.diff[: args.show]))
    print(
        f"{len(rows) - len(changed) - len(added)} kernels identical, {len(changed)} differ"
        + (f", {len(added)} new" if added else "")
    )
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
