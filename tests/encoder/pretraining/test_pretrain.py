"""`twotower pretrain` end to end: HF-loadable checkpoints, refusal rules, exact resume after SIGKILL, DDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.common.out_fixtures import adding_a_file
from tests.encoder import pretrain_fixtures as fx
from twotower.cli import main
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.pretraining.mlm import BertForPreTraining

tiny_tokenizer, tiny_tokenizer_dir = fx.tiny_tokenizer, fx.tiny_tokenizer_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture()
def setup(tmp_path, tiny_tokenizer):
    corpus = fx.write_corpus(str(tmp_path), n_docs=12)
    valid = fx.write_corpus(str(tmp_path), name="valid.txt", n_docs=3, seed=7)
    cfg = EncoderConfig(vocab_size=tiny_tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=37, max_position_embeddings=64)
    cfg_path = str(tmp_path / "cfg.json")
    cfg.save(cfg_path)
    return {"corpus": corpus, "valid": valid, "config": cfg_path, "tmp": tmp_path}


def _args(s, tok_dir, out, *extra):
    return ["pretrain", "--corpus", s["corpus"], "--tokenizer", tok_dir, "--out", out, "--config", s["config"],
            "--seq-len", "32", "--batch-size", "4", "--no-progress", "--no-bf16", "--log-every", "1",
            "--cache-dir", str(s["tmp"] / "cache"), *extra]


def _train_losses(out: str) -> dict[int, float]:
    with open(os.path.join(out, "log.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["loss"] for r in recs if r["type"] == "train"}


def test_cli_trains_and_transformers_loads_the_checkpoint(setup, tiny_tokenizer_dir):
    out = str(setup["tmp"] / "run")
    rc = main(_args(setup, tiny_tokenizer_dir, out, "--steps", "12", "--valid", setup["valid"], "--evals", "3",
                    "--lr", "3e-3"))
    assert rc == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt", "log.jsonl", "curve.png",
                 "summary.json", "trainer_state/optimizer.safetensors", "trainer_state/state.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    losses = _train_losses(out)
    assert sorted(losses) == list(range(1, 13))
    assert losses[12] < losses[1]  # it learns
    with open(os.path.join(out, "log.jsonl"), encoding="utf-8") as f:
        valid = [json.loads(x) for x in f if '"valid"' in x]
    assert len(valid) >= 3 and all(v["perplexity"] > 1 for v in valid)
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["architectures"] == ["BertForMaskedLM"]

    transformers = pytest.importorskip("transformers")
    hf = transformers.BertForMaskedLM.from_pretrained(out).eval()
    from twotower.encoder.core.checkpoint import read_weights

    ours = BertForPreTraining(EncoderConfig.load(os.path.join(out, "config.json"))).eval()
    ours.load_state_dict(read_weights(out))
    ids = torch.randint(5, 300, (3, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, labels).logits, hf(input_ids=ids).logits.reshape(-1, 300),
                                   atol=1e-4, rtol=1e-4)


def test_output_dir_rules_and_config_mismatch(setup, tiny_tokenizer_dir, capsys):
    out = str(setup["tmp"] / "run")
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "2")) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2  # the result is printed with --no-progress too
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "2")) == 2
    assert "holds another training run" in capsys.readouterr().err
    # resuming with another config names the differing fields
    other = EncoderConfig.load(setup["config"])
    other.num_hidden_layers, other.intermediate_size = 3, 40
    other_path = str(setup["tmp"] / "other.json")
    other.save(other_path)
    args = _args(setup, tiny_tokenizer_dir, out, "--steps", "2", "--resume")
    args[args.index("--config") + 1] = other_path
    assert main(args) == 2
    err = capsys.readouterr().err
    # named by the flag the user typed, the differing fields after it
    assert f"--config {other_path} (the run: --config {setup['config']}; the architectures differ in " in err
    assert "intermediate_size" in err and "num_hidden_layers" in err
    part = str(setup["tmp"] / "part")  # a run stopped early (--max-steps) continues to its budget
    assert main(_args(setup, tiny_tokenizer_dir, part, "--steps", "4", "--max-steps", "2")) == 0
    assert main(_args(setup, tiny_tokenizer_dir, part, "--steps", "4", "--resume")) == 0  # same settings: fine
    assert max(_train_losses(part)) == 4
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "2", "--overwrite")) == 0
    assert max(_train_losses(out)) == 2
    os.makedirs(setup["tmp"] / "fresh")
    assert main(_args(setup, tiny_tokenizer_dir, str(setup["tmp"] / "fresh"), "--steps", "2", "--resume")) == 2
    assert "no training state" in capsys.readouterr().err
    (setup["tmp"] / "notes.txt").write_text("mine\n")  # a file at --out was a FileExistsError traceback
    assert main(_args(setup, tiny_tokenizer_dir, str(setup["tmp"] / "notes.txt"), "--steps", "2")) == 2
    assert "notes.txt: a file; give a directory" in capsys.readouterr().err
    assert (setup["tmp"] / "notes.txt").read_text() == "mine\n"


def test_bad_inputs(setup, tiny_tokenizer_dir, capsys, tmp_path):
    out = str(tmp_path / "x")
    args = _args(setup, tiny_tokenizer_dir, out, "--steps", "2")
    args[args.index("--corpus") + 1] = str(tmp_path / "missing.txt")
    assert main(args) == 2
    assert "missing.txt" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    args[args.index("--corpus") + 1] = str(tmp_path / "empty.txt")
    assert main(args) == 2
    assert "empty.txt is empty" in capsys.readouterr().err
    (tmp_path / "small.txt").write_text("abc def\n")
    args[args.index("--corpus") + 1] = str(tmp_path / "small.txt")
    assert main(args) == 2
    assert "fewer than one row" in capsys.readouterr().err
    # a tokenizer without [MASK]
    bad = tmp_path / "badtok"
    bad.mkdir()
    tj = json.load(open(os.path.join(tiny_tokenizer_dir, "tokenizer.json"), encoding="utf-8"))
    tj["model"]["vocab"].pop("[MASK]")
    tj["added_tokens"] = [t for t in tj.get("added_tokens", []) if t["content"] != "[MASK]"]
    (bad / "tokenizer.json").write_text(json.dumps(tj))
    assert main(_args(setup, str(bad), str(tmp_path / "y"), "--steps", "2")) == 2
    assert "[MASK]" in capsys.readouterr().err
    assert main(_args(setup, tiny_tokenizer_dir, str(tmp_path / "z"), "--tokens", "lots")) == 2
    assert "--tokens: cannot parse 'lots' as a count" in capsys.readouterr().err  # the flag named
    assert main(_args(setup, tiny_tokenizer_dir, str(tmp_path / "z"), "--tokens", "0.5")) == 2  # it ran a step
    assert "--tokens 0.5: give at least 1 token" in capsys.readouterr().err
    # rows longer than the config's 64 positions: named by the flag ("seq_len 65 exceeds max_position_embeddings")
    assert main(_args(setup, tiny_tokenizer_dir, str(tmp_path / "w"), "--steps", "2", "--seq-len", "65")) == 2
    assert "seq_len=65: the model reads at most 64 positions (--seq-len)" in capsys.readouterr().err


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": REPO}


def test_resume_after_sigkill_gives_the_same_next_20_losses(setup, tiny_tokenizer_dir):
    budget = ["--steps", "400", "--ckpt-every-steps", "5", "--dropout", "0.1"]
    cmd = [sys.executable, "-m", "twotower"]
    ref = str(setup["tmp"] / "ref")
    subprocess.run(cmd + _args(setup, tiny_tokenizer_dir, ref, *budget, "--max-steps", "50"),
                   check=True, env=_env(), cwd=REPO, timeout=120)
    killed = str(setup["tmp"] / "killed")
    proc = subprocess.Popen(cmd + _args(setup, tiny_tokenizer_dir, killed, *budget), env=_env(), cwd=REPO)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            steps = _train_losses(killed) if os.path.isfile(os.path.join(killed, "log.jsonl")) else {}
            if steps and max(steps) >= 12:
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    with open(os.path.join(killed, "trainer_state", "state.json"), encoding="utf-8") as f:
        saved_step = json.load(f)["user"]["step"]
    assert 10 <= saved_step <= 30 and saved_step % 5 == 0
    subprocess.run(cmd + _args(setup, tiny_tokenizer_dir, killed, *budget, "--max-steps", "50", "--resume"),
                   check=True, env=_env(), cwd=REPO, timeout=120)
    want, got = _train_losses(ref), _train_losses(killed)
    nxt = list(range(saved_step + 1, saved_step + 21))
    assert [got[s] for s in nxt] == [want[s] for s in nxt]  # bit-identical on CPU
    assert len({want[s] for s in nxt}) > 10  # the losses really move (dropout and data differ per step)


def test_torchrun_two_processes_keep_replicas_identical(setup, tiny_tokenizer_dir):
    from safetensors import safe_open
    from safetensors.torch import load_file

    dump = str(setup["tmp"] / "replicas")
    out = str(setup["tmp"] / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "twotower", *_args(setup, tiny_tokenizer_dir, out, "--steps", "4", "--grad-accum", "2",
                                     "--dump-replicas", dump)]
    r = subprocess.run(cmd, env=_env(), cwd=REPO, timeout=120, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(os.path.join(dump, "rank0.safetensors"))
    b = load_file(os.path.join(dump, "rank1.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(0)
    init = BertForPreTraining(EncoderConfig.load(setup["config"])).state_dict()
    assert not torch.equal(init["bert.encoder.layer.0.attention.self.query.weight"],
                           a["bert.encoder.layer.0.attention.self.query.weight"])
    rows = [json.loads(safe_open(os.path.join(dump, f"rank{i}.safetensors"), "pt").metadata()["first_rows"])
            for i in (0, 1)]
    assert not set(rows[0]) & set(rows[1])  # each rank read its own shard
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["world_size"] == 2 and summary["tokens"] == 4 * 2 * 2 * 4 * 32  # steps*accum*world*rows*T


def test_nsp_and_whole_word_masking_train_and_load_as_bert_for_pretraining(setup, tiny_tokenizer_dir):
    out = str(setup["tmp"] / "nsp")
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "3", "--nsp", "--wwm", "--static-masks", "2")) == 0
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["architectures"] == ["BertForPreTraining"]
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertForPreTraining.from_pretrained(out)
    from twotower.encoder.core.checkpoint import read_weights

    state = read_weights(out)
    assert "cls.seq_relationship.weight" in state and "bert.pooler.dense.weight" in state
    torch.testing.assert_close(hf.cls.seq_relationship.weight.detach(), state["cls.seq_relationship.weight"])


def test_every_all_reduce_names_the_device_it_computes_on(setup, tiny_tokenizer_dir, monkeypatch):
    """Under NCCL a collective refuses CPU tensors: each of pretraining's sums must be made on the training
    device, so none may fall back on all_reduce_sum's CPU default (seen here as a device left out)."""
    from twotower.encoder.pretraining import pretrain

    devices = []

    def recording(values, info, device=None):
        devices.append(device)
        return list(values)

    monkeypatch.setattr(pretrain, "all_reduce_sum", recording)
    out = str(setup["tmp"] / "run")
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "2", "--valid", setup["valid"], "--evals", "1",
                      "--device", "cpu")) == 0
    assert len(devices) >= 3 and all(d is not None and torch.device(d) == torch.device("cpu") for d in devices)


def test_init_from_continues_from_a_checkpoints_weights(setup, tiny_tokenizer_dir, capsys):
    """--init-from: a new run (fresh optimizer and schedule) that starts from another run's weights."""
    from twotower.encoder.core.checkpoint import read_weights

    first = str(setup["tmp"] / "first")
    assert main(_args(setup, tiny_tokenizer_dir, first, "--steps", "3", "--lr", "3e-3")) == 0
    second = str(setup["tmp"] / "second")
    base = [a for a in _args(setup, tiny_tokenizer_dir, second, "--steps", "1", "--lr", "0")]
    i = base.index("--config")
    del base[i:i + 2]  # the architecture comes from the checkpoint
    assert main([*base, "--init-from", first]) == 0
    # lr 0 for the single step: the saved weights are exactly the initial ones
    w1, w2 = read_weights(first), read_weights(second)
    assert set(w1) == set(w2)
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    with open(os.path.join(second, "run.json"), encoding="utf-8") as f:
        assert json.load(f)["args"]["init_from"] == first
    # errors name the problem: --config together with --init-from, a directory without a checkpoint
    with pytest.raises(SystemExit):  # argparse: the two are exclusive, as --size and --config are
        main([*base, "--init-from", first, "--overwrite", "--config", setup["config"]])
    assert "argument --config: not allowed with argument --init-from" in capsys.readouterr().err
    assert main([*base, "--init-from", str(setup["tmp"]), "--overwrite"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_init_from_a_bare_encoder_starts_a_fresh_head(setup, tiny_tokenizer_dir):
    from twotower.encoder.core.checkpoint import read_weights, save_encoder
    from twotower.encoder.core.model import BertModel
    from twotower.encoder.core.tokenizer import Tokenizer

    torch.manual_seed(5)
    enc = BertModel(EncoderConfig.load(setup["config"]))  # with a pooler, which MLM does not use
    src = str(setup["tmp"] / "encoder")
    save_encoder(enc, Tokenizer.from_pretrained(tiny_tokenizer_dir), src)
    out = str(setup["tmp"] / "mlm")
    args = _args(setup, tiny_tokenizer_dir, out, "--steps", "1", "--lr", "0")
    i = args.index("--config")
    del args[i:i + 2]
    assert main([*args, "--init-from", src]) == 0
    w = read_weights(out)
    assert torch.equal(w["bert.encoder.layer.1.output.dense.weight"], enc.encoder.layer[1].output.dense.weight)
    assert "cls.predictions.bias" in w and not any(k.startswith("bert.pooler") for k in w)


@pytest.mark.parametrize("field, value, message", [
    ("log_every", 0, "log_every=0: give 1 or more (--log-every)"),  # a ZeroDivisionError at the first step
    ("lr", -1.0, "lr=-1.0: give a learning rate >= 0 (--lr)"),  # torch's "Invalid learning rate"
    ("warmup", 2.0, "warmup=2.0: give a fraction of the run in [0, 1) (--warmup)"),
    ("clip", -1.0, "clip=-1.0: give a gradient norm >= 0 (0: off) (--clip)"),
    ("eval_every_steps", 0, "eval_every_steps=0: give 1 or more (--eval-every-steps)"),
    ("ckpt_every_steps", 0, "ckpt_every_steps=0: give 1 or more (--ckpt-every-steps)"),
    ("evals", -1, "evals=-1: give 0 (only at the end) or more (--evals)"),
    # checked later, each in a library's words ("--batch-size and --grad-accum must be >= 1" for either; torch's
    # "dropout probability has to be between 0 and 1" after the corpus was read)
    ("batch_size", 0, "batch_size=0: give 1 or more (--batch-size)"),
    ("grad_accum", 0, "grad_accum=0: give 1 or more (--grad-accum)"),
    ("seq_len", 3, "seq_len=3: give 4 or more (--seq-len)"),
    ("mask_rate", float("nan"), "mask_rate=nan: give a fraction in (0, 1) (--mask-rate)"),
    ("num_masks", 0, "num_masks=0: give 1 or more (--num-masks)"),
    ("dropout", -0.1, "dropout=-0.1: give a probability in [0, 1) (--dropout)"),
    ("static_masks", -1, "static_masks=-1: give 0 (dynamic masking) or more (--static-masks)"),
])
def test_pretrain_settings_that_crash_or_make_no_sense_are_refused(field, value, message):
    import re

    from twotower.encoder.pretraining.pretrain import PretrainArgs

    PretrainArgs(corpus=["c.txt"], tokenizer="t", out="o", evals=0, clip=0.0)  # the defaults pass; 0 is "off" there
    with pytest.raises(ValueError, match=re.escape(message)):
        PretrainArgs(corpus=["c.txt"], tokenizer="t", out="o", **{field: value})


@pytest.mark.parametrize("flags", [
    ["--init-from", "DIR", "--size", "small"],  # the checkpoint's architecture won
    ["--evals", "4", "--eval-every-steps", "2"],  # --eval-every-steps won
    ["--ckpt-every-minutes", "1", "--ckpt-every-steps", "5"],  # --ckpt-every-steps won
    ["--mask-rate", "0.3", "--num-masks", "4"],  # --num-masks won
])
def test_flags_that_replaced_another_without_a_word_are_exclusive(setup, tiny_tokenizer_dir, capsys, flags):
    args = _args(setup, tiny_tokenizer_dir, str(setup["tmp"] / "x"), "--steps", "1")
    i = args.index("--config")
    del args[i:i + 2]
    with pytest.raises(SystemExit) as exc:
        main([*args, *flags])
    assert exc.value.code == 2
    assert f"argument {flags[2]}: not allowed with argument {flags[0]}" in capsys.readouterr().err
    assert not os.path.exists(setup["tmp"] / "x")


# ---- resuming: the same run or a clear refusal; a failed start loses nothing --------------------------------
def _snapshot(directory) -> dict[str, bytes]:
    """Every file under `directory` and its bytes: what a refused command must leave as it was."""
    return {os.path.relpath(os.path.join(d, n), directory): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(directory) for n in names}


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    """(setup, run directory) of a run of --steps 6 stopped after 2 (--max-steps), to be resumed; copy it first."""
    tmp = tmp_path_factory.mktemp("stopped")
    corpus = fx.write_corpus(str(tmp), n_docs=12)
    cfg = EncoderConfig(vocab_size=tiny_tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=37, max_position_embeddings=64)
    cfg.save(str(tmp / "cfg.json"))
    s = {"corpus": corpus, "valid": fx.write_corpus(str(tmp), name="valid.txt", n_docs=3, seed=7),
         "config": str(tmp / "cfg.json"), "tmp": tmp}
    out = str(tmp / "run")
    assert main(_args(s, tiny_tokenizer_dir, out, "--steps", "6", "--max-steps", "2")) == 0
    return s, out


def _copy_run(stopped_run, tmp_path) -> str:
    import shutil

    out = str(tmp_path / "run")
    shutil.copytree(stopped_run[1], out)
    return out


def _same_rows_other_text(path: str, to: str) -> str:
    """`path` with the first two paragraphs of its first document swapped: the same tokens, so the same number of
    packed rows (the only thing a resume compared), but other text."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    lines[0], lines[1] = lines[1], lines[0]
    with open(to, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return to


@pytest.mark.parametrize("change, message", [
    ("corpus", "--corpus {other} (not the text the run was started on)"),
    ("clip", "--clip 0.5 (the run: --clip 1.0)"),
    ("valid", "--valid {valid} (not the run's validation text)"),
    ("steps", "--steps 12 (the run: --steps 6)"),
    ("size", "--size tiny (the run: --config {config}; the architectures differ in hidden_size"),
])
def test_resume_refuses_another_run_naming_the_flag(stopped_run, tiny_tokenizer_dir, tmp_path, capsys, change,
                                                    message):
    """--resume continued with another corpus of the same row count, another --clip or --valid, a longer --steps
    (the schedule jumped back up mid-run); a changed architecture was named by its config keys (hidden_size)."""
    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    before = _snapshot(out)
    args = _args(s, tiny_tokenizer_dir, out, "--steps", "6", "--resume")
    other = _same_rows_other_text(s["corpus"], str(tmp_path / "other.txt"))
    if change == "corpus":
        args[args.index("--corpus") + 1] = other
    elif change == "steps":
        args[args.index("--steps") + 1] = "12"
    elif change == "size":
        i = args.index("--config")
        args[i:i + 2] = ["--size", "tiny"]
    else:
        args += {"clip": ["--clip", "0.5"], "valid": ["--valid", s["valid"]]}[change]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"twotower pretrain: error: cannot resume {out}: " in err, err
    assert message.format(other=other, valid=s["valid"], config=s["config"]) in err, err
    assert f"Give the run's own settings (they are in {os.path.join(out, 'run.json')})" in err
    if change == "steps":  # says how to stop early and how to train longer instead
        assert "give the run's budget and --max-steps N" in err and f"--init-from {out}" in err
    assert _snapshot(out) == before


def test_resume_with_the_same_text_at_another_path_continues(stopped_run, tiny_tokenizer_dir, tmp_path):
    """The fingerprint is the files' content, not their paths: a corpus moved elsewhere is the same run."""
    import shutil

    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    moved = shutil.copy(s["corpus"], str(tmp_path / "moved.txt"))
    args = _args(s, tiny_tokenizer_dir, out, "--steps", "6", "--resume", "--max-steps", "3")
    args[args.index("--corpus") + 1] = moved
    assert main(args) == 0
    assert max(_train_losses(out)) == 3


def test_resume_after_a_save_killed_mid_swap_restores_the_state_and_sweeps_the_leftovers(stopped_run,
                                                                                       tiny_tokenizer_dir, tmp_path):
    """A kill between the two renames of a save left ``trainer_state.old-PID`` and no ``trainer_state/`` (the
    resume said "no training state"); kills mid-save left ``.trainer_state.tmp-*/`` and ``.curve.png.tmp-*``
    that even a successful resume kept. The user's own files stay."""
    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    os.rename(os.path.join(out, "trainer_state"), os.path.join(out, "trainer_state.old-4242"))
    os.makedirs(os.path.join(out, ".trainer_state.tmp-x1y2z3"))
    for name in (".trainer_state.tmp-x1y2z3/model.safetensors", ".curve.png.tmp-abc.tmp", "notes.txt"):
        with open(os.path.join(out, name), "w") as f:
            f.write("x")
    assert main(_args(s, tiny_tokenizer_dir, out, "--steps", "6", "--resume", "--max-steps", "3")) == 0
    assert max(_train_losses(out)) == 3
    left = os.listdir(out)
    assert "notes.txt" in left and not [n for n in left if ".tmp-" in n or ".old-" in n], left


def test_resume_in_another_precision_or_on_another_device_continues_with_a_warning(stopped_run, tiny_tokenizer_dir,
                                                                                  tmp_path, caplog):
    """A run may move to another machine, but its later steps are computed otherwise: said, not refused, and
    said only then (the same precision and device resume without a word)."""
    import logging

    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    run_file = os.path.join(out, "run.json")
    with open(run_file, encoding="utf-8") as f:
        record = json.load(f)
    assert record["compute"] == {"bf16": False, "device": "cpu"}
    with caplog.at_level(logging.WARNING, logger="twotower"):
        assert main(_args(s, tiny_tokenizer_dir, out, "--steps", "6", "--resume", "--max-steps", "3")) == 0
    assert not [r for r in caplog.records if "computed differently" in r.getMessage()]
    record["compute"] = {"bf16": True, "device": "cuda"}
    with open(run_file, "w", encoding="utf-8") as f:
        json.dump(record, f)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="twotower"):
        assert main(_args(s, tiny_tokenizer_dir, out, "--steps", "6", "--resume", "--max-steps", "4")) == 0
    said = [r.getMessage() for r in caplog.records if "computed differently" in r.getMessage()]
    assert said == [f"resuming {out} in fp32 on cpu; the run trained in bf16 on cuda (--no-bf16 / --device): the "
                    "steps from here are computed differently, so the result will not equal an uninterrupted run"]
    assert max(_train_losses(out)) == 4


def _truncate(path) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _plant_pickle(path) -> None:
    torch.save({"exp_avg": torch.zeros(2)}, path)  # a pickle under a safetensors name: refused, never loaded


def _drop_user(path) -> None:
    with open(path, encoding="utf-8") as f:
        state = json.load(f)
    del state["user"]["data"]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(state, f)


def _wrong_shape(path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tensors[sorted(tensors)[0]] = torch.zeros(2)
    save_file(tensors, path)


@pytest.mark.parametrize("name, damage, says", [
    ("trainer_state/optimizer.safetensors", _truncate, "damaged: not a whole safetensors file"),
    ("trainer_state/model.safetensors", _truncate, "damaged: not a whole safetensors file"),
    ("trainer_state/rng.safetensors", _truncate, "damaged: not a whole safetensors file"),
    ("trainer_state/state.json", _truncate, "damaged: not JSON"),
    ("run.json", _truncate, "damaged: not JSON"),
    ("trainer_state/optimizer.safetensors", _plant_pickle, "a pickle (torch.save) file, not safetensors: refused"),
    ("trainer_state/optimizer.safetensors", _wrong_shape, "damaged: 0/exp_avg has shape (2,)"),
    ("trainer_state/state.json", _drop_user, "damaged: its training position has no 'data'"),
])
def test_resume_from_a_damaged_checkpoint_names_the_file_and_what_to_do(stopped_run, tiny_tokenizer_dir, tmp_path,
                                                                        capsys, name, damage, says):
    """Each was a traceback (safetensors' "incomplete metadata", a KeyError) or a JSON error naming no file."""
    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    damage(os.path.join(out, name))
    before = _snapshot(out)
    assert main(_args(s, tiny_tokenizer_dir, out, "--steps", "6", "--resume")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"twotower pretrain: error: {os.path.join(out, name)}: "), err
    assert says in err, err
    if "pickle" not in says:  # what to do: start again, or keep the weights in a new run
        assert f"start the run again with --overwrite, or continue from its exported weights as a new run " \
               f"(--init-from {out} --tokenizer {out} --out NEW_DIR" in err, err
    assert _snapshot(out) == before


def test_overwrite_that_fails_on_bad_input_leaves_the_earlier_run(stopped_run, tiny_tokenizer_dir, tmp_path, capsys):
    """--overwrite removed the earlier run before the corpus was read: a malformed corpus left only run.json."""
    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    before = _snapshot(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n', encoding="utf-8")
    args = _args(s, tiny_tokenizer_dir, out, "--steps", "2", "--overwrite")
    args[args.index("--corpus") + 1] = str(bad)
    assert main(args) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
    assert _snapshot(out) == before
    bad.write_text('{"text": "fine"}\n{"text": "one", "title": "t", "text": "two"}\n', encoding="utf-8")
    assert main(args) == 2
    assert f"{bad}:2: key 'text' is given twice in one JSON object" in capsys.readouterr().err
    assert _snapshot(out) == before


def test_an_overwrite_run_is_built_apart_and_replaces_the_earlier_one_only_when_its_budget_is_spent(
        stopped_run, tiny_tokenizer_dir, tmp_path, capsys):
    """--overwrite removed the earlier run as the new one started: a new run stopped on the way left neither."""
    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    before = _snapshot(out)
    args = _args(s, tiny_tokenizer_dir, out, "--steps", "4", "--lr", "3e-3", "--overwrite")
    assert main([*args, "--max-steps", "2"]) == 0  # paused half way: the earlier run is untouched
    printed = json.loads(capsys.readouterr().out)
    assert _snapshot(out) == before
    assert printed["out"] == out + ".unfinished"
    assert max(_train_losses(out + ".unfinished")) == 2
    assert main([*args, "--resume"]) == 0  # continued where it is, then swapped in
    assert json.loads(capsys.readouterr().out)["out"] == out
    assert not os.path.exists(out + ".unfinished")
    assert sorted(_train_losses(out)) == [1, 2, 3, 4] and os.path.isfile(os.path.join(out, "log.jsonl.previous"))
    # bit for bit the run a fresh directory gets
    fresh = str(tmp_path / "fresh")
    assert main(_args(s, tiny_tokenizer_dir, fresh, "--steps", "4", "--lr", "3e-3")) == 0
    assert (open(os.path.join(out, "model.safetensors"), "rb").read()
            == open(os.path.join(fresh, "model.safetensors"), "rb").read())

    # what a stopped replacing run left is started again from nothing; anything else there is in the way
    os.makedirs(out + ".unfinished")
    (tmp_path / "run.unfinished" / "mine.txt").write_text("mine\n")
    assert main(args) == 2
    assert "run.unfinished is in the way: a run replacing" in capsys.readouterr().err


def test_overwrite_never_removes_files_that_are_not_a_runs(setup, tiny_tokenizer_dir, capsys):
    """--overwrite replaced the whole --out: a corpus kept there (the one being trained on) and notes went too."""
    d = setup["tmp"] / "d2"
    d.mkdir()
    mine = d / "mycorpus.txt"
    mine.write_text(open(setup["corpus"], encoding="utf-8").read(), encoding="utf-8")
    (d / "notes.md").write_text("notes\n")
    before = _snapshot(str(d))
    assert main(_args(setup, tiny_tokenizer_dir, str(d), "--steps", "2")) == 2
    err = capsys.readouterr().err
    assert "holding other files (mycorpus.txt, notes.md), not a pretraining run" in err and "--resume" not in err
    args = _args(setup, tiny_tokenizer_dir, str(d), "--steps", "2", "--overwrite")
    args[args.index("--corpus") + 1] = str(mine)
    assert main(args) == 2
    assert "mycorpus.txt, notes.md" in capsys.readouterr().err
    assert _snapshot(str(d)) == before
    # a run with a user's file beside it: --overwrite would remove the file with the run
    run = str(setup["tmp"] / "run")
    assert main(_args(setup, tiny_tokenizer_dir, run, "--steps", "2")) == 0
    (setup["tmp"] / "run" / "notes.md").write_text("notes\n")
    assert main(_args(setup, tiny_tokenizer_dir, run, "--steps", "2", "--overwrite")) == 2
    assert "an earlier pretraining run and files of yours (notes.md)" in capsys.readouterr().err
    assert (setup["tmp"] / "run" / "notes.md").read_text() == "notes\n"
    # what a killed save left (a state moved aside, a temporary copy) is the run's own, not a user's file
    (setup["tmp"] / "run" / "notes.md").unlink()
    (setup["tmp"] / "run" / "trainer_state.old-123").mkdir()
    (setup["tmp"] / "run" / ".trainer_state.tmp-ab12").mkdir()
    assert main(_args(setup, tiny_tokenizer_dir, run, "--steps", "2", "--overwrite")) == 0


def test_a_finished_run_is_not_resumed_and_the_refusal_offers_resume_only_for_a_state(setup, tiny_tokenizer_dir,
                                                                                       capsys):
    out = str(setup["tmp"] / "run")
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "2", "--valid", setup["valid"])) == 0
    capsys.readouterr()
    before = _snapshot(out)
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "2", "--valid", setup["valid"], "--resume")) == 2
    assert "the run in " + out + " finished (its budget is spent)" in capsys.readouterr().err
    assert _snapshot(out) == before  # no second final validation, no rewritten checkpoint
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "2")) == 2
    assert "--resume" not in capsys.readouterr().err  # nothing to continue
    part = str(setup["tmp"] / "part")
    assert main(_args(setup, tiny_tokenizer_dir, part, "--steps", "4", "--max-steps", "2")) == 0
    assert main(_args(setup, tiny_tokenizer_dir, part, "--steps", "4")) == 2
    assert "or --resume to continue it from step 2" in capsys.readouterr().err


def test_ctrl_c_says_what_resume_continues_from_or_how_to_start_again(setup, tiny_tokenizer_dir, capsys,
                                                                      monkeypatch):
    """It said only "interrupted"; the next command was refused with --resume offered, which found no state."""
    import twotower.encoder.pretraining.pretrain as pt
    from tests.encoder.task_fixtures import interrupted_at

    out = str(setup["tmp"] / "run")
    monkeypatch.setattr(pt, "set_lr", interrupted_at(2))  # before any checkpoint
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "4")) == 130
    err = capsys.readouterr().err
    assert "interrupted: no state was saved yet" in err and "run the command again with --overwrite" in err
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "4", "--resume")) == 2
    assert "start the run again with --overwrite instead of --resume" in capsys.readouterr().err
    monkeypatch.setattr(pt, "set_lr", interrupted_at(4))
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "4", "--overwrite", "--ckpt-every-steps", "2")) == 130
    assert "the run's state after step 2 is saved; run the same command with --resume" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "4", "--overwrite", "--ckpt-every-steps", "2",
                      "--resume")) == 0
    assert sorted(_train_losses(out)) == [1, 2, 3, 4]


def test_a_paused_and_resumed_run_logs_what_an_uninterrupted_one_does(setup, tiny_tokenizer_dir):
    """The paused run's final validation stayed in the log as an extra record at the pause step."""
    def records(out: str) -> list[tuple]:
        with open(os.path.join(out, "log.jsonl"), encoding="utf-8") as f:
            return [(r["type"], r["step"]) for r in map(json.loads, f)]

    whole, part = str(setup["tmp"] / "whole"), str(setup["tmp"] / "part")
    common = ("--steps", "5", "--valid", setup["valid"], "--evals", "2")
    assert main(_args(setup, tiny_tokenizer_dir, whole, *common)) == 0
    assert main(_args(setup, tiny_tokenizer_dir, part, *common, "--max-steps", "2")) == 0
    assert main(_args(setup, tiny_tokenizer_dir, part, *common, "--resume")) == 0
    assert records(part) == records(whole)


def test_init_from_with_another_tokenizer_of_the_same_size_is_refused(setup, tiny_tokenizer_dir, tmp_path, capsys):
    first = str(tmp_path / "first")
    assert main(_args(setup, tiny_tokenizer_dir, first, "--steps", "1")) == 0
    other = tmp_path / "othertok"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        text = open(os.path.join(tiny_tokenizer_dir, name), encoding="utf-8").read()
        (other / name).write_text(text)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = [t for t in vocab if not t.startswith("[")][-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same tokens and size, two rows swapped
    (other / "tokenizer.json").write_text(json.dumps(tj))
    args = _args(setup, str(other), str(tmp_path / "second"), "--steps", "1", "--init-from", first)
    args.remove("--config")
    args.remove(setup["config"])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {other} is not the tokenizer of --init-from {first}" in err
    assert not os.path.exists(tmp_path / "second")


def test_tokenizer_model_max_length_is_the_positions_trained(setup, tiny_tokenizer_dir, tmp_path):
    """It stayed 512: transformers' tokenizer gave a model of fewer positions rows it could not read, and ours
    embedded up to 512 tokens with a model trained on 32."""
    out = str(tmp_path / "run")
    assert main(_args(setup, tiny_tokenizer_dir, out, "--steps", "1")) == 0
    with open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["model_max_length"] == 32  # --seq-len 32 of a 64-position model
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok("word " * 200, truncation=True)["input_ids"]) == 32
    cont = str(tmp_path / "cont")  # continued at a shorter length: the checkpoint's positions stay trained
    args = _args(setup, out, cont, "--steps", "1", "--init-from", out, "--seq-len", "16")
    args.remove("--config")
    args.remove(setup["config"])
    assert main(args) == 0
    with open(os.path.join(cont, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["model_max_length"] == 32
    # a run from before the positions were recorded: its tokenizer says 512, its run.json the --seq-len it trained
    for name, key, value in (("tokenizer_config.json", "model_max_length", 512), ("run.json", "positions", None)):
        with open(os.path.join(out, name), encoding="utf-8") as f:
            saved = json.load(f)
        saved.pop(key, None) if value is None else saved.update({key: value})
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(saved, f)
    args[args.index(cont)] = cont = str(tmp_path / "cont-old")
    assert main(args) == 0
    with open(os.path.join(cont, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["model_max_length"] == 32  # not the 64 of the position table


def test_nsp_with_one_segment_embedding_and_a_file_as_tokenizer_are_refused_naming_the_flag(setup, tiny_tokenizer_dir,
                                                                                           tmp_path, capsys):
    cfg = EncoderConfig.load(setup["config"])
    cfg.type_vocab_size = 1
    cfg.save(str(tmp_path / "one.json"))
    args = _args(setup, tiny_tokenizer_dir, str(tmp_path / "nsp"), "--steps", "1", "--nsp")
    args[args.index("--config") + 1] = str(tmp_path / "one.json")
    assert main(args) == 2
    assert "has one segment embedding (type_vocab_size 1)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "nsp")  # nothing written: the next attempt needs no --overwrite
    assert main(_args(setup, setup["corpus"], str(tmp_path / "x"), "--steps", "1")) == 2
    assert f"--tokenizer {setup['corpus']}: a file, not a tokenizer directory" in capsys.readouterr().err


def test_a_replacing_run_stopped_before_its_swap_is_swapped_in_by_resume(stopped_run, tiny_tokenizer_dir,
                                                                        tmp_path, capsys, monkeypatch):
    """A finished replacing run whose swap into --out was stopped (Ctrl-C, a full disk) was refused by --resume
    as "finished", and --overwrite would have started it again: --resume now completes the swap."""
    from twotower.encoder.pretraining import pretrain as pt

    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    args = _args(s, tiny_tokenizer_dir, out, "--steps", "2", "--lr", "3e-3", "--overwrite")

    def stopped(*_a, **_k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pt, "commit_staged_run", stopped)
        assert main(args) == 130
    capsys.readouterr()
    staged = _snapshot(out + ".unfinished")
    assert main([*args, "--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["out"] == out and not os.path.exists(out + ".unfinished")
    assert open(os.path.join(out, "model.safetensors"), "rb").read() == staged["model.safetensors"]


def test_ctrl_c_before_a_new_runs_first_save_names_no_earlier_runs_state(stopped_run, tiny_tokenizer_dir, tmp_path,
                                                                         capsys, monkeypatch):
    """A new --overwrite run interrupted before its first save said "the run's state after step 2 is saved; run
    the same command with --resume": the state of the stopped replacing run its directory still held."""
    from twotower.encoder.pretraining import pretrain as pt

    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    args = _args(s, tiny_tokenizer_dir, out, "--steps", "4", "--lr", "3e-3", "--overwrite")
    assert main([*args, "--max-steps", "2"]) == 0  # a replacing run stopped in OUT.unfinished, its state at step 2
    state = os.path.join(out + ".unfinished", "trainer_state", "state.json")
    os.utime(state, (time.time() - 60, time.time() - 60))
    capsys.readouterr()

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pt, "tokenize_corpus", interrupted)  # before the new run has saved (or removed) anything
        assert main(args) == 130
    err = capsys.readouterr().err
    assert "no state was saved yet" in err and "step 2" not in err


class _Checked(Exception):
    """Raised once the resume is checked: the test stops there, before any collective of the ranks it stands for."""


def test_a_resume_is_warned_of_by_rank_0_alone(stopped_run, tiny_tokenizer_dir, tmp_path, caplog, monkeypatch):
    """Every rank checks --out (`check_out_dir`): a resume on another device, and one of a run.json without
    the text's fingerprints, were warned of once per rank."""
    import logging

    from twotower.common.distributed import DistInfo
    from twotower.encoder.pretraining import pretrain as pt

    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    run_file = os.path.join(out, "run.json")
    with open(run_file, encoding="utf-8") as f:
        record = json.load(f)
    record.pop("data")
    record.update(compute={"bf16": True, "device": "cuda"}, world_size=2)
    with open(run_file, "w", encoding="utf-8") as f:
        json.dump(record, f)

    def checked(*args, **kwargs):
        raise _Checked

    monkeypatch.setattr(pt, "build_rows", checked)
    said = []
    for rank in (0, 1):
        monkeypatch.setattr(pt, "init_distributed", lambda device, rank=rank: DistInfo(2, rank))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="twotower"), pytest.raises(_Checked):
            main(_args(s, tiny_tokenizer_dir, out, "--steps", "6", "--resume", "--max-steps", "3"))
        said.append([what for what in ("has no fingerprint", "computed differently")
                     if any(what in r.getMessage() for r in caplog.records)])
    assert said == [["has no fingerprint", "computed differently"], []]


def test_a_replacing_run_is_not_swapped_over_files_added_while_it_ran(stopped_run, tiny_tokenizer_dir, tmp_path,
                                                                      capsys, monkeypatch):
    """--out was checked when the replacing run started, and its swap at the end deleted a file the user had put
    there meanwhile: the run stays in OUT.unfinished until the file is moved out and --resume swaps it in."""
    from twotower.encoder.pretraining import pretrain as pt

    s = stopped_run[0]
    out = _copy_run(stopped_run, tmp_path)
    args = _args(s, tiny_tokenizer_dir, out, "--steps", "2", "--lr", "3e-3", "--overwrite")
    with monkeypatch.context() as m:  # the user adds a file at the moment of the swap
        m.setattr(pt, "commit_staged_run", adding_a_file(pt.commit_staged_run, os.path.join(out, "notes.txt")))
        assert main(args) == 2
    err = capsys.readouterr().err
    assert "files of yours (notes.txt)" in err and "nothing was swapped" in err, err
    assert open(os.path.join(out, "notes.txt")).read() == "mine\n"
    staged = _snapshot(out + ".unfinished")
    assert main([*args, "--resume"]) == 2  # still there
    assert "files of yours (notes.txt)" in capsys.readouterr().err
    os.remove(os.path.join(out, "notes.txt"))
    assert main([*args, "--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["out"] == out and not os.path.exists(out + ".unfinished")
    assert open(os.path.join(out, "model.safetensors"), "rb").read() == staged["model.safetensors"]
