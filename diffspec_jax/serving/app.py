"""The ASGI application (FastAPI): the OpenAI endpoints over a running :class:`SlotEngine`.

* ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template, or ``chat_template``):
  JSON, or server-sent events with ``stream: true`` (``data: {chunk}`` lines, then ``data: [DONE]``;
  ``stream_options.include_usage`` adds a last chunk with the usage);
* ``GET /v1/models``, ``GET /health`` (200 while the engine runs, else 503), ``GET /metrics`` (Prometheus text).

The engine runs in its own thread; each request reaches it through :meth:`SlotEngine.submit` and its events come
back through an ``asyncio.Queue`` (``loop.call_soon_threadsafe``). Text is detokenized and cut at stop strings on
the engine thread (:class:`diffspec_jax.stopping.SequenceText`). Errors are OpenAI error bodies: 400 for invalid
requests (validation, unsupported keys, prompt + ``max_tokens`` beyond ``max_model_len``), 401 without the API
key, 404 for another model name, 503 with ``Retry-After`` when the waiting queue is full, 504 past the request
timeout. A client that disconnects (or closes its stream) aborts its request, which frees its slot. Text prompts
are tokenized a bounded prefix at a time (:func:`tokenize_bounded`). The limits on bodies, slow clients and
connections are the HTTP layer's (:mod:`diffspec_jax.serving.limits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffspec_jax.errors import ConfigError, InputError
from diffspec_jax.serving import protocol as P
from diffspec_jax.serving.scheduler import EngineStopped, Event, QueueFull, SamplingParams, SlotEngine
from diffspec_jax.serving.scheduler import Request as EngineRequest
from diffspec_jax.stopping import SequenceText

#: ``max_tokens`` of a completion that does not set it (the OpenAI default)
DEFAULT_COMPLETION_TOKENS = 16
#: ``Retry-After`` of a 503 (seconds)
RETRY_AFTER_S = 1
#: characters per token assumed when a text is cut before it is tokenized (:func:`tokenize_bounded`): more than
#: any tokenizer's average, so a text cut there that still has too few tokens is rare (it is then tokenized whole)
CHARS_PER_TOKEN = 16


def tokenize_bounded(encode: Callable[[str], list[int]], text: str, max_tokens: int,
                     param: str = "prompt") -> list[int]:
    """``encode(text)``, stopping early for a text far too long: a text longer than :data:`CHARS_PER_TOKEN` x
    (``max_tokens`` + 1) characters is first tokenized up to there, and if that prefix already has more than
    ``max_tokens`` tokens (so the text has at least ``max_tokens``, one merge across the cut aside) it is refused
    with a 400 ``context_length_exceeded`` without tokenizing the rest."""
    cap = CHARS_PER_TOKEN * (max_tokens + 1)
    if len(text) > cap:
        head = encode(text[:cap])
        if len(head) > max_tokens:
            raise P.APIError(400, f"this model's maximum context length is {max_tokens} tokens; the prompt has more "
                                  f"than {max_tokens} tokens (its first {cap} characters have {len(head)})",
                             param=param, code="context_length_exceeded")
    return encode(text)


#: pydantic's names of union members in an error's location (``prompt.str``, ``stop.list[str]``)
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _validation_error(errors: list[dict[str, Any]]) -> P.APIError:
    """pydantic's errors as one 400: for a field that has an error saying what is wrong with its value, the union
    members it merely is not (``Input should be a valid list``) are left out; ``param`` is the first error's path
    without pydantic's type tags (``prompt.2``, ``messages.0.content``)."""
    def path(e):
        return ".".join(str(x) for x in e.get("loc", ()) if isinstance(x, int) or (
            x != "body" and re.fullmatch(r"[A-Za-z_]\w*", x) and x not in _TYPE_TAGS)) or "body"

    bad_json = [e for e in errors if e.get("type") == "json_invalid"]
    if bad_json:  # (its location is a character offset, no field)
        e = bad_json[0]
        where = e.get("loc", ())[-1]
        return P.APIError(400, f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}"
                               + (f" (at character {where})" if isinstance(where, int) else ""), param=None)
    mismatch = lambda e: e.get("type", "").endswith("_type")  # noqa: E731
    told = {path(e).split(".")[0] for e in errors if not mismatch(e)}
    errors = [e for e in errors if not (mismatch(e) and path(e).split(".")[0] in told)]
    said = lambda e: P.unknown_field(path(e)) if e.get("type") == "extra_forbidden" else \
        f"{path(e)}: {e.get('msg')}"  # noqa: E731
    message = "; ".join(said(e) for e in errors[:5])
    return P.APIError(400, f"invalid request: {message}", param=path(errors[0]) if errors else None)


#: the conversation the server renders with its chat template before it starts (one user turn: every template
#: takes it, including those that refuse a system message)
SAMPLE_CHAT = ({"role": "user", "content": "Write a function that parses a date."},)


def apply_chat_template(tokenizer, chat: list[dict[str, Any]], template: str) -> str:
    """``chat`` rendered by ``template`` with the generation prompt (transformers' ``apply_chat_template``)."""
    return tokenizer.apply_chat_template(list(chat), add_generation_prompt=True, tokenize=False,
                                         chat_template=template)


def check_chat_template(tokenizer, template: str | None, source: str) -> str | None:
    """Render :data:`SAMPLE_CHAT` with ``template`` (else the tokenizer's own) and return the text, or ``None``
    when there is no template (chat requests then get a 400 saying so).

    Raises:
        ConfigError: naming the cause: jinja2 is not installed, or the template (from ``source``) fails to
            render the sample conversation (a syntax error, a ``raise_exception``, ...).
    """
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    try:
        import jinja2  # noqa: F401  (what transformers renders chat templates with)
    except ImportError:
        raise ConfigError(f"the chat template ({source}) needs jinja2, which is not installed: pip install "
                          f"'diffspec-jax[serve]' (or pip install 'jinja2>=3.1')") from None
    try:
        text = apply_chat_template(tokenizer, list(SAMPLE_CHAT), template)
    except Exception as exc:  # noqa: BLE001  (jinja's errors, raise_exception, transformers' ImportError)
        raise ConfigError(f"the chat template ({source}) cannot render a sample conversation "
                          f"{list(SAMPLE_CHAT)}: {type(exc).__name__}: {exc}; fix the template or pass "
                          f"--chat-template FILE") from None
    if not isinstance(text, str) or not text:
        raise ConfigError(f"the chat template ({source}) renders the sample conversation {list(SAMPLE_CHAT)} as "
                          f"{text!r}, not a text; fix the template or pass --chat-template FILE")
    return text


class _Api:
    """What the routes of :func:`create_app` do, over one engine and tokenizer (the routes are thin wrappers, so
    FastAPI reads their signatures as written)."""

    def __init__(self, engine: SlotEngine, tokenizer, model_name: str, api_key: str | None,
                 chat_template: str | None, sampling_defaults: dict[str, Any] | None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.chat_template = api_key, chat_template
        self.defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **(sampling_defaults or {})}
        self.http_errors: dict[int, int] = {}

    def answer_error(self, err: P.APIError) -> JSONResponse:
        self.http_errors[err.status] = self.http_errors.get(err.status, 0) + 1
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def authorized(self, request: Request) -> None:
        """The ``/v1/*`` routes' dependency: the bearer token, when the server has an API key."""
        if self.api_key is not None and request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise P.APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                             code="invalid_api_key")

    def health(self):
        m = self.engine.metrics()
        if not m["healthy"]:
            error = self.engine.error
            return JSONResponse({"status": "unavailable", "error": str(error) if error else None}, status_code=503)
        return {"status": "ok"}

    def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": P.now(),
                                            "owned_by": "diffspec-jax", "max_model_len": self.engine.max_model_len}]}

    def metrics(self):
        return PlainTextResponse(prometheus_text(self.engine.metrics(), self.http_errors),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise P.APIError(404, f"the model {name!r} does not exist here (this server serves {self.model_name!r})",
                             param="model", code="model_not_found")

    def sampling(self, body: P._SamplingRequest, max_tokens: int) -> SamplingParams:
        pick = lambda key: getattr(body, key) if getattr(body, key) is not None else self.defaults[key]  # noqa: E731
        top_k = pick("top_k")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=pick("temperature"), top_p=pick("top_p"),
                                  top_k=0 if top_k == -1 else top_k, seed=body.seed,
                                  stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)
        except InputError as exc:
            raise P.input_error(exc) from None

    def encode(self, prompt: str | list[int], special: bool = True, param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return tokenize_bounded(lambda t: list(self.tokenizer(t, add_special_tokens=special)["input_ids"]),
                                    prompt, self.engine.max_model_len, param)
        return list(prompt)

    def render_chat(self, body: P.ChatCompletionRequest) -> list[int]:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise P.APIError(400, f"the model {self.model_name!r} has no chat template (start the server with "
                                  f"--chat-template FILE), so /v1/chat/completions cannot render messages; use "
                                  f"/v1/completions", param="messages")
        chat = body.chat()
        try:
            text = apply_chat_template(self.tokenizer, chat, template)
        except Exception as exc:  # noqa: BLE001  (jinja errors, raise_exception in templates)
            raise P.APIError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None
        # as apply_chat_template(tokenize=True) does (the template writes the special tokens), a bounded prefix
        return [int(t) for t in self.encode(text, special=False, param="messages")]

    def limit(self, prompt_len: int, requested: int | None, default: int | None) -> int:
        if requested is not None:
            return requested
        if default is not None:
            return default
        return max(1, self.engine.max_model_len - prompt_len)

    async def submit(self, ids: list[int], params: SamplingParams, stops: list[str], param: str):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        output = SequenceText(self.tokenizer, stops)
        req = EngineRequest(ids, params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev), output)
        try:
            self.engine.submit(req)
        except QueueFull as exc:
            raise P.APIError(503, str(exc), "server_overloaded", code="queue_full",
                             headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStopped as exc:
            raise P.APIError(503, str(exc), "server_unavailable", code="engine_stopped") from None
        except InputError as exc:
            raise P.input_error(exc, param) from None
        return req, events

    async def collect(self, request: Request, req: EngineRequest, events: asyncio.Queue) -> tuple[str, Event]:
        """Wait for the whole answer; a client that goes away aborts its request at once."""
        texts = []
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            while True:
                ev = await _first(events.get(), gone)
                if ev is None:
                    self.engine.abort(req.id)
                    raise P.APIError(499, "the client closed the connection", code="client_closed")
                if ev.kind == "tokens":
                    texts.append(ev.text or "")
                elif ev.kind == "error":
                    raise P.APIError(ev.status or 500, ev.message or "failed", ev.error_type or "internal_error")
                else:  # "stop", "length", or "abort" (the server shut down before the request had finished)
                    return "".join(texts), ev
        finally:
            gone.cancel()

    async def stream(self, req: EngineRequest, events: asyncio.Queue, chunk, include_usage: bool,
                     first: dict | None) -> AsyncIterator[str]:
        finished = False
        try:
            if first is not None:
                yield _sse(first)
            while True:
                ev = await events.get()
                if ev.kind == "tokens":
                    if ev.text:
                        yield _sse(chunk(ev.text, None))
                elif ev.kind == "error":
                    finished = True
                    yield _sse(P.error_body(ev.message or "failed", ev.error_type or "internal_error"))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    finished = True
                    yield _sse(chunk(None, ev.finish_reason))
                    if include_usage:
                        usage = P.Usage.of(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens).model_dump()
                        yield _sse({**chunk(None, None), "choices": [], "usage": usage})
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:  # the client went away (or the server stops): free the slot
                self.engine.abort(req.id)

    async def completions(self, body: P.CompletionRequest, request: Request):
        body.check_supported()
        self.check_model(body.model)
        prompt = body.single_prompt()
        ids = await run_in_threadpool(self.encode, prompt)
        params = self.sampling(body, self.limit(len(ids), body.max_tokens, DEFAULT_COMPLETION_TOKENS))
        req, events = await self.submit(ids, params, body.stop_strings(), "prompt")
        rid, created, model = P.new_id("cmpl"), P.now(), self.model_name
        if body.stream:
            def chunk(text, reason):
                return {"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]}

            return StreamingResponse(self.stream(req, events, chunk, body.include_usage, None),
                                     media_type="text/event-stream")
        text, ev = await self.collect(request, req, events)
        return P.CompletionResponse(id=rid, created=created, model=model,
                                    choices=[P.CompletionChoice(text=text, finish_reason=ev.finish_reason)],
                                    usage=P.Usage.of(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens))

    async def chat_completions(self, body: P.ChatCompletionRequest, request: Request):
        body.check_supported()
        self.check_model(body.model)
        ids = await run_in_threadpool(self.render_chat, body)
        params = self.sampling(body, self.limit(len(ids), body.token_limit(), None))
        req, events = await self.submit(ids, params, body.stop_strings(), "messages")
        rid, created, model = P.new_id("chatcmpl"), P.now(), self.model_name
        if body.stream:
            def chunk(text, reason, role=None):
                delta = P.ChatDelta(role=role, content=text).model_dump(exclude_none=True)
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

            return StreamingResponse(self.stream(req, events, chunk, body.include_usage,
                                                 chunk("", None, "assistant")), media_type="text/event-stream")
        text, ev = await self.collect(request, req, events)
        return P.ChatCompletionResponse(id=rid, created=created, model=model,
                                        choices=[P.ChatChoice(message=P.ChatMessageOut(content=text),
                                                              finish_reason=ev.finish_reason)],
                                        usage=P.Usage.of(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens))


def create_app(engine: SlotEngine, tokenizer, *, model_name: str, api_key: str | None = None,
               chat_template: str | None = None, sampling_defaults: dict[str, Any] | None = None) -> FastAPI:
    """The application serving ``engine`` (started; stopped when the application shuts down).

    Args:
        tokenizer: the target's transformers tokenizer (prompts, chat template, detokenization).
        model_name: the name ``/v1/models`` lists and requests must use (or leave out).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        chat_template: a Jinja chat template used instead of the tokenizer's.
        sampling_defaults: ``temperature`` / ``top_k`` / ``top_p`` for requests that leave them out (e.g.
            :func:`diffspec_jax.stopping.generation_defaults`); otherwise the OpenAI defaults (temperature 1,
            top_p 1, no top-k).
    """
    api = _Api(engine, tokenizer, model_name, api_key, chat_template, sampling_defaults)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await run_in_threadpool(engine.stop)

    app = FastAPI(title="diffspec-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(P.APIError)
    async def _api_error(_request, exc: P.APIError):
        return api.answer_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        return api.answer_error(_validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return api.answer_error(P.APIError(exc.status_code, str(exc.detail), "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal_error(_request, exc: Exception):
        return api.answer_error(P.APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error"))

    async def authorized(request: Request) -> None:
        await api.authorized(request)

    v1 = [Depends(authorized)]

    @app.get("/health")
    async def health():
        return api.health()

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return api.models()

    @app.get("/metrics")
    async def metrics():
        return api.metrics()

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: P.CompletionRequest, request: Request):
        return await api.completions(body, request)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await api.chat_completions(body, request)

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def prometheus_text(m: dict[str, Any], http_errors: dict[int, int]) -> str:
    """The engine's metrics (:meth:`SlotEngine.metrics`) in the Prometheus text format."""
    def gauge(name, doc, value, labels=None):
        g = GaugeMetricFamily(f"diffspec_{name}", doc, labels=list(labels or {}))
        g.add_metric(list((labels or {}).values()), float(value))
        return g

    def counter(name, doc, value, labels=None):
        c = CounterMetricFamily(f"diffspec_{name}", doc, labels=list(labels or {}))
        c.add_metric(list((labels or {}).values()), float(value))
        return c

    t = lambda key: m.get(f"total_{key}", 0)  # noqa: E731
    policy = {"policy": m["policy"]}
    families = [
        gauge("requests_running", "requests holding a slot (prefilling or decoding)", m["requests_running"]),
        gauge("requests_waiting", "requests waiting for a slot", m["requests_waiting"]),
        gauge("cache_slots_used", "sequences decoded together now (prefilling or decoding)", m["slots_used"]),
        gauge("cache_slots_total", "sequences decoded together at most (max_num_seqs)", m["slots_total"]),
        gauge("kv_blocks_used", "pages of the K/V pool held by running requests", m["kv_blocks_used"]),
        gauge("kv_blocks_cached", "pages held by no request, kept for the prefix cache (the least recently used "
              "evicted first)", m["kv_blocks_cached"]),
        gauge("kv_blocks_total", "pages in the K/V pool", m["kv_blocks_total"]),
        counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache", m["prefix_cache_queries"]),
        counter("prefix_cache_hits", "prompt tokens served from the prefix cache (not prefilled)",
                m["prefix_cache_hits"]),
        counter("preemptions", "requests preempted (pages freed, recomputed later) when the pool ran short",
                t("preemptions")),
        counter("replayed_tokens", "tokens a preempted request re-emitted while it recomputed (not streamed again)",
                t("replayed_tokens")),
        counter("replay_mismatches", "replayed blocks that differed from what the request had streamed (0 unless a "
                "bug)", t("replay_mismatches")),
        gauge("generation_tokens_per_second", "generated tokens per second over the last 10 s", m["tokens_per_s"]),
        gauge("mean_acceptance_length", "tokens emitted per verification (accepted drafts + 1), since start",
              m["mean_acceptance_length"] or 0.0, policy),
        counter("prompt_tokens", "prompt tokens prefilled", t("prompt_tokens")),
        counter("generation_tokens", "tokens generated", t("generation_tokens")),
        counter("verification_cycles", "verifications (one per running request and cycle)", t("cycles"), policy),
        counter("accepted_draft_tokens", "accepted draft tokens", t("accepted"), policy),
        counter("retrievals", "DiffSpec retrievals (after prefill and during decoding)", t("retrievals"), policy),
        counter("retrieval_rank_mismatches", "retrievals whose tensor-parallel ranks selected different chunks "
                "(0 unless a bug)", t("retrieval_rank_mismatches"), policy),
        counter("device_blocks", "device-loop blocks dispatched", t("blocks")),
        counter("request_timeouts", "requests ended by the request timeout", t("timeouts")),
        counter("program_compiles", "engine programs compiled (warm-up included)", m["compiles"]),
        counter("xla_compiles", "XLA compilations in this process (warm-up included)", m["xla_compiles"]),
        counter("compile_seconds", "seconds spent compiling engine programs", m["compile_s"]),
        gauge("compiles_after_warmup", "engine programs compiled after warm-up (0 when nothing recompiles)",
              m["compiles_after_warmup"]),
        gauge("xla_compiles_after_warmup", "XLA compilations after warm-up", m["xla_compiles_after_warmup"]),
        counter("gc_full_collections", "full (generation 2) garbage collections after warm-up",
                m["gc_full_collections"]),
        counter("gc_pause_seconds", "seconds of garbage-collection pauses after warm-up (the GIL held)",
                m["gc_pause_s"]),
        gauge("gc_pause_seconds_max", "longest garbage-collection pause after warm-up", m["gc_pause_max_s"]),
        gauge("engine_healthy", "1 while the engine runs", 1.0 if m["healthy"] else 0.0),
    ]
    finished = CounterMetricFamily("diffspec_requests_finished", "finished requests by finish reason",
                                   labels=["finish_reason"])
    for reason in ("stop", "length", "abort"):
        finished.add_metric([reason], float(t(f"finished_{reason}")))
    finished.add_metric(["error"], float(t("failed")))
    rejected = CounterMetricFamily("diffspec_http_errors", "error responses by HTTP status", labels=["status"])
    for status, n in sorted(http_errors.items()):
        rejected.add_metric([str(status)], float(n))
    families += [finished, rejected]

    class _Snapshot:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot())
    return generate_latest(registry).decode()


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone away (the server's ``http.disconnect``; the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first(get, gone: asyncio.Future):
    """The result of awaiting ``get``, or ``None`` if ``gone`` finishes first."""
    task = asyncio.ensure_future(get)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    return None
