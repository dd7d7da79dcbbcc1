"""`vt generate` prints the greedy text of transformers' generate; `vt serve` and `vt generate`
refuse a bad model or flag with one line and exit 2, before serving anything."""
import pytest

from vt.cli.main import main

FLAGS = ["--backend", "sim", "--max-context", "64", "--block-size", "4"]


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_generate_prints_the_greedy_completion(checkpoint, reference, capsys, tensor_parallel):
    tok, greedy = reference
    prompt = "Hello, world"
    expect = tok.decode(greedy(tok(prompt).input_ids, 16), skip_special_tokens=True)
    assert main(["generate", "--model", str(checkpoint), "--prompt", prompt,
                 "--max-tokens", "16", *FLAGS, "--tensor-parallel", str(tensor_parallel)]) == 0
    assert capsys.readouterr().out == expect + "\n"


@pytest.mark.parametrize("argv,words", [
    (["serve", "--model", "/no/such/dir", *FLAGS, "--port", "0"], "does not exist"),
    (["serve", "--preset", "nope", "--backend", "sim", "--port", "0"], "unknown preset"),
    (["serve", "--preset", "tiny-dense", "--port", "70000"], "--port must be in"),
    (["generate", "--model", "/no/such/dir", "--prompt", "x", *FLAGS], "does not exist"),
    (["generate", "--model", "x", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["serve", "--preset", "tiny-dense", "--tensor-parallel", "2", "--port", "0"],
     "--tensor-parallel needs --model"),
    (["generate", "--model", "x", "--prompt", "x", "--tensor-parallel", "0"], "--tensor-parallel"),
    (["generate", "--model", "x", "--prompt", "x", "--stop", "."], "does not exist"),
    (["generate", "--model", "x", "--prompt", "x", "--stop", ".", "--stop", ""],
     "--stop takes a non-empty string"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1] and err[-1].startswith("vt ")


def test_a_tensor_parallel_size_the_heads_do_not_divide_is_refused_before_any_rank(checkpoint,
                                                                                 capsys):
    assert main(["generate", "--model", str(checkpoint), "--prompt", "x", *FLAGS,
                 "--tensor-parallel", "3"]) == 2
    assert "heads=4 is not divisible by the tensor-parallel size 3" in capsys.readouterr().err


def test_serve_without_its_extra_names_the_distribution_to_install(monkeypatch, capsys):
    """`vt` on PyPI is another project: the hint installs this one's extra, vt-graphs[serve]."""
    import sys
    monkeypatch.setitem(sys.modules, "fastapi", None)        # import fastapi -> ImportError
    for name in ("vt.serve.app", "vt.serve.server"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["serve", "--preset", "tiny-dense", "--backend", "sim", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "fastapi is missing" in err[-1] and "pip install 'vt-graphs[serve]'" in err[-1], err
