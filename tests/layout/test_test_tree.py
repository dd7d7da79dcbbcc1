"""The test tree itself: pytest puts tests/ (the conftest's folder) and every test folder
without an __init__.py on sys.path, so such a folder named like a package the tests import
is a namespace package of that name. Where the real package is missing, `import torch` then
finds tests/torch instead of failing, and pytest.importorskip no longer skips: collection
breaks on a machine without PyTorch. No test folder may take such a name, nor the name of one
of the repository's own packages (vt, tools: pytest's `pythonpath` puts the root on sys.path),
which would leave two folders answering one import."""
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
# Third-party packages vt or its tests import (pyproject.toml's dependencies and extras).
THIRD_PARTY = {"torch", "transformers", "numpy", "cupy", "cuda", "nvmath", "matplotlib",
               "hypothesis", "pytest", "safetensors", "huggingface_hub", "tqdm", "fastapi",
               "uvicorn", "starlette", "pydantic", "openai", "httpx", "tokenizers",
               "prometheus_client"}


def _holds_files(folder: pathlib.Path) -> bool:
    """Anything but byte-code caches: a folder a checkout kept only for its ignored
    __pycache__ after a rename is not part of the tree."""
    return any(p.name != "__pycache__" for p in folder.iterdir())


def test_no_test_folder_shadows_a_third_party_package():
    folders = {p.name for p in TESTS.iterdir()
               if p.is_dir() and not p.name.startswith((".", "_")) and _holds_files(p)}
    assert folders, TESTS
    assert not folders & THIRD_PARTY, sorted(folders & THIRD_PARTY)


def test_no_test_folder_takes_the_name_of_a_repository_package():
    own = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert {"vt", "tools"} <= own, sorted(own)
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and _holds_files(p)}
    assert not folders & own, sorted(folders & own)
