"""Persistent deployments (`mii.serve`, `mii.client`, `mii serve`): a set of processes on this host. Each replica
is an engine process (`replica.py`) whose engine loop runs in its own thread and which serves MII's gRPC service
(`proto/modelresponse.proto`, codecs in `protocol.py`); a front process (`deployment.py`) runs the load balancer
(`balancer.py`: least outstanding requests, dead replicas out of rotation) as the same gRPC service on
`port_number` and, when asked, the HTTP gateway (`gateway.py`, FastAPI: MII's REST route, the OpenAI-compatible
API in `openai_api.py` on the shared HTTP helpers of `http.py`, bodies documented in `schemas.py`, tool calling
and reasoning on chat in `chat_tools.py` with the answer parsers of `tool_parsers.py` and `reasoning.py`, health,
Prometheus `metrics.py`, tokenize, each replica's engine plan, and the chat page of `ui.py` at `/`) in the same
event loop; `auth.py` checks the API key on both protocols. A small record per
deployment (`records.py`) lets `MIIClient` (`client.py`) find it from any process; `launch.py` starts one.
"""
from mii.serving.client import MIIClient, client
from mii.serving.launch import serve

__all__ = ["MIIClient", "client", "serve"]
