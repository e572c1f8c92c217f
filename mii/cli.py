"""The `mii` command line: `mii generate [MODEL] "prompt"`, `mii serve [MODEL]`, `mii explain [MODEL]`."""
from __future__ import annotations

import argparse
import logging
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (auto: bfloat16 where the CPU/GPU has fast bf16, else float32)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (GPU N)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8"],
                   help="the KV cache's dtype (auto: bfloat16 where the weights are bf16 under fp32 math, else the "
                        "compute dtype)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the model over N processes (gloo on CPU, NCCL on GPU)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weight-only int8/int4 linears on CPU (auto: a GGUF keeps its own quantization, a float "
                        "checkpoint none; none: every weight in the model's dtype)")
    p.add_argument("--quantize-activations", action="store_true",
                   help="int4 linears multiply inputs rounded to int8 (llama.cpp's Q8 activations): faster decode, "
                        "outputs close but not identical")
    p.add_argument("--quantization-group", type=int, default=None, metavar="G",
                   help="input features per scale (a multiple of 32; default 64 for int4, per channel for int8)")


def _model_kwargs(args) -> dict:
    return dict(dtype=args.dtype, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
                tensor_parallel=args.tensor_parallel,
                quantization=args.quantization, quantization_group=args.quantization_group,
                quantize_activations=args.quantize_activations)


def _split_model_prompt(values: list[str]) -> tuple[str | None, str]:
    if len(values) == 1:
        return None, values[0]
    if len(values) == 2:
        return values[0], values[1]
    raise SystemExit("usage: mii generate [MODEL] PROMPT")


def cmd_generate(args) -> int:
    import mii
    from mii.children import freeze_heap

    model, prompt = _split_model_prompt(args.args)
    pipe = mii.pipeline(model, **_model_kwargs(args))
    freeze_heap()  # this process exits with the pipeline: its exit skips ~0.5 s of collections
    if not args.raw and getattr(pipe.tokenizer, "chat_template", None):
        prompt = pipe.apply_chat_template([{"role": "user", "content": prompt}])
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                  temperature=args.temperature or None, top_p=args.top_p, seed=args.seed)
    for chunk in pipe.stream(prompt, **kwargs):
        sys.stdout.write(chunk.generated_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


class _NotThePlan(logging.Filter):
    """Drops the engine's log record of its plan: `mii explain` prints the plan as its output, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        from mii.engine.engine import PLAN_LOG

        return record.msg != PLAN_LOG


def cmd_explain(args) -> int:
    import mii

    log, drop = logging.getLogger("mii"), _NotThePlan()
    log.addFilter(drop)
    try:
        pipe = mii.pipeline(args.model, **_model_kwargs(args))
    finally:
        log.removeFilter(drop)
    print(pipe.engine_plan.describe())
    return 0


def _api_key(args):
    """The key of --api-key, or the first line of --api-key-file (which keeps it out of the process list)."""
    if args.api_key_file is None:
        return args.api_key
    from pathlib import Path

    try:
        key = Path(args.api_key_file).read_text().strip()
    except OSError as e:
        raise SystemExit(f"mii serve: --api-key-file: {e.strerror}: {args.api_key_file}")
    if not key:
        raise SystemExit(f"mii serve: --api-key-file: {args.api_key_file} is empty")
    return key


def cmd_serve(args) -> int:
    from mii.serving import deployment
    from mii.serving.launch import build_mii_config

    kwargs = dict(**_model_kwargs(args), replica_num=args.replicas, port_number=args.grpc_port,
                  enable_restful_api=True, restful_api_host=args.host, restful_api_port=args.port,
                  grpc_host=args.grpc_host, metrics_need_key=args.metrics_need_key, enable_chat_ui=not args.no_ui,
                  max_waiting_requests=args.max_waiting, api_key=_api_key(args), request_timeout=args.request_timeout,
                  drain_timeout=args.drain_timeout, enable_prefix_caching=not args.no_prefix_caching)
    if args.deployment_name:
        kwargs["deployment_name"] = args.deployment_name
    if args.max_request_bytes is not None:
        kwargs["max_request_bytes"] = args.max_request_bytes
    if args.stream_interval_ms is not None:
        kwargs["stream_interval_ms"] = args.stream_interval_ms
    state_manager = {}
    if args.max_context:
        state_manager["max_context"] = args.max_context
    if args.max_batch_tokens is not None:
        state_manager["max_ragged_batch_size"] = args.max_batch_tokens
    if args.itl_target_ms is not None:
        state_manager["itl_target_ms"] = args.itl_target_ms
    if state_manager:
        kwargs["inference_engine_config"] = {"state_manager": state_manager}
    if args.num_threads:
        kwargs["num_threads"] = args.num_threads
    if args.ray is not None:
        kwargs.update(cluster="ray", ray_address=args.ray or None)
    kwargs.update(tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    cfg = build_mii_config(args.model, **kwargs)
    logging.getLogger("mii").setLevel(logging.WARNING if args.quiet else logging.INFO)

    def announce(line: str) -> None:
        base = f"http://{deployment.connect_host(args.host)}:{args.port}"
        page = "" if args.no_ui else f"Chat:  open {base}/ in a browser\n"
        print(f"{line}\n{page}Try:  curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
              "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"stream\": true}'\n"
              "Stop with Ctrl-C.", flush=True)

    deployment.run(cfg, announce)
    return 0


def cmd_scale(args) -> int:
    import mii

    client = mii.client(args.deployment, api_key=_api_key(args))
    serving = client.scale(args.replicas)
    print(f"mii: deployment {client.deployment_name!r} has {args.replicas} replica(s), {serving} serving")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mii", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fast LLM text generation (DeepSpeed-MII's API) on CPUs and GPUs.\n"
                    "MODEL is a Hugging Face folder, a hub id in the local cache or a .gguf file; with no MODEL, "
                    "the embedded\nSmolLM2-135M-Instruct is used.",
        epilog="examples:\n"
               "  mii generate \"What is the capital of France? Answer in one sentence.\"\n"
               "  mii serve                                  # OpenAI API + REST on :8000, gRPC on :50050\n"
               "  mii serve ./my-model --port 8080 --replicas 2 --api-key secret\n"
               "  mii scale my-model-mii-deployment 3        # replicas of a running deployment\n"
               "  mii serve ./my-model --ray auto --grpc-host 0.0.0.0 --api-key secret   # on a Ray cluster\n"
               "  mii explain ./my-model                     # what the engine chose and why\n\n"
               "`mii COMMAND --help` describes each command.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout",
                       description="mii generate [MODEL] PROMPT  — MODEL is a folder, a cached hub id or a .gguf file. "
                       "The prompt is wrapped in the model's chat template unless --raw.")
    g.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_model_args(g)
    g.set_defaults(func=cmd_generate)
    v = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible API, MII's REST gateway) and gRPC",
                       description="mii serve [MODEL]  — runs a deployment in the foreground: the OpenAI-compatible API "
                       "(/v1/completions, /v1/chat/completions, /v1/models), MII's REST gateway (/mii/NAME), /health, "
                       "/metrics and /tokenize on --port, MII's gRPC service on --grpc-port (for mii.client(NAME)), "
                       "and one engine process per replica. Ctrl-C or SIGTERM stops it with all its processes.")
    v.add_argument("model", nargs="?", default=None, metavar="MODEL")
    v.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP API binds (default: 127.0.0.1, this host only; 0.0.0.0 for every interface: "
                        "then set --api-key)")
    v.add_argument("--port", type=int, default=8000, help="HTTP port: OpenAI API and REST gateway (default: 8000)")
    v.add_argument("--grpc-port", type=int, default=50050, help="gRPC port of MII's service (default: 50050)")
    v.add_argument("--grpc-host", default="127.0.0.1",
                   help="address the gRPC service binds (default: 127.0.0.1; it also carries Terminate)")
    v.add_argument("--replicas", type=int, default=1, help="engine processes; CPU threads are divided between them")
    v.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="place the replicas on a Ray cluster (pip install 'mii[ray]'): 'auto' joins the one running "
                        "on this host, HOST:PORT the one at that address; no ADDRESS starts one of this host alone")
    v.add_argument("--deployment-name", default=None,
                   help="name for mii.client(NAME) and /mii/NAME (default: <model basename>-mii-deployment)")
    key = v.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every HTTP route but /health and /metrics, and as "
                          "gRPC metadata on every call but the health service (mii.client(NAME, api_key=KEY))")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="read the API key from this file (other users of the host can see --api-key in the "
                          "process list)")
    v.add_argument("--metrics-need-key", action="store_true", help="require the API key on /metrics too")
    v.add_argument("--no-ui", action="store_true", help="no chat page at / (then / is a 404)")
    v.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt in full (by default the KV of a prefix already computed for an earlier "
                        "request, e.g. a shared system prompt, is reused)")
    v.add_argument("--max-request-bytes", type=int, default=None, metavar="BYTES",
                   help="largest request body (HTTP 413 beyond) or gRPC message accepted (default: 4 MiB)")
    v.add_argument("--max-waiting", type=int, default=None,
                   help="requests an engine may queue before refusing new ones with 429 (default: unbounded)")
    v.add_argument("--stream-interval-ms", type=float, default=None, metavar="MS",
                   help="a stream's chunks at most this often per request, the tokens between joined (default: 20; "
                        "0: a chunk every engine step)")
    v.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort a request not finished after this long: 504 / DEADLINE_EXCEEDED (default: no limit)")
    v.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, time requests in flight get to finish while new ones get 503; a second "
                        "signal stops at once (default: 30)")
    v.add_argument("--max-context", type=int, default=None, help="longest sequence accepted (default: the model's)")
    v.add_argument("--max-batch-tokens", type=int, default=None, metavar="N",
                   help="tokens one step may carry, prompt chunks and decode tokens together (MII's "
                        "max_ragged_batch_size): smaller holds running streams less behind a long prompt, larger "
                        "fills the machine (default: the engine plan's, from a matmul probe on CPU)")
    v.add_argument("--itl-target-ms", type=float, default=None, metavar="MS",
                   help="inter-token latency to keep running streams within: prompt chunks beside them are cut to "
                        "what fits (default: none, chunks fill the token budget)")
    v.add_argument("--num-threads", type=int, default=None, help="CPU threads per engine process (default: cores / (replicas x tensor-parallel ranks))")
    v.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", "hermes", "llama3_json", "mistral"],
                   help="format of the model's tool calls for tool_choice=auto (default: auto, from the chat template)")
    v.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", "think", "deepseek_r1", "qwen3"],
                   help="split <think>...</think> into reasoning_content (default: auto, on when the chat template "
                        "handles </think>)")
    v.add_argument("--quiet", action="store_true", help="log warnings only")
    _add_model_args(v)
    v.set_defaults(func=cmd_serve)
    s = sub.add_parser("scale", help="change the number of replicas of a running deployment",
                       description="mii scale NAME N  — N replicas for the deployment NAME (mii.client(NAME).scale(N)): "
                       "new ones enter rotation once loaded; removed ones finish their requests first.")
    s.add_argument("deployment", metavar="NAME")
    s.add_argument("replicas", type=int, metavar="N")
    key = s.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help="the deployment's API key, if it has one")
    key.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from this file")
    s.set_defaults(func=cmd_scale)
    e = sub.add_parser("explain", help="print the engine plan (dtype, threads, KV cache, budget) for a model")
    e.add_argument("model", nargs="?", default=None)
    _add_model_args(e)
    e.set_defaults(func=cmd_explain)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mii.errors import MIIError

    try:
        return args.func(args)
    except MIIError as e:
        print(f"mii: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
