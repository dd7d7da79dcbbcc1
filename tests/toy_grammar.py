"""A toy grammar for the engine's constrained-output tests: after each token (and at the start)
only three tokens are allowed, none of them likely under a toy forward's logits by chance, so a
request that follows it was constrained and the same request without it strays."""
import numpy as np


def allowed(prev: int | None, vocab: int) -> set[int]:
    base = 5 if prev is None else (prev * 7 + 3) % vocab
    return {base, (base + 11) % vocab, (base + 29) % vocab}


def follows(tokens, vocab: int) -> bool:
    """Whether `tokens` is a sentence of the grammar (each token allowed after the one before)."""
    prev = None
    for t in tokens:
        if t not in allowed(prev, vocab):
            return False
        prev = t
    return True


class ToyGrammar:
    """The engine's grammar interface (fill_mask, accept) over the toy grammar; accept asserts
    the token is allowed."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.seen: list[int] = []

    def fill_mask(self, bits) -> None:
        bits[...] = 0
        words = bits.view(np.uint32)
        for t in allowed(self.seen[-1] if self.seen else None, self.vocab):
            words[t >> 5] |= np.uint32(1) << np.uint32(t & 31)

    def accept(self, token: int) -> None:
        assert token in allowed(self.seen[-1] if self.seen else None, self.vocab), (self.seen, token)
        self.seen.append(token)
