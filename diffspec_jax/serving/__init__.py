"""An OpenAI-compatible server with continuous batching over fixed request slots (``python -m diffspec_jax.serve``).

* :mod:`~diffspec_jax.serving.scheduler`: :class:`SlotEngine`, the slot engine (queue, admission, blocks of device
  cycles, per-slot state) in its own thread;
* :mod:`~diffspec_jax.serving.protocol`: the request and response bodies (pydantic) and OpenAI-style errors;
* :mod:`~diffspec_jax.serving.app`: the ASGI application (FastAPI): completions and chat completions, streaming,
  ``/v1/models``, ``/health``, ``/metrics``.

The HTTP parts need the ``serve`` extra (``pip install -e ".[serve]"``); the scheduler needs only the engine.
"""
