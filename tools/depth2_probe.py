"""tools/depth2_probe.py: a bare depth-2 loop over vt's ring slots (launch N, wait N-1) with X us of host
busy-work per step, placed after the wait (as ring's plan+refresh) or before it (as
prepare-ahead's). Measures T per step against the model T = (h + L + d) / 2 vs max(h, d)."""
import os, time
import numpy as np
from vt.demo import pick_backend
from vt.bench.run import make_engine
from vt.bench.synthetic import SyntheticModel, SYNTH_VOCAB
from vt.waits import wait_event

be = pick_backend(os.environ.get("PB", "cuda"), 0)
clock = time.perf_counter
def busy(x):
    end = clock() + x
    while clock() < end:
        pass
for conc in (1, 32):
    model = SyntheticModel(be, max_seqs=conc, max_context=64)
    eng = make_engine(be, model.model, "ring", conc, profile=False, max_prefill_tokens=conc * 8)
    eng.generate([[1, 2]] * conc, max_new_tokens=8)
    r = eng.runner
    slots = r.driver.rings[conc].slots
    ceil = eng.device_ceiling_us(conc, replays=2000)
    print(f"S={conc} ceiling {ceil:.1f} us", flush=True)
    for x_us in (0, 4, 8, 12, 16, 20, 24):
        out = []
        for where in ("after", "before"):
            ts = []
            for rep in range(3):
                prev = None; n = 2000; x = x_us * 1e-6
                r.stream.synchronize(); t0 = clock()
                for j in range(n):
                    s = slots[j & 1]
                    s.launch(r.stream, conc)
                    if where == "before":
                        busy(x)
                    if prev is not None:
                        wait_event(prev.done, 50e-6)
                    if where == "after":
                        busy(x)
                    prev = s
                r.stream.synchronize()
                ts.append((clock() - t0) / n * 1e6)
            out.append(f"{where} {min(ts):5.1f}/{np.median(ts):5.1f}")
        print(f"  X={x_us:2d}: " + "   ".join(out), flush=True)
    eng.close(); model.close()
