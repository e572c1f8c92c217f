"""The `mii` command line: `mii generate [MODEL] "prompt"`, `mii explain [MODEL]`."""
from __future__ import annotations

import argparse
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (auto: bfloat16 where the CPU/GPU has fast bf16, else float32)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])


def _split_model_prompt(values: list[str]) -> tuple[str | None, str]:
    if len(values) == 1:
        return None, values[0]
    if len(values) == 2:
        return values[0], values[1]
    raise SystemExit("usage: mii generate [MODEL] PROMPT")


def cmd_generate(args) -> int:
    import mii

    model, prompt = _split_model_prompt(args.args)
    pipe = mii.pipeline(model, dtype=args.dtype, device=args.device)
    if not args.raw and getattr(pipe.tokenizer, "chat_template", None):
        prompt = pipe.apply_chat_template([{"role": "user", "content": prompt}])
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                  temperature=args.temperature or None, top_p=args.top_p, seed=args.seed)
    for chunk in pipe.stream(prompt, **kwargs):
        sys.stdout.write(chunk.generated_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_explain(args) -> int:
    import mii

    pipe = mii.pipeline(args.model, dtype=args.dtype, device=args.device)
    print(pipe.engine_plan.describe())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mii", description="Fast LLM text generation (DeepSpeed-MII's API) on CPUs and GPUs. "
                                     "With no MODEL, the embedded SmolLM2-135M-Instruct is used.")
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
