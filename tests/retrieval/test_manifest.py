

def test_the_default_model_is_named_by_its_name_and_any_other_by_its_directory(minilm_path, tmp_path):
    from twotower.retrieval.manifest import model_name

    assert model_name(minilm_path) == "all-MiniLM-L6-v2"  # its directory is called "model"
    (tmp_path / "my-encoder").mkdir()
    assert model_name(str(tmp_path / "my-encoder") + "/") == "my-encoder"
