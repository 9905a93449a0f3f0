"""twotower pretrain: MLM (+ optional NSP) pretraining from scratch under a token or wall-clock budget.

Example:
    twotower pretrain --corpus train.txt.gz --valid valid.txt.gz --tokenizer tok/ --out runs/mini \\
        --size mini --budget 30m
    torchrun --nproc_per_node 2 -m twotower pretrain ...   # the same command, data-parallel
"""

from __future__ import annotations

import argparse

from twotower.cli.help_format import DefaultsHelpFormatter


def register(subparsers) -> None:
    p = subparsers.add_parser("pretrain", help="MLM-pretrain a BERT encoder from scratch",
                              description=__doc__.splitlines()[0],
                              formatter_class=DefaultsHelpFormatter)
    p.add_argument("--corpus", nargs="+", required=True, metavar="FILE", help=".txt, .txt.gz or .jsonl files")
    p.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="tokenizer directory (`twotower tokenizer train`'s, or a checkpoint's own)")
    p.add_argument("--out", required=True, metavar="DIR", help="the run directory, which is also the checkpoint")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--size", choices=["tiny", "mini", "small", "base"], default="mini",
                      help="architecture preset of a new model")
    size.add_argument("--config", metavar="JSON", help="an EncoderConfig / BertConfig JSON instead of --size")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", metavar="TIME", help="wall-clock budget, e.g. 30m, 2h, 1h30m")
    budget.add_argument("--tokens", metavar="N", help="token budget, e.g. 20M")
    budget.add_argument("--steps", type=int, metavar="N", help="optimizer-step budget")
    size.add_argument("--init-from", metavar="DIR",
                   help="start from this checkpoint's weights and architecture (continued / domain-adaptive "
                        "pretraining on new text; pass its tokenizer too); optimizer and schedule start fresh")
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the earlier pretraining run --out holds (a directory of other files is never replaced)")
    p.add_argument("--valid", nargs="+", default=[], metavar="FILE", help="validation files (separate text)")
    p.add_argument("--valid-rows", type=int, default=512, help="rows of the fixed validation set")
    p.add_argument("--seq-len", type=int, default=128, metavar="TOKENS", help="tokens per training row")
    p.add_argument("--batch-size", type=int, default=64, help="rows per micro-batch per process")
    p.add_argument("--grad-accum", type=int, default=1, metavar="N", help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=float, default=0.06, help="warmup fraction of the budget")
    p.add_argument("--decay", choices=["linear", "cosine", "constant"], default="linear",
                   help="learning-rate schedule after warmup, ending with the budget")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    p.add_argument("--dropout", type=float, default=None, help="override the config's dropout probabilities")
    p.add_argument("--wwm", action="store_true", help="whole-word masking")
    p.add_argument("--nsp", action="store_true", help="add next-sentence prediction (sentence-pair rows)")
    # each pair below: the second replaced the first without a word, so they are exclusive
    masks = p.add_mutually_exclusive_group()
    masks.add_argument("--mask-rate", type=float, default=0.15, help="fraction of each row's tokens masked as targets")
    masks.add_argument("--num-masks", type=int, default=None, metavar="N",
                       help="exactly N targets per row (static shapes)")
    p.add_argument("--static-masks", type=int, default=0, metavar="COPIES",
                   help="static masking with COPIES fixed masks per row (default: dynamic)")
    evals = p.add_mutually_exclusive_group()
    evals.add_argument("--evals", type=int, default=10,
                       help="validations spread evenly over the budget, besides the one at the end")
    evals.add_argument("--eval-every-steps", type=int, default=None, metavar="N",
                       help="validate every N optimizer steps instead of --evals")
    ckpts = p.add_mutually_exclusive_group()
    ckpts.add_argument("--ckpt-every-minutes", type=float, default=10.0, metavar="MINUTES",
                       help="minutes of training between checkpoints (0: every step)")
    ckpts.add_argument("--ckpt-every-steps", type=int, default=None, metavar="N",
                       help="checkpoint every N optimizer steps instead of --ckpt-every-minutes")
    p.add_argument("--log-every", type=int, default=10, metavar="N", help="optimizer steps between log lines")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="stop after N optimizer steps, the schedule unchanged (--resume goes on)")
    p.add_argument("--seed", type=int, default=0, help="seed of a new model's weights, the row order and the masks")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--no-bf16", action="store_true", help="never use bf16 autocast")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--cache-dir", default=None, help="tokenized-corpus cache (default ~/.cache/twotower/tokens)")
    p.add_argument("--dump-replicas", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run, torchrun=True)


def run(args: argparse.Namespace) -> int:
    import json
    import os
    import time

    from twotower.cli import CLIError, resumable
    from twotower.common.paths import working_directory_refusal
    from twotower.encoder.pretraining.pretrain import resume_dir

    # --overwrite swaps the new run in for it whole (a resumed one too, when built in OUT.unfinished); a run
    # resumed in its own directory replaces nothing
    if (not args.resume or resume_dir(args.out) != args.out) and (problem := working_directory_refusal(
            args.out, f"--out {args.out}", "a run", "--out run", overwrite=True)):
        raise CLIError(problem)
    from twotower.encoder.pretraining.pretrain import (
        FIRST_SAVE,
        RUN_FILE,
        STATE_DIR,
        PretrainArgs,
        pretrain,
        run_dir,
        saved_step,
    )

    pargs = PretrainArgs(
        corpus=args.corpus, tokenizer=args.tokenizer, out=args.out, size=args.size, config=args.config, init_from=args.init_from,
        budget=args.budget, tokens=args.tokens, steps=args.steps, seq_len=args.seq_len,
        batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup,
        decay=args.decay, weight_decay=args.weight_decay, clip=args.clip, dropout=args.dropout, wwm=args.wwm,
        nsp=args.nsp, mask_rate=args.mask_rate, num_masks=args.num_masks, static_masks=args.static_masks,
        valid=args.valid, valid_rows=args.valid_rows, evals=args.evals, eval_every_steps=args.eval_every_steps,
        ckpt_every_minutes=args.ckpt_every_minutes, ckpt_every_steps=args.ckpt_every_steps,
        log_every=args.log_every, max_steps=args.max_steps, bf16=False if args.no_bf16 else "auto",
        device=args.device, seed=args.seed, resume=args.resume, overwrite=args.overwrite,
        progress=not args.no_progress, cache_dir=args.cache_dir, dump_replicas=args.dump_replicas,
    )
    started = time.time()

    def saved_at() -> str | None:
        """The step --resume would continue from, looked up when Ctrl-C comes: where the run saves its state
        (--out, or OUT.unfinished for one replacing an earlier run) is known only once it has started. A new
        run's state must be its own: until it starts, OUT.unfinished may still hold a stopped run's."""
        work = resume_dir(args.out) if args.resume else run_dir(pargs)
        state = os.path.join(work, STATE_DIR, "state.json")
        if not args.resume and (not os.path.isfile(state) or os.path.getmtime(state) < started):
            return None
        step = saved_step(work)
        return None if step is None else f"step {step}"

    summary = resumable(args, lambda: pretrain(pargs), saved_at,
                        lambda: os.path.isfile(os.path.join(args.out, RUN_FILE)), first_save=FIRST_SAVE)
    print(json.dumps(summary, indent=2))  # the result, as `train` prints it: --no-progress turns off bars, not this
    return 0
