"""What a blocking-sync event costs a depth-2 graph loop, on a CUDA GPU.

    python3 tools/event_cost.py

A graph of five small kernels (plus a spin of 10 µs in the second half) whose completion is
signalled by an event, four ways: an event-record node at the graph's end or a separate
cudaEventRecord after the launch, with a cudaEventBlockingSync event or a default (spin)
one. It prints the host's cost of the launch (+ record) into an idle stream, and the µs per
step of a depth-2 loop (launch step N, wait for step N-1 by query, X µs of host work) over
two such graphs. It calls cuda.bindings itself: it measures the driver, not vt. docs/design.md
cites its numbers for how vt records its slots' done events.
"""
import time, statistics
import numpy as np
from cuda.bindings import runtime as rt
import cupy
def ck(r):
    assert int(r[0]) == 0, r
    return r[1] if len(r) == 2 else r[1:]
cupy.cuda.Device(0).use()
s = ck(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)); ext = cupy.cuda.ExternalStream(int(s))
d = ck(rt.cudaMalloc(1 << 16))
k = cupy.RawKernel(r'''extern "C" __global__ void inc(int* x, int n){int i=blockIdx.x*blockDim.x+threadIdx.x; if(i<n) x[i]+=1;}''', 'inc')
spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long ns){unsigned long long a,b; asm volatile("mov.u64 %0, %%globaltimer;":"=l"(a)); do {asm volatile("mov.u64 %0, %%globaltimer;":"=l"(b));} while(b-a<(unsigned long long)ns);}''', 'spin')
arr = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(d, 1 << 16, None), 0)
with ext:
    k((8,), (256,), (arr, np.int32(2048))); spin((1,), (1,), (np.int64(1000),))
rt.cudaStreamSynchronize(s)
def mk_event(blocking):
    return ck(rt.cudaEventCreateWithFlags((rt.cudaEventBlockingSync if blocking else 0) | rt.cudaEventDisableTiming))
def graph(spin_ns, ev):
    ck((rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)[0], None))
    with ext:
        for _ in range(5): k((8,), (256,), (arr, np.int32(2048)))
        if spin_ns: spin((1,), (1,), (np.int64(spin_ns),))
    rt.cudaEventRecordWithFlags(ev, s, rt.cudaEventRecordExternal)
    g = ck(rt.cudaStreamEndCapture(s)); ge = ck(rt.cudaGraphInstantiateWithFlags(g, 0)); rt.cudaStreamSynchronize(s)
    return ge
clock = time.perf_counter
NOT_READY = rt.cudaError_t.cudaErrorNotReady
def spin_wait(ev):
    while rt.cudaEventQuery(ev)[0] == NOT_READY:
        pass
def graph_plain(spin_ns):
    ck((rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)[0], None))
    with ext:
        for _ in range(5): k((8,), (256,), (arr, np.int32(2048)))
        if spin_ns: spin((1,), (1,), (np.int64(spin_ns),))
    g = ck(rt.cudaStreamEndCapture(s)); ge = ck(rt.cudaGraphInstantiateWithFlags(g, 0)); rt.cudaStreamSynchronize(s)
    return ge
VARIANTS = ("node spin", "node blocking", "record blocking", "record spin")
def build(v, spin_ns):
    evs = [mk_event("blocking" in v) for _ in range(2)]
    if v.startswith("node"):
        ges = [graph(spin_ns, e) for e in evs]
        return evs, [(lambda ge=ge: rt.cudaGraphLaunch(ge, s)) for ge in ges]
    ges = [graph_plain(spin_ns) for _ in evs]
    return evs, [(lambda ge=ge, e=e: (rt.cudaGraphLaunch(ge, s), rt.cudaEventRecord(e, s))) for ge, e in zip(ges, evs)]
for v in VARIANTS:
    evs, launch = build(v, 0)
    ts = []
    for i in range(3000):
        spin_wait(evs[0])
        t = clock(); launch[0](); ts.append((clock() - t) * 1e6)
    rt.cudaStreamSynchronize(s)
    print(f"{v:16s}: launch(+record) {statistics.median(ts):.2f} us (median, idle stream)", flush=True)
for spin_ns in (0, 10000):
    for v in VARIANTS:
        evs, launch = build(v, spin_ns)
        for x_us in (0, 8):
            res = []
            for rep in range(3):
                rt.cudaStreamSynchronize(s); t0 = clock(); prev = None
                for j in range(3000):
                    launch[j & 1]()
                    if prev is not None: spin_wait(evs[prev])
                    end = clock() + x_us * 1e-6
                    while clock() < end: pass
                    prev = j & 1
                rt.cudaStreamSynchronize(s); res.append((clock() - t0) / 3000 * 1e6)
            print(f"depth-2, graph spin {spin_ns//1000:2d} us, {v:16s} X={x_us:2d}: {min(res):.1f}/{statistics.median(res):.1f} us per step", flush=True)
