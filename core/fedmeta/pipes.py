"""Standard output into a pipe whose reader may leave (``fedmeta ... | head``).

:func:`to_devnull` points a stream's file descriptor at /dev/null, so that what is still buffered
and everything written later goes nowhere instead of raising BrokenPipeError. The CLI does it
when a command has ended on a closed pipe (the interpreter's final flush is then silent);
:class:`ReaderMayLeave` does it the moment the reader leaves, so that a run goes on.
"""

from __future__ import annotations

import os
from typing import Any, TextIO, cast


def to_devnull(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null (its buffer then drains there)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


class ReaderMayLeave:
    """``sys.stdout`` during a CLI command: a reader that leaves (``| head``) ends nothing.

    A print into the closed pipe raised BrokenPipeError in the middle of the command, which ended
    a simulated run with status 0 and no summary whenever Python's 8 KB stdout buffer filled
    before the last round (a loaded CI machine hit it). Here the first BrokenPipeError points the
    stream at /dev/null, so the run, tuning or deployed run goes on and its later output is
    dropped, as ``head`` wanted.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    @classmethod
    def around(cls, stream: TextIO) -> TextIO:
        """``stream`` wrapped (once), typed as the stream it stands for."""
        return stream if isinstance(stream, cls) else cast("TextIO", cls(stream))

    def write(self, text: str) -> int:
        """Write; into a pipe its reader has left, nothing (and from now on /dev/null)."""
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            to_devnull(self._stream)
            return len(text)

    def flush(self) -> None:
        """Flush, with the same rule as :meth:`write`."""
        try:
            self._stream.flush()
        except BrokenPipeError:
            to_devnull(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)  # isatty, fileno, encoding: the real stream's
