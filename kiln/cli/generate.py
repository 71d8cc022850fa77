"""kiln generate: text from a prompt (or a chat message) with a Llama-architecture model."""

from __future__ import annotations

import sys
import time

from kiln.cli.llm_args import add_engine_args, engine_config

NAME = "generate"
HELP = "generate text from a prompt with an LLM (GGUF or Hugging Face directory)"


def add_arguments(p):
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def main(args) -> int:
    from kiln.llm import SamplingParams
    from kiln.llm.engine import LLMEngine

    engine = LLMEngine(args.model, engine_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
               for p in args.prompt]
    reqs = [engine.add_request(p, params) for p in prompts]
    single = len(reqs) == 1
    texts = {r.request_id: [] for r in reqs}
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            n += len(out.new_token_ids)
            if single:  # stream one prompt as it comes
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            texts[out.request_id].append(out.new_text)
    dt = time.perf_counter() - t0
    if single:
        print()
    else:
        for i, r in enumerate(reqs):
            print(f"--- [{i}] {args.prompt[i]!r}\n{''.join(texts[r.request_id])}")
    print(f"[{n} tokens in {dt:.2f} s, {n / dt:.1f} tokens/s]", file=sys.stderr)
    return 0
