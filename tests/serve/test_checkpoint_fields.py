"""The fields `vt serve` reads from a checkpoint's JSON files beside the model's own config
(max_position_embeddings for the default context, eos_token_id): a value of the wrong kind is
a one-line ValueError naming the file and the field, never a silent default or a TypeError."""
import json
import shutil

import pytest

from vt.serve.model_source import load_checkpoint
from vt.serve.text import eos_token_ids


def _edited_copy(checkpoint, tmp_path, name, **fields):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    data = json.loads((path / name).read_text())
    data.update(fields)
    (path / name).write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("value", [0, -1, "256", 1.5, True])
def test_a_wrong_max_position_embeddings_is_refused_naming_file_and_field(checkpoint, tmp_path,
                                                                          sim_backend, value):
    path = _edited_copy(checkpoint, tmp_path, "config.json", max_position_embeddings=value)
    with pytest.raises(ValueError, match=r"config.json: max_position_embeddings must be an "
                                         r"integer in \[1, ") as info:
        load_checkpoint(sim_backend, path, max_seqs=1)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["2", 2.0, True, -1, [2, None]])
def test_a_wrong_eos_token_id_is_refused_naming_file_and_field(checkpoint, tmp_path, value):
    path = _edited_copy(checkpoint, tmp_path, "generation_config.json", eos_token_id=value)
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id=.* must be a "
                                         r"token id") as info:
        eos_token_ids(path)
    assert "\n" not in str(info.value)


def test_a_null_eos_token_id_falls_back_to_config_json(checkpoint, tmp_path):
    path = _edited_copy(checkpoint, tmp_path, "generation_config.json", eos_token_id=None)
    assert eos_token_ids(path) == (json.loads((path / "config.json").read_text())["eos_token_id"],)
