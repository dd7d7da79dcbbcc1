"""`vt generate` prints the greedy text of transformers' generate; `vt serve` and `vt generate`
refuse a bad model or flag with one line and exit 2, before serving anything."""
import pytest

from vt.cli.main import main

FLAGS = ["--backend", "sim", "--max-context", "64", "--block-size", "4"]


def test_generate_prints_the_greedy_completion(checkpoint, reference, capsys):
    tok, greedy = reference
    prompt = "Hello, world"
    expect = tok.decode(greedy(tok(prompt).input_ids, 16), skip_special_tokens=True)
    assert main(["generate", "--model", str(checkpoint), "--prompt", prompt,
                 "--max-tokens", "16", *FLAGS]) == 0
    assert capsys.readouterr().out == expect + "\n"


@pytest.mark.parametrize("argv,words", [
    (["serve", "--model", "/no/such/dir", *FLAGS, "--port", "0"], "does not exist"),
    (["serve", "--preset", "nope", "--backend", "sim", "--port", "0"], "unknown preset"),
    (["serve", "--preset", "tiny-dense", "--port", "70000"], "--port must be in"),
    (["generate", "--model", "/no/such/dir", "--prompt", "x", *FLAGS], "does not exist"),
    (["generate", "--model", "x", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1] and err[-1].startswith("vt ")
