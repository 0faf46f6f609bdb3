"""``specrl draft``: build distillation data, train, evaluate and export draft models.

Subcommands::

    specrl draft data   --prompts FILE ...           # target continuations + top-k labels (resumable)
    specrl draft train  --prompts FILE ... --run R   # data (missing shards) then training (resumable)
    specrl draft eval   --run R | --draft DIR        # held-out top-1 / top-4 agreement per category
    specrl draft export --run R --out DIR            # draft.safetensors + card.json
    specrl draft head   --out DIR                    # a feature head on the data (the `feature` drafter)

Every stage continues where it stopped: run the same command again. Data lives in
``<cache>/drafttrain/<target>/data`` and runs in ``<cache>/drafttrain/<target>/runs/<R>``
(``<cache>`` = ``$SPECRL_CACHE_DIR`` or ``~/.cache/specrl``) unless ``--data-dir`` /
``--run-dir`` say otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specrl.errors import ConfigError


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 0,1") from e


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="target model (HF id in the local cache, directory, .gguf, 'default')")
    p.add_argument("--prompts", action="append", default=None,
                   help="prompt source (repeatable): 'builtin' or a Spec-Bench / MT-Bench style jsonl; default builtin")
    p.add_argument("--data-dir", type=Path, default=None, help="data cache (default: <cache>/drafttrain/<target>/data)")
    p.add_argument("--held-out", type=float, default=0.25, help="fraction of prompts per category never trained on")
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=192, help="continuation length per prompt")
    p.add_argument("--topk", type=int, default=32, help="target log-probs kept per position")
    p.add_argument("--gen-batch-size", type=int, default=32)
    p.add_argument("--token-budget", type=int, default=8192, help="rows x (prompt + new tokens) per generation batch")
    p.add_argument("--gen-dtype", default="bfloat16", help="target dtype for generating data")
    p.add_argument("--rounds", type=int, default=2, help="sampled rounds over the train prompts after the greedy one")
    p.add_argument("--samples", type=int, default=1,
                   help="continuations per prompt per generate call in sampled rounds (GPU: 8-16 fills the batch)")
    p.add_argument("--no-text", action="store_true",
                   help="skip the train-text stage (teacher-forced prompt text; `specrl draft head` never reads it)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]: where the target and student run")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default="default", help="run name (a directory under <cache>/drafttrain/<target>/runs)")
    p.add_argument("--run-dir", type=Path, default=None, help="explicit run directory (overrides --run)")


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="draft_command", metavar="SUBCOMMAND")
    d = sub.add_parser("data", help="generate distillation data (resumable)")
    _common(d)
    d.add_argument("--token-limit", type=int, default=None, help="stop after this many generated tokens")

    t = sub.add_parser("train", help="build missing data, then distill a draft (resumable)")
    _common(t)
    _run_args(t)
    t.add_argument("--skip-data", action="store_true", help="train on the shards already on disk")
    t.add_argument("--layers", type=_int_list, default=(0, 1), help="target layers copied into the student")
    t.add_argument("--shortlist", type=int, default=8192, help="output shortlist size (0 = full vocabulary)")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per optimizer step")
    t.add_argument("--train-tokens", type=int, default=1_000_000, help="labelled tokens in the whole schedule")
    t.add_argument("--hard-weight", type=float, default=0.2, help="weight of the CE on the target's argmax")
    t.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-minutes", type=float, default=None, help="stop this call after N minutes (resume later)")
    t.add_argument("--max-steps", type=int, default=None, help="stop this call after N steps (resume later)")
    t.add_argument("--export", type=Path, default=None, help="export the draft to this directory at the end")

    e = sub.add_parser("eval", help="held-out agreement of a run or an exported draft")
    _common(e)
    _run_args(e)
    e.add_argument("--draft", type=Path, default=None, help="exported draft directory (instead of --run)")
    e.add_argument("--shortlist", type=int, default=None, help="keep only the top-N ids of the run's shortlist")

    x = sub.add_parser("export", help="write a run's draft as safetensors + JSON card")
    _common(x)
    _run_args(x)
    x.add_argument("--out", type=Path, required=True, help="output directory")
    x.add_argument("--draft", type=Path, default=None,
                   help="re-export this exported draft (e.g. with a smaller --shortlist) instead of a run")
    x.add_argument("--shortlist", type=int, default=None, help="keep only the top-N ids of the run's shortlist")
    x.add_argument("--cpu-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype the draft runs in next to a float32 target on CPUs with fast bfloat16")

    h = sub.add_parser("head", help="train a feature head on the target's hidden states (the `feature` drafter)")
    _common(h)
    h.add_argument("--out", type=Path, required=True, help="output directory (head.safetensors + card.json)")
    h.add_argument("--kind", default="mlp", help="head kind: mlp (the engine's feature drafter) or eagle (benchmark only)")
    h.add_argument("--epochs", type=float, default=8.0)
    h.add_argument("--lr", type=float, default=1e-3)
    h.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per optimizer step")
    h.add_argument("--shortlist", type=int, default=8192, help="output shortlist size")
    h.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    h.add_argument("--unroll", type=int, default=1,
                   help="chained steps per position (2+: also train on the head's own predicted features)")
    h.add_argument("--unroll-weight", type=float, default=0.5, help="loss weight of each chained step after the first")
    h.add_argument("--seed", type=int, default=0)
    p.set_defaults(_draft_parser=p)


def _data_config(args: argparse.Namespace) -> Any:
    from specrl.drafttrain.data import DataConfig

    for src in args.prompts or ["builtin"]:
        if src != "builtin" and not Path(src).expanduser().is_file():
            raise ConfigError(f"--prompts {src!r} does not exist. Fix: pass an existing jsonl / text file or 'builtin'.")
    if not 1 <= args.samples <= args.gen_batch_size:
        raise ConfigError(f"--samples {args.samples} is invalid. Allowed: 1 (one continuation per prompt per sampled "
                          f"round) to --gen-batch-size ({args.gen_batch_size}): one call holds all of a prompt's samples.")
    if not 0.0 < args.held_out < 1.0:
        raise ConfigError(f"--held-out {args.held_out} is invalid. Allowed: 0 < x < 1, e.g. 0.25.")
    return DataConfig(
        sources=tuple(args.prompts or ["builtin"]), held_out=args.held_out, split_seed=args.split_seed,
        max_new_tokens=args.max_new_tokens, topk=args.topk, batch_size=args.gen_batch_size,
        token_budget=args.token_budget, dtype=args.gen_dtype, rounds=args.rounds, samples=args.samples,
        text=not args.no_text,
    )


def _dirs(args: argparse.Namespace, target_name: str) -> tuple[Path, Path | None]:
    from specrl.models import cache_root

    base = cache_root() / "drafttrain" / target_name.replace("/", "--")
    data = args.data_dir or base / "data"
    run = getattr(args, "run_dir", None) or (base / "runs" / args.run if hasattr(args, "run") else None)
    return Path(data), run


def _train_config(args: argparse.Namespace) -> Any:
    from specrl.drafttrain.train import TrainConfig

    return TrainConfig(layers=tuple(args.layers), shortlist=args.shortlist, lr=args.lr, batch_tokens=args.batch_tokens,
                       train_tokens=args.train_tokens, hard_weight=args.hard_weight, eval_every=args.eval_every,
                       seed=args.seed)


def _head_config(args: argparse.Namespace) -> Any:
    from specrl.drafttrain.feature import HeadConfig

    return HeadConfig(kind=args.kind, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                      shortlist=args.shortlist, eval_every=args.eval_every, unroll=args.unroll,
                      unroll_weight=args.unroll_weight, seed=args.seed)


def _load_target(args: argparse.Namespace, dtype: str) -> Any:
    from specrl.models import ModelPair

    return ModelPair.load(args.model, device=args.device, dtype=dtype)


def run(args: argparse.Namespace) -> int:
    import torch

    if not getattr(args, "draft_command", None):
        args._draft_parser.print_help()
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.no_progress
    cfg = _data_config(args)
    cmd = args.draft_command
    if cmd in ("data", "train") and not getattr(args, "skip_data", False):
        from specrl.drafttrain.data import build_data

        pair = _load_target(args, cfg.dtype)
        data_dir, _ = _dirs(args, pair.target_name)
        counts = build_data(pair, cfg, data_dir, getattr(args, "token_limit", None), progress)
        print(f"data in {data_dir}: {json.dumps(counts)}", file=sys.stderr)
        del pair
        if cmd == "data":
            return 0
    pair = _load_target(args, "float32")
    data_dir, run_dir = _dirs(args, pair.target_name)
    if cmd == "train":
        from specrl.drafttrain.train import Trainer

        trainer = Trainer(pair.target, data_dir, run_dir, _train_config(args), progress=progress,
                          log=lambda m: print(m, file=sys.stderr))
        secs = None if args.max_minutes is None else 60 * args.max_minutes
        res = trainer.run(max_steps=args.max_steps, max_seconds=secs)
        print(json.dumps({"run_dir": str(run_dir), "step": trainer.state["step"], "train_tokens": trainer.state["tokens"],
                          "alpha": res["alpha"], "alpha_top4": res["alpha_top4"]}))
        if args.export:
            from specrl.drafttrain.export import export_run

            export_run(pair, data_dir, run_dir, args.export)
        return 0
    if cmd == "eval":
        from specrl.drafttrain.export import evaluate_draft

        res = evaluate_draft(pair, data_dir, run_dir, args.draft, args.shortlist)
        print(json.dumps(res))
        return 0
    if cmd == "export":
        from specrl.drafttrain.export import export_draft, export_run

        if args.draft is not None:
            out = export_draft(pair.target, args.draft, args.out, args.shortlist)
        else:
            out = export_run(pair, data_dir, run_dir, args.out, args.cpu_dtype, args.shortlist)
        print(json.dumps({"exported": str(out)}))
        return 0
    if cmd == "head":
        from specrl.drafttrain.feature import head_from_data

        res = head_from_data(pair, data_dir, args.out, _head_config(args), progress=progress)
        print(json.dumps(res))
        return 0
    raise ConfigError(f"Unknown draft subcommand {cmd!r}. Fix: use one of data, train, eval, export, head.")
