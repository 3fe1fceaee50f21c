"""Static shapes a user declared, checked against the values a call or a collective would use.

Every rank compiles its functions for the declared static shapes, so the
master refuses, before any process wakes, a value that contradicts them.
"""

__all__ = ["shape_text", "declared_rows", "contradicts", "check_argument_shape",
           "check_shared_shape"]


def shape_text(shape):
    """A static shape as one writes it in ``pt.tensor(shape=...)``, ``None`` for a free length.

    Examples
    --------
    >>> shape_text((None, 3)), shape_text((None,))
    ('(None, 3)', '(None,)')
    """
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + \
        ("," if len(shape) == 1 else "") + ")"


def declared_rows(var):
    """The static row count of ``var`` (``pt.tensor(shape=(8, 3))``: 8), or None.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> declared_rows(pt.tensor("x", shape=(8, 3))), declared_rows(pt.matrix("y"))
    (8, None)
    """
    return var.type.shape[0] if var.type.ndim else None


def contradicts(declared, shape, from_axis=0):
    """True if ``shape`` differs from ``declared`` on a fixed axis (from ``from_axis`` on) or in length.

    Examples
    --------
    >>> contradicts((None, 3), (5, 3)), contradicts((None, 3), (5, 4)), contradicts((2, 3), (5, 3), 1)
    (False, True, False)
    """
    return len(declared) != len(shape) or \
        any(d is not None and d != n for d, n in zip(declared[from_axis:], shape[from_axis:]))


def check_argument_shape(var, name, shape, scattered):
    """Raise TypeError if argument ``shape`` contradicts the static shape input ``var`` declares.

    A scattered input's rows are free (``synk.function`` refuses a static row
    count there): the argument may hold more rows than a call uses.
    """
    if contradicts(var.type.shape, tuple(shape), 1 if scattered else 0):
        raise TypeError(f"input {name!r} is declared with shape {shape_text(var.type.shape)} but "
                        f"the argument has shape {tuple(shape)}; give an argument of that shape or "
                        f"declare the axis free (None) in its pt.tensor(..., shape=...)")


def check_shared_shape(var, shape, what):
    """Raise ValueError if ``what`` would give shared ``var`` a ``shape`` its static shape forbids.

    Every rank compiles its functions for the declared shape, so a value of
    another shape would be computed on wrongly.
    """
    if contradicts(var.type.shape, tuple(shape)):
        raise ValueError(f"{what} would give {var} shape {tuple(shape)} on some rank, but it is "
                         f"declared with static shape {shape_text(var.type.shape)}; make it with "
                         f"pytensor.shared(value, shape=(None, ...)) to let that axis change")
