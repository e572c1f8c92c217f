"""The chat page at `/` in a real browser: Playwright drives the system's headless chromium against real
deployments of the tiny model — a streamed reply that is the server's own answer, a conversation kept across
turns, a reply stopped mid-way (the server aborts it: nothing left running), model output shown as text, the
engine plan, and a deployment behind an API key (`mii serve --api-key`) where the page asks for the key, keeps it
for the tab and works after a reload. Without chromium (Debian: `apt-get install chromium`; `.ci/run` installs
it) these tests skip, saying so."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from mii.serving import records
from tests.serving.conftest import LONG_CONTEXT, end_serve, free_port, metric, stop, unique_name, wait_until

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (Debian: apt-get install "
                                                         "chromium; .ci/run installs it): the chat page is not tested")
KEY = "page-key-7"
# the rate only when the tokens came over time: a short reply from a fast server can arrive in one read (CI on
# 2e7a290 showed "12 tokens · first token 91 ms · stopped at max tokens")
STATS = re.compile(r"^(\d+) tokens · (?:([\d.]+) tok/s · )?first token (\d+) ms · (done|stopped at max tokens|stopped)$")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert not errors, errors  # no exception in the page's script


def _chat_requests(page) -> list:
    """The bodies and headers of the page's /v1/chat/completions requests, as they are sent."""
    sent = []
    page.on("request", lambda r: sent.append((json.loads(r.post_data), r.headers))
            if r.url.endswith("/v1/chat/completions") else None)
    return sent


def _ask(page, text: str, n: int) -> tuple[str, str, str]:
    """Type `text`, send it with Enter, wait for the n-th reply: (its text, its stats line, how it ended)."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    reply = page.locator(".msg.assistant").nth(n - 1)
    page.wait_for_function("n => document.querySelectorAll('.msg.assistant[data-done]').length >= n", arg=n)
    return (reply.locator(".content").text_content(), reply.locator(".stats").text_content(),
            reply.get_attribute("data-done"))


def test_chat_streams_the_servers_answer_and_keeps_the_conversation(page, base_url, deployment, tiny_model):
    sent = _chat_requests(page)
    page.goto(f"{base_url}/")
    page.wait_for_function("() => document.getElementById('status').textContent === 'ready'")
    assert tiny_model in page.text_content("#model")

    # the engine plan, as each replica reported it; the KV cache size agrees with /metrics
    plans = httpx.get(f"{base_url}/engine_plan", timeout=30).json()
    assert [r["replica"] for r in plans["replicas"]] == [0, 1] and plans["deployment"] == deployment.deployment_name
    assert {r["replica"]: r["pid"] for r in plans["replicas"]} == {r["index"]: r["pid"]
                                                                   for r in deployment.record["replicas"]}
    plan = plans["replicas"][0]["plan"]
    assert (plan["device"], plan["dtype"], plan["kv_block_size"], plan["max_context"]) == ("cpu", "float32", 16, 1024)
    blocks = metric(httpx.get(f"{base_url}/metrics", timeout=30).text, "mii_kv_cache_blocks_total")
    assert blocks == sum(r["plan"]["kv_num_blocks"] for r in plans["replicas"]) == 2 * 512
    page.wait_for_function("() => document.getElementById('plan-text').textContent.includes('kv_blocks')")
    assert page.text_content("#plan-text") == "\n\n".join(
        f"replica {r['replica']}\n{r['plan']['text']}" for r in plans["replicas"])
    rows = page.eval_on_selector_all("#plan-table tr", "rows => rows.map(r => [r.cells[0].textContent, "
                                     "r.cells[1].textContent, r.cells[1].title])")
    rows = {name: (value, why) for name, value, why in rows}
    assert rows["device"] == ("cpu", plan["reasons"]["device"]) and rows["dtype"][0] == "float32"
    assert rows["KV cache"][0] == f"512 blocks of 16 tokens, {plan['kv_cache_bytes'] / 2**20:.0f} MiB"
    assert rows["max context"][0] == "1024 tokens"

    page.fill("#system", "You are terse.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "12")
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    history = [{"role": "system", "content": "You are terse."}]
    for turn, question in enumerate(["What is the capital of France?", "And of Italy?"], start=1):
        text, stats, done = _ask(page, question, turn)
        history.append({"role": "user", "content": question})
        # what the page sent: the whole conversation, streamed, with the settings of the side panel
        body, headers = sent[-1]
        assert body["messages"] == history and body["stream"] is True and "authorization" not in headers
        assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0, 0.95, 12)
        # and what it shows is the server's own (greedy) answer to that conversation
        ref = oai.chat.completions.create(model=tiny_model, messages=history, temperature=0, max_tokens=12)
        assert text == ref.choices[0].message.content and text
        m = STATS.match(stats)
        assert m, stats
        assert int(m[1]) == ref.usage.completion_tokens and (m[2] is None or float(m[2]) > 0) and int(m[3]) > 0
        assert done == ref.choices[0].finish_reason
        assert m[4] == {"length": "stopped at max tokens", "stop": "done"}[done]
        history.append({"role": "assistant", "content": text})
    page.click("#clear")
    assert page.locator(".msg").count() == 0


@pytest.fixture(scope="module")
def long_url(long_model):
    """One replica of the tiny model with its whole 131,072-token context: a reply of the rest of the context runs
    for a minute or more (the session deployment's 512-token context ended in ~0.5 s, sometimes before Stop was
    clicked)."""
    import mii

    client = mii.serve(long_model, deployment_name=unique_name("test-page-long"), port_number=free_port(),
                       enable_restful_api=True, restful_api_port=free_port(), dtype="float32",
                       inference_engine_config={"state_manager": {"max_context": LONG_CONTEXT}})
    yield f"http://127.0.0.1:{client.record['http_port']}"
    stop(client)


def test_stop_aborts_the_request_on_the_server(page, long_url):
    base_url = long_url

    def server(name: str) -> float:
        return metric(httpx.get(f"{base_url}/metrics", timeout=30).text, name)

    page.goto(f"{base_url}/")
    page.wait_for_function("() => document.getElementById('status').textContent === 'ready'")
    page.fill("#temperature", "0")  # greedy: this reply is the same every time, and long
    page.fill("#max-tokens", "")  # OpenAI's default: the rest of the context (~131,000 tokens)
    finished, generated = server("mii_requests_total"), server("mii_generation_tokens_total")
    page.fill("#prompt", "Tell me a long story.")
    page.press("#prompt", "Enter")
    # the reply appears while it is generated, and the server is running it
    page.wait_for_function("() => (document.querySelector('.msg.assistant .content')?.textContent || '').length > 20")
    assert server("mii_num_requests_running") == 1
    # one call (Playwright's own click waits for the page, which is busy with the stream on a loaded machine)
    shown = page.evaluate("() => { const shown = [!$('stop').hidden, !$('send').hidden]; $('stop').click(); "
                          "return shown; }")
    assert shown == [True, False], page.text_content(".msg.assistant .stats")  # Stop instead of Send while busy
    page.wait_for_selector(".msg.assistant[data-done]")
    stats = page.text_content(".msg.assistant .stats")
    assert page.get_attribute(".msg.assistant", "data-done") == "stopped", stats
    assert stats.startswith("~") and stats.endswith(" · stopped"), stats
    assert page.is_visible("#send") and not page.is_visible("#stop")
    # the server aborted it: nothing running, its KV blocks freed, and it never finished
    assert wait_until(lambda: server("mii_num_requests_running") == 0 and server("mii_kv_cache_blocks_used") == 0)
    time.sleep(0.5)
    assert server("mii_requests_total") == finished
    assert 0 < server("mii_generation_tokens_total") - generated < LONG_CONTEXT - 100  # (the rest of the context)
    # the page goes on: a stopped reply is part of the conversation
    page.fill("#max-tokens", "3")
    assert _ask(page, "Go on.", 2)[2] in ("length", "stop")


def test_model_output_is_shown_as_text(page, base_url):
    """A reply full of HTML (the server's answer replaced in the browser) is shown as those characters."""
    evil = '<img src=x onerror="window.pwned=1"><b>bold</b><script>window.pwned=2</script>'
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": evil}, "finish_reason": "stop"}]}
    body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    page.goto(f"{base_url}/")
    page.wait_for_function("() => document.getElementById('status').textContent === 'ready'")
    text, _, _ = _ask(page, "<i>hi</i>", 1)
    assert text == evil and page.text_content(".msg.user .content") == "<i>hi</i>"
    assert page.locator("#messages img, #messages b, #messages i, #messages script").count() == 0
    assert page.evaluate("window.pwned") is None


def test_errors_are_shown_and_the_conversation_goes_on(page, base_url):
    sent = _chat_requests(page)
    page.goto(f"{base_url}/")
    page.wait_for_function("() => document.getElementById('status').textContent === 'ready'")
    page.fill("#temperature", "5")  # the server's 400 names the field
    text, stats, done = _ask(page, "Hello", 1)
    assert (text, done) == ("", "error") and stats.startswith("error: temperature: ")
    assert "less than or equal to 2" in stats
    assert page.text_content("#status") == "error"
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "3")
    second = _ask(page, "Hi", 2)
    assert second[2] in ("length", "stop"), second
    assert sent[-1][0]["messages"] == [{"role": "user", "content": "Hi"}]  # the refused question is not in it
    # an error event inside the stream (after the 200) ends the reply with the server's message
    events = [{"choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": None}]},
              {"error": {"message": "replica 0 went away", "type": "service_unavailable", "param": None,
                         "code": "unavailable"}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    text, stats, done = _ask(page, "More", 3)
    assert (text, done) == ("partial", "error") and stats.endswith("error: replica 0 went away")


@pytest.fixture(scope="module")
def keyed_cli(tiny_model, tmp_path_factory):
    """`mii serve` (the command) on the tiny model, one replica, behind an API key read from a file."""
    folder = tmp_path_factory.mktemp("keyed-cli")
    (folder / "key").write_text(KEY)
    port, name = free_port(), unique_name("test-chat-ui")
    log = open(folder / "serve.log", "w+")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mii"), "serve", tiny_model, "--port", str(port),
                             "--grpc-port", str(free_port()), "--deployment-name", name, "--api-key-file",
                             str(folder / "key"), "--dtype", "float32", "--num-threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, (folder / "serve.log").read_text()[-3000:]
        try:
            return httpx.get(f"{base}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        assert wait_until(up, timeout=180, interval=0.2)
        yield base
    finally:
        try:
            end_serve(proc, [r["pid"] for r in (records.read(name) or {}).get("replicas", [])])
        finally:
            log.close()
            records.log_path(name).unlink(missing_ok=True)


def test_with_an_api_key_the_page_asks_for_it(page, keyed_cli):
    assert httpx.get(f"{keyed_cli}/v1/models", timeout=30).status_code == 401
    r = httpx.get(f"{keyed_cli}/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")  # the page itself is open
    # nothing from elsewhere, and no script but the page's own (its hash) runs in it
    csp = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
    assert re.fullmatch(r"'sha256-[A-Za-z0-9+/=]{44}'", csp["script-src"])
    sent = _chat_requests(page)
    page.goto(f"{keyed_cli}/")
    page.wait_for_selector("#key-overlay:not([hidden])")
    assert page.is_disabled("#prompt")
    page.fill("#api-key", "wrong")
    page.click("#key-submit")
    page.wait_for_function("() => document.getElementById('key-error').textContent.includes('refused')")
    page.fill("#api-key", KEY)
    page.click("#key-submit")
    page.wait_for_function("() => document.getElementById('status').textContent === 'ready'")
    assert page.is_hidden("#key-overlay")
    page.fill("#max-tokens", "4")
    assert _ask(page, "Hello", 1)[2] in ("length", "stop")
    assert sent[-1][1]["authorization"] == f"Bearer {KEY}"
    page.wait_for_function("() => document.getElementById('plan-text').textContent.includes('replica 0')")
    # a reload keeps the key for this tab: no question, it works at once
    page.reload()
    page.wait_for_function("() => document.getElementById('status').textContent === 'ready'")
    assert page.is_hidden("#key-overlay")
    page.fill("#max-tokens", "4")
    assert _ask(page, "Hello again", 1)[2] in ("length", "stop")
    assert sent[-1][1]["authorization"] == f"Bearer {KEY}"
