"""HF-layout checkpoints: our directories load in transformers and back, with clear errors for bad ones."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from twotower.encoder.core.checkpoint import load_encoder, read_weights, save_encoder, split_prefix
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.model import BertModel


def _batch(tokenizer):
    return tokenizer.encode(["the tea is cold", "paris is the capital of france"], pairs=["hot", "who wrote it"])


def test_save_load_roundtrip(tiny_model, tmp_path):
    model, tok = tiny_model
    save_encoder(model, tok, str(tmp_path))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt", "tokenizer_config.json",
                 "special_tokens_map.json"):
        assert os.path.isfile(tmp_path / name), name
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # atomic writes leave no temp files
    again, tok2 = load_encoder(str(tmp_path))
    assert tok2.fingerprint() == tok.fingerprint()
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    assert again.config.to_dict() == model.config.to_dict()


def test_our_directory_loads_in_transformers(tiny_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, tok = tiny_model
    save_encoder(model, tok, str(tmp_path))
    ref = transformers.BertModel.from_pretrained(str(tmp_path)).eval()
    b = _batch(tok)
    with torch.no_grad():
        want = ref(**b.model_inputs())
        hidden, pooled = model(**b.model_inputs())
    real = b.attention_mask.bool()
    torch.testing.assert_close(hidden[real], want.last_hidden_state[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, want.pooler_output, atol=1e-5, rtol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path))(["the tea"])["input_ids"] == \
        tok.encode(["the tea"]).input_ids.tolist()


def test_transformers_directory_loads_in_ours(tiny_model_dir, tmp_path):
    """A BertForMaskedLM directory written by transformers: encoder under `bert.`, an MLM head beside it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    cfg = transformers.BertConfig.from_pretrained(tiny_model_dir)
    ref = transformers.BertForMaskedLM(cfg).eval()
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model_dir, f), tmp_path / f)
    assert any(k.startswith("bert.") for k in read_weights(str(tmp_path)))
    ours, tok = load_encoder(str(tmp_path))
    assert ours.pooler is None  # BertForMaskedLM has no pooler
    b = _batch(tok)
    with torch.no_grad():
        want = ref.bert(**b.model_inputs()).last_hidden_state
        hidden, _ = ours(**b.model_inputs())
    real = b.attention_mask.bool()
    torch.testing.assert_close(hidden[real], want[real], atol=1e-5, rtol=1e-5)


def test_split_prefix():
    state = {"bert.embeddings.x": 1, "bert.embeddings.position_ids": 2, "cls.predictions.bias": 3}
    enc, rest = split_prefix(state)
    assert enc == {"embeddings.x": 1} and rest == {"cls.predictions.bias": 3}
    enc, rest = split_prefix({"encoder.layer.0.w": 1, "classifier.weight": 2})
    assert enc == {"encoder.layer.0.w": 1} and rest == {"classifier.weight": 2}


# ---- clear errors -------------------------------------------------------------------------------------
def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_weights_names_the_file(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_encoder(d)
    open(os.path.join(d, "pytorch_model.bin"), "wb").close()
    with pytest.raises(FileNotFoundError, match="unpickling"):
        load_encoder(d)
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_encoder(str(tmp_path / "nowhere"))


def test_a_damaged_weights_file_is_named_with_what_to_do(tiny_model_dir, tmp_path):
    """A file cut short was safetensors' SafetensorError ("incomplete metadata, file not fully covered"), naming
    no file; a pickle under the safetensors name is refused as one, never loaded."""
    from twotower.common.errors import DataError

    d = _copy(tiny_model_dir, tmp_path / "m")
    path = os.path.join(d, "model.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(DataError) as exc:
        load_encoder(d)
    assert str(exc.value) == (f"{path}: damaged: not a whole safetensors file (incomplete metadata, file not fully "
                              "covered); copy or save the model again (a copy or save cut short leaves such a file), "
                              "or retrain it")
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(DataError, match="a pickle \\(torch.save\\) file, not safetensors: refused"):
        read_weights(d)


def test_missing_config_and_tokenizer_name_the_file(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_encoder(d)
    d2 = _copy(tiny_model_dir, tmp_path / "m2")
    os.remove(os.path.join(d2, "tokenizer.json"))
    os.remove(os.path.join(d2, "vocab.txt"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json or vocab.txt"):
        load_encoder(d2)


def test_shape_mismatch_names_tensor_and_both_shapes(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    path = os.path.join(d, "model.safetensors")
    state = load_file(path)
    state["encoder.layer.1.intermediate.dense.weight"] = torch.zeros(40, 36)
    save_file(state, path)
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.intermediate\.dense\.weight.*\(40, 36\).*\(37, 36\)"):
        load_encoder(d)


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    path = os.path.join(d, "model.safetensors")
    state = load_file(path)
    del state["encoder.layer.0.attention.self.key.bias"]
    save_file(state, path)
    with pytest.raises(ValueError, match=r"missing tensors.*encoder\.layer\.0\.attention\.self\.key\.bias"):
        load_encoder(d)


def test_bad_config_is_named(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    del cfg["hidden_size"], cfg["num_attention_heads"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match=r"config.json: missing required config keys \['hidden_size', "
                                         r"'num_attention_heads'\]"):
        load_encoder(d)
    with open(cfg_path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_encoder(d)


def test_config_roundtrip_and_named_sizes():
    cfg = EncoderConfig.named("mini", vocab_size=1234, norm_first=True)
    again = EncoderConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.diff(cfg) == []
    assert EncoderConfig.named("tiny", 99).diff(EncoderConfig.named("mini", 99)) == [
        "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers"]
    assert BertModel(EncoderConfig.named("tiny", 99)).config.hidden_size == 128
    with pytest.raises(ValueError, match="unknown size"):
        EncoderConfig.named("huge", 99)


@pytest.mark.parametrize("rank, said", [("0", 3), ("1", 0)])
def test_a_models_loading_warnings_are_said_by_rank_0_alone(tiny_model_dir, tmp_path, caplog, monkeypatch, rank,
                                                             said):
    """Every torchrun rank loads the same model: its warnings (another model_type, unknown config keys,
    unexpected tensors) came once per rank."""
    import logging

    d = _copy(tiny_model_dir, tmp_path / "m")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(model_type="roberta", made_up_key=1)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    state = load_file(os.path.join(d, "model.safetensors"))
    state["embeddings.made_up"] = torch.zeros(2)  # a tensor of the encoder's that it has no place for
    save_file(state, os.path.join(d, "model.safetensors"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    with caplog.at_level(logging.WARNING, logger="twotower"):
        load_encoder(d)
    assert sum(any(w in r.getMessage() for w in ("is not 'bert'", "unknown config keys", "unexpected tensors"))
               for r in caplog.records) == said
