"""Write docs/api.md from the docstrings of the public API (run: make docs)."""

import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import synkhronos as synk  # noqa: E402
from synkhronos.api import checkpoint  # noqa: E402
from synkhronos.extensions import history, sync, train, updates  # noqa: E402

CLASS_MEMBERS = {
    "Function": ["__call__", "as_pytensor", "build_inputs", "name", "output_modes", "update_modes"],
    "Data": ["set_value", "set_length", "set_shape", "condition_data", "free_memory", "data",
             "alloc_size", "shape", "dtype", "ndim", "size"],
    "History": ["center_values", "plot"],
}


def _doc(obj):
    return inspect.cleandoc(obj.__doc__ or "(no docstring)")


def _entry(name, obj, level="###"):
    try:
        sig = str(inspect.signature(obj)) if callable(obj) and not isinstance(obj, property) else ""
    except (TypeError, ValueError):
        sig = ""
    lines = [f"{level} `{name}{sig}`", "", _doc(obj), ""]
    return lines


def render():
    out = ["# API reference", "",
           "Generated from the docstrings by `tools/gen_api_docs.py` (`make docs`); do not edit by hand.", ""]
    sections = [("synkhronos", synk, [n for n in synk.__all__ if n != "checkpoint"]),
                ("synkhronos.checkpoint", checkpoint, checkpoint.__all__),
                ("synkhronos.extensions.updates", updates, updates.__all__),
                ("synkhronos.extensions.train", train, train.__all__),
                ("synkhronos.extensions.sync", sync, sync.__all__),
                ("synkhronos.extensions.history", history, history.__all__)]
    for title, module, names in sections:
        out += [f"## `{title}`", "", _doc(module), ""]
        for name in names:
            obj = getattr(module, name)
            out += _entry(name, obj)
            for member in CLASS_MEMBERS.get(name, []):
                out += _entry(f"{name}.{member}", inspect.getattr_static(obj, member), level="####")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    path = os.path.join(ROOT, "docs", "api.md")
    with open(path, "w") as fh:
        fh.write(render())
    print(f"wrote {path}")
