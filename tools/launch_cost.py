"""The host's cost of the CUDA calls a decode step makes, from Python, on a CUDA GPU.

    python3 tools/launch_cost.py

Per call, median and 10th percentile of 60 batches of 16 calls (µs): cudaGraphLaunch of
graphs made of different nodes (kernels, memcpy nodes, kernels reading/writing pinned host
memory directly), through cuda.bindings' runtime module, its driver module and ctypes into
libcuda; event record and query the same three ways. It measures the bindings and the
driver, not vt (so it calls cuda.bindings itself): docs/design.md cites its numbers for why
vt's graphs copy with kernels and call the runtime through cuda.bindings.
"""
import ctypes
import time

import numpy as np
from cuda.bindings import runtime as rt, driver as drv
import cupy

def ck(r):
    e = r[0]
    assert int(e) == 0, r
    return r[1] if len(r) == 2 else r[1:]

cupy.cuda.Device(0).use()
s = ck(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
sh = int(s)
N = 32 * 64 * 4  # 8 KiB block
h_in = ck(rt.cudaHostAlloc(N, 0)); h_out = ck(rt.cudaHostAlloc(256, 0))
d_in = ck(rt.cudaMalloc(N)); d_out = ck(rt.cudaMalloc(256))
k = cupy.RawKernel(r'''extern "C" __global__ void inc(int* x, int n){int i=blockIdx.x*blockDim.x+threadIdx.x; if(i<n) x[i]+=1;}''', 'inc')
kc = cupy.RawKernel(r'''extern "C" __global__ void cp(const int* __restrict__ a, int* b, int n){int i=blockIdx.x*blockDim.x+threadIdx.x; if(i<n) b[i]=a[i];}''', 'cp')
k.compile(); kc.compile()
ext = cupy.cuda.ExternalStream(sh)
H2D, D2H = rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost

def kern(nk):
    with ext:
        for _ in range(nk):
            k((8,), (256,), (cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(d_in, N, None), 0), np.int32(2048)))
def h2d(): rt.cudaMemcpyAsync(d_in, h_in, N, H2D, s)
def d2h(): rt.cudaMemcpyAsync(h_out, d_out, 128, D2H, s)
def uva_in():
    with ext:
        kc((8,), (256,), (cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(h_in, N, None), 0), cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(d_in, N, None), 0), np.int32(2048)))
def uva_out():
    with ext:
        kc((1,), (32,), (cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(d_out, 256, None), 0), cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(h_out, 256, None), 0), np.int32(32)))

def capture(build):
    ck((rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)[0], None))
    build()
    g = ck(rt.cudaStreamEndCapture(s))
    ge = ck(rt.cudaGraphInstantiateWithFlags(g, 0))
    rt.cudaGraphUpload(ge, s); rt.cudaStreamSynchronize(s)
    return ge

# warm kernels outside capture
kern(1); uva_in(); uva_out(); rt.cudaStreamSynchronize(s)
ev_node = ck(rt.cudaEventCreateWithFlags(rt.cudaEventBlockingSync | rt.cudaEventDisableTiming))
def ext_record(): rt.cudaEventRecordWithFlags(ev_node, s, rt.cudaEventRecordExternal)
graphs = {
  "1 kernel": lambda: kern(1),
  "5 kernels": lambda: kern(5),
  "h2d+1k": lambda: (h2d(), kern(1)),
  "h2d+1k+d2h": lambda: (h2d(), kern(1), d2h()),
  "h2d+5k+d2h": lambda: (h2d(), kern(5), d2h()),
  "uva_in+5k+uva_out": lambda: (uva_in(), kern(5), uva_out()),
  "uva_in+12k+uva_out": lambda: (uva_in(), kern(12), uva_out()),
  "uva+5k+event node": lambda: (uva_in(), kern(5), uva_out(), ext_record()),
}
libcuda = ctypes.CDLL("libcuda.so.1")
cuGraphLaunch = libcuda.cuGraphLaunch; cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]; cuGraphLaunch.restype = ctypes.c_int
cuEventRecord = libcuda.cuEventRecord; cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]; cuEventRecord.restype = ctypes.c_int
cuEventQuery = libcuda.cuEventQuery; cuEventQuery.argtypes = [ctypes.c_void_p]; cuEventQuery.restype = ctypes.c_int
dstream = drv.CUstream(sh)

def timeit(fn, reps=60, inner=16):
    per = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        per.append((time.perf_counter() - t) / inner * 1e6)
        rt.cudaStreamSynchronize(s)
    per.sort()
    return per[len(per)//2], per[len(per)//10]

print(f"{'graph':<22}{'rt launch':>12}{'drv launch':>12}{'ctypes':>12}   (median, p10 us per call)")
for name, build in graphs.items():
    ge = capture(build)
    gh = int(ge); dge = drv.CUgraphExec(gh)
    a = timeit(lambda: rt.cudaGraphLaunch(ge, s))
    b = timeit(lambda: drv.cuGraphLaunch(dge, dstream))
    c = timeit(lambda: cuGraphLaunch(gh, sh))
    print(f"{name:<22}" + "".join(f"{m:7.2f}/{p:4.1f}" for m, p in (a, b, c)))
ev = ck(rt.cudaEventCreateWithFlags(rt.cudaEventBlockingSync | rt.cudaEventDisableTiming))
eh = int(ev); dev_ = drv.CUevent(eh)
ge = capture(graphs["uva_in+5k+uva_out"])
m, p = timeit(lambda: (rt.cudaGraphLaunch(ge, s), rt.cudaEventRecord(ev, s)))
print(f"{'uva+5k, then a record':<22}{m:7.2f}/{p:4.1f}   (rt launch + rt event record)")
print("event record rt/drv/ctypes:", [f"{m:.2f}" for m, _ in (timeit(lambda: rt.cudaEventRecord(ev, s)), timeit(lambda: drv.cuEventRecord(dev_, dstream)), timeit(lambda: cuEventRecord(eh, sh)))])
rt.cudaStreamSynchronize(s)
print("event query (done) rt/drv/ctypes:", [f"{m:.2f}" for m, _ in (timeit(lambda: rt.cudaEventQuery(ev)), timeit(lambda: drv.cuEventQuery(dev_)), timeit(lambda: cuEventQuery(eh)))])
x = np.zeros(32, np.int32); y = np.arange(32, dtype=np.int32)
print("np.add(out=) 32:", f"{timeit(lambda: np.add(y, 3, out=x))[0]:.2f}")
print("py call noop:", f"{timeit(lambda: None)[0]:.2f}")
