"""The server as a new user meets it (issue 39): ``python -m diffspec_jax.serve`` with no arguments answers
docs/serving.md's curl and openai examples as written (chat included: the demo pair's chat template), and shuts
down in two steps on SIGINT; the chat template is checked at start; the CPU defaults; the shutdown's timer.

One server process serves the one test that needs it (it is shut down at the end of that test)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import subprocess_xla_flags

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "serving.md"
#: the address the examples name (the no-argument server's)
DOC_ADDRESS = "127.0.0.1:8000"


def _examples() -> tuple[str, str]:
    """docs/serving.md's curl example (a bash block) and its openai example (the python block that imports
    OpenAI), as written there."""
    blocks = re.findall(r"```(\w+)\n(.*?)```", DOCS.read_text(), flags=re.S)
    curl = [code for lang, code in blocks if lang == "bash" and code.lstrip().startswith("curl ")]
    py = [code for lang, code in blocks if lang == "python" and "from openai import OpenAI" in code]
    assert len(curl) == 1 and len(py) == 1, (len(curl), len(py))
    return curl[0], py[0]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_healthy(proc, url: str, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up: {log.read_text()[-3000:]}")
        time.sleep(0.5)


def _running(url: str) -> tuple[int, int]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    get = lambda name: int(float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)))  # noqa: E731
    return get("diffspec_requests_running"), get("diffspec_requests_waiting")


def test_no_argument_server_runs_the_docs_examples_and_shuts_down_in_two_steps(tmp_path):
    """``python -m diffspec_jax.serve`` (no arguments: the demo pair, the CPU defaults) answers docs/serving.md's
    curl example (streamed completion) and its openai example (a completion and a streamed chat, through the demo
    pair's chat template) run verbatim. (Should another process hold port 8000, the server gets a free port and
    the examples' address is rewritten to it: nothing else changes.) Then the shutdown: a streaming request runs
    and another waits for the one slot; the first SIGINT says it is finishing 2 requests, new connections are
    refused while the stream goes on; the second SIGINT ends both with finish_reason "abort" and the process
    exits 0 without a traceback."""
    curl, py = _examples()
    args, address = [], DOC_ADDRESS
    if not _port_free(8000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args, address = ["--port", str(port)], f"127.0.0.1:{port}"
        curl, py = curl.replace(DOC_ADDRESS, address), py.replace(DOC_ADDRESS, address)
    url = f"http://{address}"
    log = tmp_path / "server.log"
    env = dict(os.environ, JAX_PLATFORMS="cpu", DIFFSPEC_COMPILATION_CACHE="0",
               XLA_FLAGS=subprocess_xla_flags())
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "diffspec_jax.serve", *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, url, log)
        started = log.read_text()
        assert "up to 1 sequences decoded together, max_model_len 384" in started, started
        assert "on a CPU the defaults are --max-num-seqs 1 --max-model-len 384" in started, started
        # the curl example: a streamed completion
        r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        events = [x for x in r.stdout.splitlines() if x]
        assert r.returncode == 0 and events[-1] == "data: [DONE]", (r.returncode, r.stdout, r.stderr)
        chunks = [json.loads(x.removeprefix("data: ")) for x in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] \
            == "length"
        # the openai example: a completion, then a streamed chat printed as it comes
        printed, scope = io.StringIO(), {}
        with contextlib.redirect_stdout(printed):
            exec(compile(py, str(DOCS), "exec"), scope)
        assert scope["out"].choices[0].finish_reason == "length" and scope["out"].usage.completion_tokens == 32
        assert printed.getvalue().strip(), "the streamed chat printed nothing"

        # shutdown: one stream decoding, one request waiting for the slot
        body = {"prompt": "def main():", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/completions",
                                                            json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            waiting = {}
            waiter = threading.Thread(target=lambda: waiting.update(httpx.post(
                f"{url}/v1/completions", json={**body, "max_tokens": 8}, timeout=120).json()))
            waiter.start()
            deadline = time.monotonic() + 30
            while _running(url) != (1, 1):
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 10
            while "finishing" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            assert re.search(r"SIGINT: not accepting new requests; finishing 2 requests \(Ctrl-C again to abort\)",
                             log.read_text()), log.read_text()
            refused = False
            while not refused and time.monotonic() < deadline:
                try:
                    httpx.get(f"{url}/health", timeout=2)
                    time.sleep(0.05)
                except httpx.ConnectError:
                    refused = True
            assert refused, "the server still accepted connections after SIGINT"
            got = [x for x in (next(lines) for _ in range(3)) if x]  # the stream goes on
            assert got and proc.poll() is None
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rest = [x for x in lines if x]
            took = time.monotonic() - t0
        waiter.join(30)
        assert rest[-1] == "data: [DONE]" and took < 5, (rest[-3:], took)
        last = json.loads(rest[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort"
        streamed = sum(1 for x in got + rest[:-2] if x.startswith("data: "))
        assert streamed < 300  # it was cut short
        assert waiting["choices"][0]["finish_reason"] == "abort", waiting
        assert proc.wait(15) == 0
        text = log.read_text()
        assert "aborting 2 requests on the second SIGINT" in text and "Traceback" not in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


# ------------------------------------------------------------------------------------------ in process
@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    from diffspec_jax import demo

    return AutoTokenizer.from_pretrained(demo.target_dir())


def test_chat_template_is_rendered_at_start_and_a_failure_is_named(demo_tokenizer, tmp_path, monkeypatch, capsys):
    """The demo pair's shipped template (the build's, byte for byte) renders the sample conversation; a broken
    template, one that raises, and a missing jinja2 are ConfigErrors naming the cause, and the server refuses to
    start with exit status 2 and one line, before it loads the models."""
    from diffspec_jax import demo, serve
    from diffspec_jax.demo.build import CHAT_TEMPLATE
    from diffspec_jax.errors import ConfigError
    from diffspec_jax.serving.app import SAMPLE_CHAT, check_chat_template

    assert (demo.target_dir() / "chat_template.jinja").read_text() == CHAT_TEMPLATE == demo_tokenizer.chat_template
    assert check_chat_template(demo_tokenizer, None, "the tokenizer's") == f"# user: {SAMPLE_CHAT[0]['content']}\n"
    bare = type("Bare", (), {"chat_template": None})()
    assert check_chat_template(bare, None, "the tokenizer's") is None
    for template, words in [("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
                            ("{{ raise_exception('system messages only') }}", "system messages only")]:
        with pytest.raises(ConfigError, match="cannot render a sample conversation") as err:
            check_chat_template(demo_tokenizer, template, "--chat-template t.jinja")
        assert words in str(err.value) and "--chat-template t.jinja" in str(err.value)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}")
    assert serve.main(["--chat-template", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot render a sample conversation" in err and str(broken) in err and len(err.splitlines()) == 1, err
    monkeypatch.setitem(sys.modules, "jinja2", None)  # not installed
    with pytest.raises(ConfigError, match=r"needs jinja2, which is not installed: pip install 'diffspec-jax\[serve\]'"):
        check_chat_template(demo_tokenizer, None, "the tokenizer's")


def test_cpu_defaults():
    from diffspec_jax.serve import CPU_MAX_MODEL_LEN, CPU_MAX_NUM_SEQS, engine_sizes

    seqs, length, note = engine_sizes(None, None, "cpu")
    assert (seqs, length) == (CPU_MAX_NUM_SEQS, CPU_MAX_MODEL_LEN) and "--max-num-seqs" in note
    assert engine_sizes(4, 2048, "cpu") == (4, 2048, "")
    assert engine_sizes(None, None, "gpu") == (8, None, "")
    assert engine_sizes(None, 4096, "cpu")[:2] == (CPU_MAX_NUM_SEQS, 4096)
    assert engine_sizes(0, 0, "cpu")[:2] == (0, 0)  # given, so refused by EngineConfig, not replaced


def test_shutdown_timer_aborts_what_is_left(capsys):
    """The first signal lets requests run until --shutdown-timeout, then aborts them; a second one aborts at once;
    a third exits. (The engine here only counts what the server asks of it; the real sequence runs above.)"""
    import uvicorn

    from diffspec_jax.serving.limits import GracefulServer

    class Engine:
        aborts = 0

        def metrics(self):
            return {"requests_running": 1, "requests_waiting": 2}

        def abort_all(self):
            self.aborts += 1

    async def scenario(timeout, signals):
        engine = Engine()
        server = GracefulServer(uvicorn.Config(app=None, log_config=None), engine, timeout)
        server._loop = asyncio.get_running_loop()
        seen = []
        for sig in signals:
            server.handle_exit(sig, None)
            await asyncio.sleep(0.05)
            seen.append((engine.aborts, server.should_exit, server.force_exit))
        await asyncio.sleep(timeout + 0.1)
        seen.append((engine.aborts, server.should_exit, server.force_exit))
        return seen

    assert asyncio.run(scenario(0.3, [signal.SIGTERM])) == [(0, True, False), (1, True, False)]
    err = capsys.readouterr().err
    assert "SIGTERM: not accepting new requests; finishing 3 requests (Ctrl-C again to abort)" in err
    assert "aborting 3 requests after 0.3 s (--shutdown-timeout)" in err
    assert asyncio.run(scenario(0.3, [signal.SIGINT, signal.SIGINT, signal.SIGINT])) == [
        (0, True, False), (1, True, False), (1, True, True), (1, True, True)]  # (the timer aborts nothing twice)
    assert "aborting 3 requests on the second SIGINT" in capsys.readouterr().err
