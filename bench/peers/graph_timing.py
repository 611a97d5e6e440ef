"""Device time per call from a CUDA-graph replay, shared by the peer scripts in bench/peers."""
import torch


def graph_us(call, nsets=1, batch=200, replays=15):
    """Median per-call device time of `batch` calls call(i % nsets) captured in one CUDA graph (warmed up
    on a side stream first), over `replays` replays timed with CUDA events."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            call(i % nsets)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(batch):
            call(i % nsets)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / batch)
    return sorted(times)[len(times) // 2]
