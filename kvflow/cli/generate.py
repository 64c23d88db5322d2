"""`kvflow generate` (one prompt, tokens streamed to stdout) and `kvflow chat` (interactive)."""

from __future__ import annotations

import argparse
import sys
import time

from kvflow.cli.args import model_arg, number


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_arg, default=None,
                   help="GGUF file or HF-style checkpoint dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX), else float32")
    p.add_argument("--device", default="cpu", help="torch device the model runs on")
    p.add_argument("--threads", type=number(int, 1), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--prefix-caching", "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   dest="enable_prefix_caching", help="reuse the KV of earlier turns' tokens")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                   help="batch-invariant kernels: the same tokens whatever else is batched (off: the fastest "
                        "kernel per batch shape)")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=number(int, 1), default=max_tokens, help="most tokens to generate")
    p.add_argument("--temperature", type=number(float, 0), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=number(int, 0), default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=number(float, 0, 1, low_open=True), default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches p (1: all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    p.add_argument("--stop-token-id", type=number(int, 0), action="append", default=[], dest="stop_token_ids",
                   help="token id that ends the reply, beside the model's EOS (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token, up to --max-tokens")


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate a reply to one prompt, streaming tokens as they come")
    g.add_argument("prompt", help="the prompt (a user message unless --raw)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template; use the prompt as raw text")
    g.add_argument("--system", default=None, help="system message (chat template only; default: none)")
    g.add_argument("--stats", action="store_true", help="print load time, TTFT and tokens/s to stderr")
    _add_model_args(g)
    _add_sampling_args(g, 256)
    g.set_defaults(func=run_generate)

    c = sub.add_parser("chat", help="interactive chat with the model (Ctrl-D or /exit to quit, /reset to clear)")
    c.add_argument("--system", default=None, help="system message (default: none)")
    _add_model_args(c)
    _add_sampling_args(c, 512)
    c.set_defaults(func=run_chat)


def _params(args):
    from kvflow.sched.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
    )


def _load(args):
    params = _params(args)  # validate flags before the (slow) model load
    from kvflow.config import resolve_dtype
    from kvflow.engine.llm import LLM

    dtype, why = resolve_dtype(args.dtype, args.device)
    print(f"[kvflow] dtype {dtype} ({why})", file=sys.stderr)
    print(f"[kvflow] loading {args.model or 'the default model'} (weights, kernels, timing the projection paths)",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=dtype, device=args.device, num_threads=args.threads,
              enable_prefix_caching=args.enable_prefix_caching, deterministic=args.deterministic)
    return llm, params, time.perf_counter() - t0


def _stream(llm, prompt, params, chat: bool) -> tuple[float | None, int, str | None]:
    t0 = time.perf_counter()
    ttft = None
    n = 0
    reason = None
    for out in llm.stream(prompt, params, chat=chat):
        if out.new_token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        n += len(out.new_token_ids)
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        reason = out.finish_reason
    sys.stdout.write("\n")
    return ttft, n, reason


def run_generate(args) -> int:
    if args.raw and args.system:
        raise ValueError("--system needs the chat template (drop --raw)")
    llm, params, load_s = _load(args)
    if args.raw:
        prompt, chat = args.prompt, False
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]
        chat = True
    t0 = time.perf_counter()
    ttft, n, reason = _stream(llm, prompt, params, chat)
    if args.stats:
        dt = time.perf_counter() - t0
        ck = llm.engine.checkpoint
        how = "converted from GGUF" if ck.converted else "cached"
        print(
            f"[kvflow] load {load_s:.2f}s (weights {ck.load_seconds:.2f}s, {how}); "
            f"TTFT {ttft or 0:.3f}s; {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s); finish: {reason}",
            file=sys.stderr,
        )
    return 0


def run_chat(args) -> int:
    llm, params, load_s = _load(args)
    print(f"[kvflow] {llm.engine.model.cfg.name} loaded in {load_s:.1f}s. /reset clears the history, /exit quits.", file=sys.stderr)
    history = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": text})
        try:
            reply = []
            for out in llm.stream(history, params, chat=True):
                reply.append(out.new_text)
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": "".join(reply)})
        except ValueError as e:  # e.g. the conversation outgrew the context
            history.pop()
            print(f"error: {e}", file=sys.stderr)
