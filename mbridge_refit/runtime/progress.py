"""Progress bars of the long loops: an export's tensors, a load's tensors.

``progress_bar(total, desc=..., unit=..., show=...)`` is tqdm's bar on stderr when ``show`` (callers pass
it for one rank only), else a bar that does nothing; both take ``update`` (done so much more), ``grow``
(the total grew: a load learns its items in parts) and ``close``. Whether to show is the caller's decision:
the command line's rule (``convert.flags.progress_from_flags``) hides bars where stderr is no terminal.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Progress", "progress_bar"]


class Progress(Protocol):
    def update(self, n: int) -> None: ...

    def grow(self, n: int) -> None: ...

    def close(self) -> None: ...


def progress_bar(total: int, *, desc: str, unit: str, show: bool) -> Progress:
    """A bar of ``total`` ``unit``s named ``desc`` when ``show``, else one that prints nothing."""
    if show:
        return _Bar(total, desc, unit)
    return _NoProgress()


class _Bar:
    def __init__(self, total: int, desc: str, unit: str) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False)

    def update(self, n: int) -> None:
        self._bar.update(n)

    def grow(self, n: int) -> None:
        self._bar.total = (self._bar.total or 0) + n
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def grow(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
