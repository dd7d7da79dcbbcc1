"""A deliberately broken speculative engine for the fuzzers' detector tests."""
import numpy as np


def accept_first_drafts(monkeypatch):
    """Acceptance (the numpy twin) that keeps every row's first draft whatever the target
    drew."""
    from vt.forward import spec_kernels
    original = spec_kernels.Accept.run_numpy

    def accept_first(self, targets, v_logits, drafts, token_rows, *args, k, pad_row):
        S, w = len(token_rows), k + 1
        forced = np.array(targets[:S * w]).reshape(S, w)
        forced[:, 0] = drafts[:S, 0]
        original(self, forced.reshape(-1), v_logits, drafts, token_rows, *args, k=k,
                 pad_row=pad_row)

    monkeypatch.setattr(spec_kernels.Accept, "run_numpy", accept_first)
