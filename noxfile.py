"""Every task of the tessera monorepo.

`nox` with no arguments runs lint, typecheck, tests, tests_newest (every package's tests again
on the newest torch users get) and integration (every code block of the user guide, as
`docs` does alone, then torchrun multi-node and elastic-restart jobs). Other sessions: `build` (six
wheels into dist/), `bench` (everything under benchmarks/), `demo` (the README's main command),
`convergence` (the ViT under every parallel layout, writes docs/convergence.md), `reliability`
(hostile configs and injected faults, a report).

Each package's tests run in an environment holding only that package, its declared tessera
dependencies and the test tools: that is what proves "install only the package you need".
"""

from __future__ import annotations

import pathlib
import zipfile

import nox

ROOT = pathlib.Path(__file__).parent

# The one place that pins torch. Packages declare the range CI tests in full: TORCH, the pinned
# release every environment installs (the machine has a local CPU wheel of it), and
# NEWEST_TORCH, the newest release users get (a CUDA build that runs on CPU, about 5 GB), on
# which `tests_newest` runs every package's tests in the default run.
TORCH = "torch==2.13.0"
NEWEST_TORCH = "torch==2.14.1"

# Each package's tessera dependencies, as declared in its pyproject.toml (checked below).
TESSERA_DEPS: dict[str, tuple[str, ...]] = {
    "registry": (),
    "context": ("registry",),
    "layers": ("registry", "context"),
    "pipeline": ("registry", "context"),
    "engine": ("registry", "context", "pipeline"),
    "testing": (),
}
PACKAGES = tuple(TESSERA_DEPS)

# Packages whose tests start ranks through the tessera.testing harness.
USES_HARNESS = ("context", "layers", "pipeline", "engine")

TEST_TOOLS = ("pytest>=7", "hypothesis>=6", "numpy", "pyyaml")
# Models tessera-layers' tests build from libraries that import only beside NEWEST_TORCH:
# timm needs torchvision, whose build on this machine's disk is the one for torch 2.14.1.
NEWEST_TEST_MODELS = ("torchvision==0.29.1", "timm>=1.0.31,<1.1")

nox.options.sessions = ["lint", "typecheck", "tests", "tests_newest", "integration"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def _closure(name: str) -> list[str]:
    """The package and every tessera package it depends on, transitively."""
    seen: list[str] = []
    stack = [name]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.append(current)
            stack.extend(TESSERA_DEPS[current])
    return seen


def _path(name: str) -> str:
    return str(ROOT / "packages" / name)


def _has_code(name: str) -> bool:
    return (ROOT / "packages" / name / "src" / "tessera" / name / "__init__.py").exists()


#: Packages whose tests run on TORCH only: tessera-registry uses no torch (the standard library
#: only), and tessera-testing's harness runs every other package's tests in tests_newest.
PINNED_TORCH_PACKAGES = ("registry", "testing")
TEST_EXTRAS = {"pipeline": "plot", "engine": "tensorboard", "layers": "transformers"}


def _install_packages(session: nox.Session, *specs: str) -> None:
    """tessera's packages (paths, with extras) and what they declare.

    pip builds each path into a wheel; in its default isolated build environment it installs
    hatchling again for every package (about 1.5 s each, a few dozen per CI run). Built
    with the session's own hatchling instead, the wheels are the same.
    """
    session.install("hatchling>=1.18")
    session.install("--no-build-isolation", *specs)


def _install_torch(session: nox.Session, *, bytecode: bool = True, torch: str = TORCH) -> None:
    """torch (exactly ``TORCH``), its modules compiled to bytecode unless ``bytecode=False``.

    This machine sets ``PYTHONDONTWRITEBYTECODE=1``: a torch installed without its ``.pyc``
    files is compiled from source again by every process that imports it, and the tests start
    hundreds (worker pools, torchrun jobs). Measured: ``import torch, transformers`` Llama took
    15 s of CPU per process that way, 7 s compiled. Compiling once, on both cores, takes about
    10 s; pip's own compile at install is serial and slower. mypy reads sources only.
    """
    session.install("--no-compile", torch)
    if not bytecode:
        return
    where = "import importlib.util as u; print(u.find_spec('torch').submodule_search_locations[0])"
    found = session.run_install("python", "-c", where, silent=True)
    if found is None:  # --no-install on a reused environment: compiled when it was made
        return
    torch_dir = found.strip()
    assert pathlib.Path(torch_dir).is_dir(), f"torch is not at {torch_dir!r}"
    # exit 1: a file no Python 3.11 imports (torch's py312_intrinsics.py) does not compile
    compile_all = ("python", "-m", "compileall", "-q", "-j", "0", "--invalidation-mode")
    session.run_install(*compile_all, "timestamp", torch_dir, silent=True, success_codes=[0, 1])


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, in an environment holding only what that package declares."""
    _run_package_tests(session, package)


@nox.session
def tests_newest(session: nox.Session) -> None:
    """Every torch-using package's tests on the newest torch users get (NEWEST_TORCH).

    The per-package environments of ``tests`` prove each package installs alone, on TORCH;
    this run proves the code on the other end of the declared range. One environment holds
    every package and its test extras, so the 5 GB build is installed once. Some tests run on
    TORCH only: those of PINNED_TORCH_PACKAGES, and those marked ``pinned_torch_only``, whose
    code paths this run covers in other cases (``pyproject.toml`` says which). Those marked
    ``newest_torch_only`` run here only, their code paths covered on TORCH by other cases.
    Every package is tested even when one fails; the session fails after, naming them.
    """
    _install_torch(session, torch=NEWEST_TORCH)
    session.install(*TEST_TOOLS)
    _install_packages(
        session, *(_path(p) + (f"[{TEST_EXTRAS[p]}]" if p in TEST_EXTRAS else "") for p in PACKAGES)
    )
    session.install(NEWEST_TORCH, *NEWEST_TEST_MODELS)  # pinned again: pip keeps it
    session.run(
        "python",
        "-c",
        f"import torch; assert torch.__version__.startswith('{NEWEST_TORCH.split('==')[1]}')",
    )
    failed = []
    for package in PACKAGES:
        tests_dir = ROOT / "packages" / package / "tests"
        if package in PINNED_TORCH_PACKAGES or not any(tests_dir.glob("test_*.py")):
            continue
        report = pathlib.Path(session.create_tmp()) / f"{package}.xml"
        report.unlink(missing_ok=True)
        session.run(
            *("python", "-m", "pytest", str(tests_dir), "-p", "no:cacheprovider"),
            *("-m", "not pinned_torch_only", f"--junit-xml={report}", *session.posargs),
            success_codes=[0, 1],  # 1: tests failed, counted from the report below
        )
        if report.exists() and not _all_passed(report):
            failed.append(package)
    if failed:
        session.error(f"tests failed on {NEWEST_TORCH}: {', '.join(failed)} (see above)")


def _all_passed(report: pathlib.Path) -> bool:
    """Whether a pytest JUnit report counts no failure and no error."""
    import xml.etree.ElementTree as ET

    suites = ET.parse(report).getroot().iter("testsuite")
    return all(int(s.get("failures", 0)) + int(s.get("errors", 0)) == 0 for s in suites)


def _run_package_tests(session: nox.Session, package: str) -> None:
    _install_torch(session)  # registry's tests, too, build torch's classes by name
    wanted = _closure(package)
    if package in USES_HARNESS:
        wanted += [p for p in _closure("testing") if p not in wanted]
    session.install(*TEST_TOOLS)
    # The package under test is installed with its optional extras, so the code behind them
    # (timeline plots, the TensorBoard hook) is tested against the real dependency.
    extra = TEST_EXTRAS.get(package)
    _install_packages(
        session, *(_path(p) + (f"[{extra}]" if p == package and extra else "") for p in wanted)
    )
    tests_dir = ROOT / "packages" / package / "tests"
    if not any(tests_dir.glob("test_*.py")):
        session.skip(f"tessera-{package} has no tests yet")
    session.run(
        "python",
        "-m",
        "pytest",
        str(tests_dir),
        "-p",
        "no:cacheprovider",
        *("-m", "not newest_torch_only"),  # tests_newest runs those
        *session.posargs,
    )


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's source."""
    _install_torch(session, bytecode=False)
    session.install("mypy>=1.10", "numpy", "pytest>=7", "types-PyYAML")
    for package in PACKAGES:
        if _has_code(package):
            session.run("mypy", "--strict", "-p", f"tessera.{package}")


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff, the format check, and the import contract (pyproject.toml's [tool.importlinter]).

    The contract encodes the package arrows of docs/architecture.md.
    """
    session.install("ruff>=0.5", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # The import graph is read statically: the packages are installed without torch.
    _install_packages(session, "--no-deps", *(_path(p) for p in PACKAGES))
    session.run("lint-imports")
    _check_declared_dependencies(session)


def _check_declared_dependencies(session: nox.Session) -> None:
    """The table above must agree with what each pyproject.toml declares."""
    import tomllib

    for package, deps in TESSERA_DEPS.items():
        meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
        declared = {
            d.split(">")[0].split("=")[0].split("<")[0].strip().removeprefix("tessera-")
            for d in meta["project"]["dependencies"]
            if d.startswith("tessera-")
        }
        if declared != set(deps):
            session.error(
                f"packages/{package}/pyproject.toml declares tessera deps {sorted(declared)}, "
                f"noxfile.TESSERA_DEPS says {sorted(deps)}"
            )


@nox.session
def build(session: nox.Session) -> None:
    """Hatch builds every package into dist/; each wheel holds only its own subpackage."""
    session.install("hatch>=1.9")
    dist = ROOT / "dist"
    dist.mkdir(exist_ok=True)
    for old in dist.glob("tessera_*"):
        old.unlink()
    for package in PACKAGES:
        with session.chdir(_path(package)):
            session.run("hatch", "build", "-t", "wheel", str(dist))
    wheels = sorted(dist.glob("tessera_*.whl"))
    if len(wheels) != len(PACKAGES):
        session.error(f"expected {len(PACKAGES)} wheels in dist/, found {len(wheels)}")
    for wheel in wheels:
        package = wheel.name.split("-")[0].removeprefix("tessera_")
        with zipfile.ZipFile(wheel) as archive:
            code = [n for n in archive.namelist() if not n.split("/")[0].endswith(".dist-info")]
        stray = [n for n in code if not n.startswith(f"tessera/{package}/")]
        if stray or "tessera/__init__.py" in code:
            session.error(f"{wheel.name} holds files outside tessera/{package}/: {stray}")
        session.log(f"{wheel.name}: {len(code)} files, all under tessera/{package}/")


@nox.session
def bench(session: nox.Session) -> None:
    """Runs every benchmark under benchmarks/; each prints tessera next to its peer as ratios."""
    _install_torch(session)
    session.install("numpy")
    # tessera-layers with its transformers extra: bench_parallelize converts a GPT-2.
    session.install(
        *(_path(p) + ("[transformers]" if p == "layers" else "") for p in PACKAGES if _has_code(p))
    )
    # Colossal-AI for bench_colossal.py, in this environment only (never a package dependency).
    # Its sdist declares torch<=2.5.1 and a stack of CUDA libraries: install it without
    # dependencies, plus what the import path of its legacy layers needs (peft, accelerate and
    # psutil through colossalai.interface / colossalai.accelerator, einops; transformers and the
    # rest are already here). benchmarks/colossal_patches.py stubs the GaLore optimizers.
    session.install(
        "--no-deps",
        "colossalai==0.5.0",
        "peft==0.21.2",
        "accelerate==1.15.0",
        "psutil==7.2.2",
        "einops==0.8.2",
    )
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    if not scripts:
        session.log("benchmarks/ holds no benchmark yet")
    for script in scripts:
        session.run("python", str(script), *session.posargs)


def _install_examples(session: nox.Session, *extras: str) -> None:
    """torch, every tessera package and what the examples read (scikit-learn's digits)."""
    _install_torch(session)
    session.install("scikit-learn", *extras)
    _install_packages(session, *(_path(p) for p in PACKAGES if _has_code(p)))


@nox.session
def demo(session: nox.Session) -> None:
    """The README's main command: the ViT, single process next to data x pipeline x tensor.

    First a few seconds of checks that every example config and model still works
    (examples/check.py), then examples/demo.py (arguments after `--` go to it).
    """
    _install_examples(session)
    session.run("python", str(ROOT / "examples" / "check.py"))
    session.run("python", str(ROOT / "examples" / "demo.py"), *session.posargs)


@nox.session
def convergence(session: nox.Session) -> None:
    """The ViT under every layout from the same weights: docs/convergence.md and .png."""
    _install_examples(session, "matplotlib")
    session.run("python", str(ROOT / "examples" / "convergence.py"), *session.posargs)


def _install_docs(session: nox.Session) -> None:
    """What docs/test_docs.py runs the guide's blocks with: every package, transformers."""
    _install_torch(session)
    session.install(*TEST_TOOLS, "matplotlib")
    _install_packages(
        session, *(_path(p) + ("[transformers]" if p == "layers" else "") for p in PACKAGES)
    )


def _pytest(session: nox.Session, tests: pathlib.Path, *args: str) -> None:
    session.run("python", "-m", "pytest", str(tests), "-p", "no:cacheprovider", *args)


@nox.session
def docs(session: nox.Session) -> None:
    """Runs every ```python block of docs/*.md (docs/test_docs.py), so the guide cannot rot.

    CI runs them in ``integration``'s environment, which holds all they need (one environment
    fewer to build: about a minute).
    """
    _install_docs(session)
    _pytest(session, ROOT / "docs" / "test_docs.py", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """The guide's code blocks (``docs``), then tests_integration/'s torchrun jobs.

    The ViT as two nodes and through an elastic restart; transformers models converted by
    ``parallelize`` under the engine in several layouts; a fine-tune preempted and resumed.
    Each test starts real torchrun jobs (CPU workers) with a wall-clock limit, and compares
    their losses with one uninterrupted single-invocation run.
    """
    _install_docs(session)  # every package, transformers among them
    session.install("scikit-learn", "tensorboard")  # the examples' data, the TensorBoard hook
    if not session.posargs:  # arguments select integration tests (``-- -k elastic``)
        _pytest(session, ROOT / "docs" / "test_docs.py")
    _pytest(session, ROOT / "tests_integration", *session.posargs)


@nox.session
def reliability(session: nox.Session) -> None:
    """The reliability report: hostile configs, injected faults, hangs, wrong results.

    Exits non-zero on any hang or wrong result (arguments after `--` go to the script, e.g.
    `nox -s reliability -- --configs 5000 --repeats 3`).
    """
    _install_examples(session)
    session.run(
        "python", str(ROOT / "tests_integration" / "reliability_report.py"), *session.posargs
    )
