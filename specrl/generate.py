"""``specrl generate``: decode prompts with the engine and report per-prompt statistics."""

from __future__ import annotations

import argparse
import json
import sys
import time

from specrl.prompts import load_prompts


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model-pair options shared by every command that loads models."""
    p.add_argument("--model", default="default", help="target: HF id (local cache), directory, .gguf, or 'default'")
    p.add_argument("--draft", default=None, help="draft model for --drafter model (same tokenizer as the target)")
    p.add_argument("--drafter", default="ngram",
                   help="drafter name: ngram (default, no model), model (--draft) or feature (a feature head, --head)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--dtype", default="auto", help="float32 (CPU default), bfloat16 (CUDA default), float16")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--head", default=None,
                   help="feature head directory for --drafter feature (`specrl draft head`; default: the shipped head)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompts", default=None, help="jsonl (Spec-Bench 'turns') or text file, or 'builtin'")
    p.add_argument("--category", action="append", default=None, help="keep prompts of this category (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="use at most this many prompts")
    p.add_argument("--policy", default=None,
                   help="choose (k, w) every step with a policy: controller:DIR (exported), goodput, hf-heuristic, ...")
    p.add_argument("--k", type=int, default=4, help="speculation length (tree depth); 0 = plain decoding")
    p.add_argument("--w", type=int, default=1, help="tree width; 1 = chain")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded concurrently")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")


def run(args: argparse.Namespace) -> int:
    from specrl.drafters import make_drafter
    from specrl.engine import Action, SpecEngine
    from specrl.errors import ConfigError
    from specrl.models import ModelPair
    from specrl.sampling import SamplingParams

    texts = [(t, "cli") for t in args.prompt]
    if args.prompts:
        texts += [(p.text, p.category) for p in load_prompts(args.prompts, args.category, args.limit)]
    if not texts:
        raise ConfigError("No prompts given. Fix: pass --prompt TEXT (repeatable) or --prompts FILE.")
    if args.limit is not None:
        texts = texts[: args.limit]
    action = Action(args.k, args.w)
    sampling = SamplingParams(args.temperature, args.top_p)
    draft = args.draft
    if args.head is not None and args.drafter != "feature":
        raise ConfigError(f"--head {args.head} is a feature head, but --drafter is {args.drafter!r}. "
                          "Fix: add --drafter feature, or drop --head.")
    if args.drafter == "model" and draft is None:
        raise ConfigError("--drafter model needs --draft PATH (a causal LM with the target's tokenizer).")
    pair = ModelPair.load(args.model, draft if args.drafter == "model" else None, args.device, args.dtype)
    ids = [pair.encode_prompt(t, chat=False if args.no_chat else None) for t, _ in texts]
    drafter = make_drafter("feature", pair, head=args.head) if args.drafter == "feature" else args.drafter
    engine = SpecEngine(pair, drafter=drafter, sampling=sampling, seed=args.seed)
    controller = None
    if args.policy:
        from specrl.policies import make_policy
        from specrl.runtime.adapters import EngineController

        controller = EngineController(engine, make_policy(args.policy, _policy_context(args, pair)))
    t0 = time.perf_counter()
    done = engine.generate(ids, args.max_new_tokens, action=controller or action, batch_size=args.batch_size)
    wall = time.perf_counter() - t0
    total = 0
    for i, ((text, cat), r) in enumerate(zip(texts, done)):
        out = r.output.tolist()
        total += len(out)
        rec = {
            "prompt_index": i,
            "category": cat,
            "tokens": out,
            "text": pair.decode(out),
            "steps": r.steps,
            "mean_accept_length": r.accepted / max(1, r.steps),
            "seconds": (r.t_done or r.t_join) - r.t_join,
            "finish_reason": r.finish_reason,
        }
        if args.json:
            print(json.dumps(rec, ensure_ascii=False), flush=True)
        else:
            print(f"--- prompt {i} [{cat}] ---\n{text}\n--- completion ({len(out)} tokens, {r.steps} steps, "
                  f"mean accept length {rec['mean_accept_length']:.2f}) ---\n{rec['text']}\n")
    if not args.json:
        how = f"policy {args.policy}" if args.policy else f"k={args.k} w={args.w}"
        print(f"{total} tokens in {wall:.2f} s ({total / wall:.1f} tokens/s), {how}, drafter={args.drafter}",
              file=sys.stderr)
    if controller is not None and not args.json:
        from collections import Counter

        common = Counter(controller.decisions).most_common(4)
        print("policy decisions (k, w): " + ", ".join(f"{a} x{n}" for a, n in common), file=sys.stderr)
    return 0


def _policy_context(args: argparse.Namespace, pair: object) -> object:
    """Action tables and, if profiled, the cost model for rules that need one (goodput)."""
    from specrl.envs.config import load_cost_model, load_env_config
    from specrl.policies import PolicyContext

    cfg = load_env_config({"model": args.model, "draft": args.draft, "drafter": args.drafter, "dtype": args.dtype,
                           "device": args.device})
    try:
        cost = load_cost_model(cfg)
    except Exception:  # noqa: BLE001 - rules that need it say so when built
        cost = None
    return PolicyContext(cfg.k_choices, cfg.w_choices, cost, args.drafter)
