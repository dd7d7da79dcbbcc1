"""The test tree itself: pytest puts tests/ (the conftest's folder) and every test folder
without an __init__.py on sys.path, so such a folder named like a package the tests import
is a namespace package of that name. Where the real package is missing, `import torch` then
finds tests/torch instead of failing, and pytest.importorskip no longer skips: collection
breaks on a machine without PyTorch. No test folder may take such a name."""
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]
# Third-party packages vt or its tests import (pyproject.toml's dependencies and extras).
THIRD_PARTY = {"torch", "transformers", "numpy", "cupy", "cuda", "nvmath", "matplotlib",
               "hypothesis", "pytest", "safetensors", "huggingface_hub", "tqdm"}


def test_no_test_folder_shadows_a_third_party_package():
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders, TESTS
    assert not folders & THIRD_PARTY, sorted(folders & THIRD_PARTY)
