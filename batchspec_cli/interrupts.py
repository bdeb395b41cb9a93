"""Stop signals that land in a finalizer are not lost.

Python reports an exception raised inside ``__del__`` or a weakref callback as "Exception
ignored in ..." and carries on. A Ctrl-C (or a SIGTERM turned into ``StopNow``) that arrives
while a library's finalizer runs, as happens while transformers imports or a tokenizer
loads, would then be printed as a traceback and forgotten: the job would run to the end and
exit 0. ``kept()`` remembers such a stop instead, in the list it yields.
This module imports nothing heavy, so ``__main__`` can use it before the command line loads.
"""

from __future__ import annotations

import contextlib
import signal
import sys


class StopNow(BaseException):
    """A stop signal that acts at once (what is saved stays saved; temporary files are removed)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_stop(signum: int, frame) -> None:
    """A signal handler: the signal becomes ``StopNow`` (which, unlike KeyboardInterrupt, no library catches)."""
    raise StopNow(signum)


def signal_of(exc: BaseException) -> int | None:
    """The signal an exception stands for: KeyboardInterrupt is SIGINT; None for any other exception."""
    if isinstance(exc, StopNow):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    return None


@contextlib.contextmanager
def kept():
    """While the block runs, a stop swallowed by a finalizer is not printed; its signal joins the list yielded."""
    previous = sys.unraisablehook
    swallowed: list[int] = []

    def hook(unraisable) -> None:
        signum = signal_of(unraisable.exc_value)
        if signum is None:
            previous(unraisable)
        else:
            swallowed.append(signum)

    sys.unraisablehook = hook
    try:
        yield swallowed
    finally:
        sys.unraisablehook = previous

