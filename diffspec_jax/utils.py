"""Small utilities: counting XLA compilations."""

from __future__ import annotations

import threading

from jax import monitoring

#: the ``jax.monitoring`` event of one XLA backend compilation (counted here and by the server's engine)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_registered = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def compile_count() -> int:
    """Number of XLA backend compilations since the first call of this function (process-wide)."""
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_event_duration_secs_listener(_listener)
            _registered = True
        return _count


class CompileCounter:
    """Context manager counting backend compilations inside its block: ``with CompileCounter() as c: ...; c.count``."""

    def __enter__(self) -> CompileCounter:
        self._start = compile_count()
        return self

    def __exit__(self, *exc) -> None:
        pass

    @property
    def count(self) -> int:
        return compile_count() - self._start
