"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class CwmError(Exception):
    """An error caused by the user's input or environment, reported without a traceback."""


def check_positive_int(value, what: str) -> None:
    """Raise a one-line ``CwmError`` unless ``value`` is a positive int (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CwmError(f"{what} must be a positive integer, got {value!r}")


def first_line(err: BaseException) -> str:
    """The informative line of an exception's message."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    # TVM errors end with the informative line; Python errors start with it.
    msg = lines[-1] if lines and type(err).__module__.startswith("tvm") else (lines[0] if lines else "")
    return msg or type(err).__name__
