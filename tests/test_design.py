"""The package's shape holds: layers import downwards only, importing changes nothing outside,
fork() is undone by close(), the supported versions are the pinned ones, docstring examples run."""

import ast
import doctest
import glob
import importlib
import importlib.metadata
import os
from unittest import mock

import pytest
from helpers import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "synkhronos")

#: layers from the top; a module may import its own layer and the ones below, never one above
LAYERS = ["face", "entry", "extensions", "api", "runtime", "rank", "compile", "wire", "seams", "comm",
          "platform", "ipc", "tracing", "errors"]
#: the modules at the package root: the face, the entry points (python -m ...), the errors
ROOT_MODULES = {"synkhronos": "face", "synkhronos.checkpoint": "face", "synkhronos.launch": "entry",
                "synkhronos.cleanup": "entry", "synkhronos.errors": "errors"}


#: the packages at the package root that are entry points
ROOT_PACKAGES = {"launch": "entry"}


def _layer(module):
    if module in ROOT_MODULES:
        return ROOT_MODULES[module]
    top = module.split(".")[1]
    return ROOT_PACKAGES.get(top, top)


def _imports(path, module):
    """The synkhronos modules ``path`` (module ``module``) imports, at any depth of the file."""
    tree = ast.parse(open(path).read())
    package = module.rsplit(".", 1)[0] if not path.endswith("__init__.py") else module
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("synkhronos"):
                # "from .pkg import module" imports those modules; "from .module import name", the module
                modules = [m for m in (f"{target}.{a.name}" for a in node.names) if _is_module(m)]
                found.update(modules or [target])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("synkhronos"))
    return found


def _is_module(name):
    rel = name.split(".")[1:]
    base = os.path.join(PACKAGE, *rel)
    return os.path.exists(base + ".py") or os.path.isdir(base)


def _modules():
    """(module name, path) of every module of the package, found on disk: importing would skip the
    modules of a package whose optional dependency is missing (``extensions.pymc`` without PyMC)."""
    top = os.path.dirname(PACKAGE)
    for path in sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)):
        name = os.path.relpath(path, top)[:-len(".py")].replace(os.sep, ".")
        yield name.removesuffix(".__init__"), path


def _graph():
    return {name: _imports(path, name) for name, path in _modules()}


def test_layers_import_downwards_only():
    upward = []
    for module, targets in _graph().items():
        for target in targets:
            if LAYERS.index(_layer(target)) < LAYERS.index(_layer(module)):
                upward.append(f"{module} -> {target}")
    assert not upward, upward


def test_every_package_has_its_layer_and_no_module_is_loose():
    loose = [name for name, _ in _modules() if name not in ROOT_MODULES and _layer(name) not in LAYERS]
    assert not loose, loose


def test_no_import_circles():
    graph = _graph()

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for t in graph.get(todo.pop(), ()):
                t = t if t in graph else t.rsplit(".", 1)[0]
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen
    circles = [m for m in graph if m in reach(m) and not m.endswith("__init__")
               and m != "synkhronos"]
    assert not circles, circles


def test_the_worker_never_imports_the_user_api():
    graph = _graph()
    seen, todo = set(), ["synkhronos.runtime.worker"]
    while todo:
        for t in graph.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    assert not [m for m in seen if m.startswith("synkhronos.api")], sorted(seen)


def test_importing_synkhronos_changes_nothing_outside_it():
    out = run_script("""
        import os, sys, warnings
        import pytensor
        from pytensor.compile.mode import optdb
        env, filters = dict(os.environ), list(warnings.filters)
        before = set(optdb._names) if hasattr(optdb, "_names") else set(optdb.__db__)
        import synkhronos
        after = set(optdb._names) if hasattr(optdb, "_names") else set(optdb.__db__)
        print("jax" in sys.modules, dict(os.environ) == env, list(warnings.filters) == filters,
              sorted(after - before))
    """)
    assert out.stdout.split("\n")[0] == "False True True []", out.stdout + out.stderr


@pytest.mark.slow
def test_close_gives_the_process_back_what_fork_changed():
    """close(), and the teardown after a fault, give back every setting fork() changed: the
    environment, JAX's settings (64-bit floats, here turned off for float32), PyTensor's floatX,
    the BLAS threads, in one place."""
    out = run_script("""
        import os, signal, jax, numpy as np, pytensor, pytensor.tensor as pt, synkhronos as synk
        import pytensor.link.jax.dispatch       # turns JAX's 64-bit floats on, for PyTensor's JAX backend
        pytensor.config.floatX = "float32"
        from synkhronos.platform.cpu_blas import current_blas_threads
        from synkhronos.platform.process_changes import changes
        names = ["jax_enable_recoverability", "jax_cpu_collectives_implementation",
                 "jax_enable_preemption_service", "jax_enable_x64", "jax_enable_compilation_cache"]
        def state():
            return ([getattr(jax.config, n) for n in names], current_blas_threads(),
                    pytensor.config.floatX,
                    {k: os.environ.get(k) for k in ("JAX_PLATFORMS", "XLA_FLAGS", "OMP_NUM_THREADS",
                                                    "TF_CPP_MIN_LOG_LEVEL")})
        before = state()
        synk.fork(2, threads_per_device=1)
        x = pt.vector("x")
        f = synk.function([x], x.sum())
        during, changed = state(), changes.changed()
        synk.close()
        closed = state() == before and not changes.changed()
        synk.fork(2, threads_per_device=1)
        f = synk.function([x], x.sum())
        from synkhronos.runtime import session
        os.kill(list(session.current().worker_pids.values())[0], signal.SIGKILL)
        try:
            f(np.ones(4, "float32"))
        except synk.WorkerError:
            pass
        print(closed, state() == before and not changes.changed(), before != during, during[1],
              len(changed) > 5)
    """)
    assert out.stdout.split() == ["True", "True", "True", "1", "True"], out.stdout + out.stderr


@pytest.mark.slow
def test_a_blas_library_first_loaded_while_the_runtime_ran_gets_the_users_threads_back():
    """fork() loads scipy's BLAS (through PyTensor's JAX backend) under the runtime's one-thread
    environment; after close() it runs on the threads the user's environment asks for."""
    out = run_script("""
        import os, threadpoolctl, synkhronos as synk
        synk.fork(2)
        synk.close()
        print(sorted({i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}),
              os.cpu_count())
    """, env={"OPENBLAS_NUM_THREADS": None, "OMP_NUM_THREADS": None})
    threads, cores = out.stdout.strip().rsplit(" ", 1)
    assert threads == f"[{cores}]", out.stdout + out.stderr


def test_supported_versions_are_the_pinned_ones():
    import tomllib

    from packaging.requirements import Requirement

    from synkhronos.platform.internals import READS_INTERNALS_OF, supported_versions
    pins = {Requirement(r).name: Requirement(r).specifier
            for r in tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["dependencies"]}
    never_installed = mock.patch.object(importlib.metadata, "requires",
                                        side_effect=importlib.metadata.PackageNotFoundError("synkhronos"))
    with never_installed:                   # a checkout run from its source tree reads its pyproject.toml
        from_the_checkout = supported_versions()
    for supported in (supported_versions(), from_the_checkout):
        assert set(supported) == set(READS_INTERNALS_OF)
        for name in READS_INTERNALS_OF:
            assert supported[name] == pins[name], name


#: modules whose examples need a runtime: the first forks and closes its own, the others run in
#: one of two devices with numpy as np, pytensor and pytensor.tensor as pt imported
FORKS_ITS_OWN = "synkhronos"
NEEDS_A_RUNTIME = ["synkhronos.api.lifecycle", "synkhronos.api.collectives", "synkhronos.api.data",
                   "synkhronos.api.function", "synkhronos.api.step", "synkhronos.api.checkpoint",
                   "synkhronos.extensions.updates", "synkhronos.extensions.train",
                   "synkhronos.platform.device_arrays", "synkhronos.platform.values", "synkhronos.platform.pinned",
                   "synkhronos.tracing.launches",
                   "synkhronos.platform.internals"]
#: modules of an optional extra: their examples run where the extra is installed
NEEDS_AN_EXTRA = {"synkhronos.extensions.pymc": "pymc", "synkhronos.extensions.pymc.sampling": "pymc"}
NEEDS_A_RUNTIME += [m for m, extra in NEEDS_AN_EXTRA.items() if importlib.util.find_spec(extra)]


@pytest.mark.parametrize("module", [name for name, _ in _modules() if not name.endswith(("worker", "__main__"))
                                    and name not in [FORKS_ITS_OWN, *NEEDS_A_RUNTIME]])
def test_docstring_examples_run(module):
    for package, extra in NEEDS_AN_EXTRA.items():
        if module.startswith(package):
            pytest.importorskip(extra)
    failures, _ = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert failures == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_docstring_examples_of_the_public_api_run_in_a_runtime():
    out = run_script(f"""
        import doctest, importlib, sys
        import numpy as np, pytensor, pytensor.tensor as pt
        import synkhronos as synk

        def run(name, **globs):
            failed, tried = doctest.testmod(importlib.import_module(name), extraglobs=globs,
                                            optionflags=doctest.ELLIPSIS)
            print(name, failed, tried, flush=True)
            return failed

        failed = run({FORKS_ITS_OWN!r})
        synk.fork(2)
        try:
            for name in {NEEDS_A_RUNTIME!r}:
                failed += run(name, synk=synk, np=np, pytensor=pytensor, pt=pt)
        finally:
            synk.close()
        sys.exit(1 if failed else 0)
    """, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


def test_the_modules_docs_api_presents_import_as_modules():
    """docs/api.md presents ``synkhronos.checkpoint`` as a module: it imports as one, and is
    ``synk.checkpoint``."""
    import synkhronos as synk
    import synkhronos.checkpoint
    from synkhronos.checkpoint import restore, save
    assert synkhronos.checkpoint is synk.checkpoint
    assert (save, restore) == (synk.checkpoint.save, synk.checkpoint.restore)
