"""Budget parsing / progress and the pickle-free training state (optimizer + RNG round trip)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from twotower.encoder.training.budget import Budget, parse_count, parse_duration
from twotower.encoder.training.optim import lr_factor, make_optimizer
from twotower.encoder.training.train_state import load_train_state, restore_rng, save_train_state


def test_budget_parsing_and_progress():
    assert parse_duration("30m") == 1800 and parse_duration("2h") == 7200 and parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90 and parse_duration("45") == 45
    assert parse_count("20M") == 20e6 and parse_count("1.5k") == 1500 and parse_count("2B") == 2e9
    for bad in ("30x", "m30", ""):
        with pytest.raises(ValueError, match="cannot parse"):
            parse_duration(bad)
    with pytest.raises(ValueError, match="exactly one budget"):
        Budget.parse(budget="30m", tokens="1M")
    for kw, said in (({"tokens": "0"}, "--tokens 0"), ({"budget": "0s"}, "--budget 0s"), ({"steps": 0}, "--steps 0")):
        with pytest.raises(ValueError, match=f"^{said}: give a budget above 0$"):  # "budget must be positive"
            Budget.parse(**kw)
    b = Budget.parse(tokens="20M")
    assert b.progress(tokens=5e6) == 0.25 and b.progress(tokens=30e6) == 1.0
    t = Budget.parse(budget="10m")
    assert t.progress(seconds=300, tokens=1e9) == 0.5
    # the schedule keyed to progress ends exactly at the budget
    assert lr_factor(t.progress(seconds=600)) == 0.0 and lr_factor(t.progress(seconds=36)) == pytest.approx(1.0)


def test_train_state_round_trip_continues_identically(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Dropout(0.5),
                                torch.nn.Linear(5, 3))
    opt = make_optimizer(model, lr=1e-2)
    x = torch.randn(13, 7)

    def step():
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    for _ in range(3):
        step()
    save_train_state(str(tmp_path / "st"), model.state_dict(), opt, {"step": 3, "data": {"epoch": 0}})
    want = [step() for _ in range(4)]

    torch.manual_seed(123)  # different init and RNG: everything must come from the saved state
    model2 = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Dropout(0.5),
                                 torch.nn.Linear(5, 3))
    opt2 = make_optimizer(model2, lr=1e-2)
    st = load_train_state(str(tmp_path / "st"))
    model2.load_state_dict(st.model)
    opt2.load_state_dict(st.optimizer)
    restore_rng(st.rng, "cpu")
    assert st.user == {"step": 3, "data": {"epoch": 0}}
    model, opt = model2, opt2
    assert [step() for _ in range(4)] == want
    # nothing pickled: state.json is JSON and the rest safetensors
    names = sorted(os.listdir(tmp_path / "st"))
    assert names == ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"]
    json.load(open(tmp_path / "st" / "state.json", encoding="utf-8"))


def test_incomplete_state_names_the_missing_file(tmp_path):
    model = torch.nn.Linear(2, 2)
    save_train_state(str(tmp_path / "st"), model.state_dict(), make_optimizer(model, 1e-3), {})
    os.remove(tmp_path / "st" / "rng.safetensors")
    with pytest.raises(FileNotFoundError, match="rng.safetensors"):
        load_train_state(str(tmp_path / "st"))


@pytest.mark.parametrize("name, content, says", [
    ("optimizer.safetensors", None, "damaged: not a whole safetensors file ("),
    ("model.safetensors", b"", "damaged: not a whole safetensors file (header too small)"),
    ("state.json", b"{\"optimizer\": ", "damaged: not JSON"),
    ("state.json", b"[]", "damaged: a JSON list, not an object"),
    ("state.json", b"{\"user\": {}}", "damaged: it has no 'optimizer' object"),
])
def test_damaged_state_is_a_data_error_naming_the_file(tmp_path, name, content, says):
    """Each was safetensors' or json's error naming no file, or a KeyError."""
    from twotower.common.errors import DataError

    model = torch.nn.Linear(2, 2)
    opt = make_optimizer(model, 1e-3)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    save_train_state(str(tmp_path / "st"), model.state_dict(), opt, {"step": 1})
    path = tmp_path / "st" / name
    if content is None:
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        path.write_bytes(content)
    with pytest.raises(DataError) as exc:
        load_train_state(str(tmp_path / "st"))
    assert str(exc.value).startswith(f"{path}: {says}"), exc.value


def test_a_state_that_does_not_fit_the_model_names_the_file(tmp_path):
    """A missing moment or ``step`` failed only at the first optimizer step after resuming (a KeyError)."""
    from safetensors.torch import load_file, save_file

    from twotower.common.errors import DataError
    from twotower.encoder.training.train_state import restore_train_state

    model = torch.nn.Linear(2, 2)
    opt = make_optimizer(model, 1e-3)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    directory = str(tmp_path / "st")
    save_train_state(directory, model.state_dict(), opt, {"step": 1})
    path = os.path.join(directory, "optimizer.safetensors")
    save_file({k: v for k, v in load_file(path).items() if not k.endswith("/step")}, path)
    fresh = torch.nn.Linear(2, 2)
    with pytest.raises(DataError, match=re.escape(f"{path}: damaged: the state of parameter 0 lacks step")):
        restore_train_state(load_train_state(directory), directory, fresh, make_optimizer(fresh, 1e-3))
    with pytest.raises(DataError, match=re.escape(f"{os.path.join(directory, 'model.safetensors')}: damaged: it "
                                                  "lacks 2 of the model's tensors (0.bias, 0.weight)")):
        restore_train_state(load_train_state(directory), directory, torch.nn.Sequential(fresh),
                            make_optimizer(fresh, 1e-3))
