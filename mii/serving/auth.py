"""Who may use a deployment: the API key, checked the same way on HTTP (`Authorization: Bearer <key>`, the
gateway's `mii.serving.http.HTTPKeyCheck`) and on gRPC (the same header as call metadata, `GRPCKeyCheck`, on the
front process and on every replica, whose loopback ports anyone on this host can reach), compared in constant
time; and the warnings for a deployment that listens beyond this host without one.

Open without the key: HTTP `/health` (and `/metrics` unless `metrics_need_key`), gRPC's `grpc.health.v1`.
"""
from __future__ import annotations

import hmac
import ipaddress
from typing import Optional

import grpc

AUTH_HEADER = "authorization"
HEALTH_SERVICE = "/grpc.health.v1.Health/"


def key_matches(header: Optional[bytes], key: bytes) -> bool:
    """Whether an `Authorization` value is `Bearer <key>` (the comparison takes the same time whatever matches)."""
    scheme, _, token = (header or b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


class GRPCKeyCheck(grpc.aio.ServerInterceptor):
    """The API key on every gRPC method but `grpc.health.v1`: metadata `authorization: Bearer <key>` (what
    `mii.client` sends); others are refused with UNAUTHENTICATED before the method runs."""

    def __init__(self, api_key: str):
        self.key = api_key.encode()

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "invalid or missing API key (send metadata 'authorization: Bearer <key>')")

        self._refused = {
            (False, False): grpc.unary_unary_rpc_method_handler(refuse),
            (False, True): grpc.unary_stream_rpc_method_handler(refuse),
        }

    async def intercept_service(self, continuation, details):
        if details.method.startswith(HEALTH_SERVICE):
            return await continuation(details)
        given = next((v for k, v in details.invocation_metadata or () if k == AUTH_HEADER), "")
        if key_matches(given.encode() if isinstance(given, str) else given, self.key):
            return await continuation(details)
        handler = await continuation(details)  # only to answer with the method's own kind (unary or stream)
        kind = (bool(handler and handler.request_streaming), bool(handler and handler.response_streaming))
        return self._refused.get(kind, self._refused[(False, False)])


def call_metadata(api_key: Optional[str]) -> tuple:
    """The gRPC call metadata that carries an API key (none without one)."""
    return ((AUTH_HEADER, f"Bearer {api_key}"),) if api_key else ()


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def exposure_warnings(http_host: Optional[str], grpc_host: str, api_key: Optional[str]) -> list[str]:
    """What a deployment bound so exposes to other hosts without an API key (one line each; none when safe)."""
    if api_key:
        return []
    out = []
    if http_host is not None and not is_loopback(http_host):
        out.append(f"the HTTP API listens on {http_host} without an API key: anyone who reaches it can generate "
                   "(set --api-key / api_key)")
    if not is_loopback(grpc_host):
        out.append(f"the gRPC service listens on {grpc_host} without an API key: anyone who reaches it can generate "
                   "or stop the deployment (Terminate) (set --api-key / api_key)")
    return out
