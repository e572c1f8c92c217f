"""The chat page at `GET /` of the HTTP gateway (`enable_chat_ui`, on unless `mii serve --no-ui`): one
self-contained HTML file (`static/chat.html`, no build step) that talks to this server's own OpenAI API —
`/v1/models`, `/engine_plan` and streamed `/v1/chat/completions` — from the browser. The page is open without
the API key (it holds no secret; it asks for the key and sends it on every API call), and its Content-Security-Policy
lets it reach nothing but this server: no script, style, font or request from anywhere else, and no script but
its own (by hash) runs in it."""
from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from mii.serving.http import documented

UI_PATH = "/"


def content_security_policy(page: str) -> str:
    """Only the page's own inline scripts run (their sha256), it connects only to this server, and it loads
    nothing from anywhere."""
    scripts = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(code.encode()).digest()).decode()}'"
                       for code in re.findall(r"<script>(.*?)</script>", page, re.S))
    return (f"default-src 'none'; script-src {scripts}; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def chat_page() -> str:
    return resources.files("mii.serving").joinpath("static/chat.html").read_text(encoding="utf-8")


def add_routes(app: FastAPI) -> None:
    page = chat_page()  # read once: a broken install fails at start, not at the first visit
    headers = {"Content-Security-Policy": content_security_policy(page), "X-Content-Type-Options": "nosniff",
               "Cache-Control": "no-cache"}

    @app.get(UI_PATH, response_class=HTMLResponse, **documented(responses={
        200: {"content": {"text/html": {"schema": {"type": "string"}}},
              "description": "the chat page (open without the API key; it asks for it)"}}))
    async def chat_ui():
        return HTMLResponse(page, headers=headers)
