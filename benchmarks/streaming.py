"""KV streaming benchmark: DéjàVu Figure 7 and Appendix F on this machine, in one run.

(a) streaming a decode run's KV to another process over TCP: naive (one chunk per contiguous piece)
    vs buffered copies vs buffered + layer-by-layer + overlap (background thread);
(b) end-to-end slowdown of generation with streaming on vs off, to another process (TCP) and to
    local disk (file store);
(c) achieved bandwidth of our transports vs a raw ZeroMQ socket / memcpy / file write of the same bytes.

    python benchmarks/streaming.py [--batch 8 --prompt 500 --new 500]

Writes results/streaming.json and results/streaming.png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import torch

from kvflow.config import EngineConfig

from kvflow.engine.engine import LLMEngine
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.scheduler import SchedulerConfig
from kvflow.kv.cache import KVCache, KVLayout
from kvflow.kv.manager import KVCacheManager
from kvflow.model.llama import LlamaModel
from kvflow.model.loader import load_checkpoint
from kvflow.streaming.chunk import ChunkDesc, Segment
from kvflow.streaming.overlap import KVStreamer, StreamerConfig, attach
from kvflow.streaming.primitives import InStream, OutStream, fetch, flush
from kvflow.streaming.scatter import KVSink, table_resolver
from kvflow.streaming.transports import FileReceiver, FileSender, ShmReceiver, ShmSender, TcpReceiver, TcpSender

RESULTS = Path("results")


# ---------------------------------------------------------------- peer process
def peer(kind: str, layout: KVLayout | None, conn) -> None:
    """Receive until told how many chunks/messages were sent; report when all are in.
    kind: "kv-tcp" (chunks written into a KV cache), "tcp"/"shm" (chunks verified and copied into a
    buffer), "raw-zmq" (plain PULL socket, bytes counted)."""
    torch.set_num_threads(1)
    import zmq

    if kind == "raw-zmq":
        sock = zmq.Context.instance().socket(zmq.PULL)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        conn.send(f"tcp://127.0.0.1:{port}")
        while True:
            total = conn.recv()
            if total is None:
                return
            for _ in range(total):
                sock.recv(copy=False)
            conn.send("done")
    rx = TcpReceiver() if kind in ("kv-tcp", "tcp") else ShmReceiver()
    conn.send(rx.address)
    inp = InStream(rx)
    sink = None
    if layout is not None:
        sink = KVSink(KVCache(layout), table_resolver({}, KVCacheManager(layout.num_blocks, layout.block_size).ensure))
    buf = torch.empty(0, dtype=torch.uint8)
    got, total = 0, None
    while True:
        if conn.poll(0):
            total = conn.recv()
            if total is None:
                return
        if total is not None and got >= total:
            conn.send("done")
            got, total = got - total, None
            continue
        try:
            with fetch(inp, 0.01) as chunk:
                if sink is not None:
                    sink.write(chunk)
                else:
                    flat = chunk.data.reshape(-1).view(torch.uint8)
                    if buf.numel() < flat.numel():
                        buf = torch.empty(flat.numel(), dtype=torch.uint8)
                    buf[: flat.numel()].copy_(flat)
            got += 1
        except TimeoutError:
            pass


def start_peer(kind: str, layout: KVLayout | None = None):
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=peer, args=(kind, layout, child), daemon=True)
    proc.start()
    return proc, conn, conn.recv()


# ---------------------------------------------------------------- (a) and (b)
def generate(model, args, streamer_kind: str | None, mode: str | None, store: Path | None = None) -> dict:
    cfg = EngineConfig(block_size=16, num_kv_blocks=args.batch * -(-(args.prompt + args.new) // 16) + 8, scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=2048, prefill_chunk_size=2048))
    engine = LLMEngine(model, None, cfg)
    streamer = proc = conn = None
    hook_s = 0.0
    if streamer_kind == "tcp":
        proc, conn, address = start_peer("kv-tcp", engine.kv_cache.layout)
        sender = TcpSender(address, window=64, timeout=60)
    elif streamer_kind == "disk":
        sender = FileSender(store)
    if streamer_kind:
        streamer = KVStreamer(engine.kv_cache, OutStream(sender), StreamerConfig(mode=mode, timeout=60))
        attach(engine, streamer)
        inner = engine.runner.hook

        def timed(layer, batch):
            nonlocal hook_s
            t = time.perf_counter()
            inner(layer, batch)
            hook_s += time.perf_counter() - t

        engine.runner.hook = timed
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(torch.randint(10, model.cfg.vocab_size, (args.prompt,), generator=g).tolist(), params, request_id=f"r{i}")
    tokens = {}
    start = time.perf_counter()
    first = None
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] = o.token_ids
        first = first or time.perf_counter()
    if streamer:
        streamer.finish()
    total = time.perf_counter() - start
    out = {"transport": streamer_kind or "off", "mode": mode or "-", "total_s": total, "prefill_s": first - start, "decode_s": total - (first - start), "hook_s": hook_s}
    if streamer:
        out.update(chunks=streamer.out.chunks_sent, mbytes=streamer.out.bytes_sent / 1e6)
        streamer.close()
        if conn is not None:
            conn.send(streamer.out.chunks_sent)
            assert conn.recv() == "done"  # the peer has written every chunk into its cache
            conn.send(None)
            proc.join(10)
        sender.close()
    out["tokens"] = tokens
    return out


# ---------------------------------------------------------------- (c)
def bandwidth(sizes: list[int], total_bytes: int, tmp: Path) -> list[dict]:
    rows = []
    procs = {k: start_peer(k) for k in ("tcp", "shm", "raw-zmq")}
    try:
        import zmq

        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(procs["raw-zmq"][2])
        tcp = OutStream(TcpSender(procs["tcp"][2], window=16, timeout=60))
        shm = OutStream(ShmSender(procs["shm"][2], slots=4, slot_bytes=max(sizes), timeout=60))
        for size in sizes:
            n = max(4, total_bytes // size)
            tokens = size // (2 * 192 * 4)
            x = torch.randn(1, 2, tokens, 3, 64)
            nbytes = x.numel() * 4
            desc = ChunkDesc((Segment("r", 0, tokens),), 0, 1)

            def timed(send, kind):
                conn = procs[kind][1]
                t = time.perf_counter()
                conn.send(n)
                for _ in range(n):
                    send()
                assert conn.recv() == "done"
                return n * nbytes / (time.perf_counter() - t) / 1e9

            view = x.numpy().tobytes()
            r = {"chunk_bytes": nbytes, "count": n}
            r["raw_zmq_GBps"] = timed(lambda: raw.send(view, copy=False), "raw-zmq")
            r["tcp_GBps"] = timed(lambda: flush(tcp, desc, x), "tcp")
            r["shm_GBps"] = timed(lambda: flush(shm, desc, x), "shm")
            y = torch.empty_like(x)
            t = time.perf_counter()
            for _ in range(n):
                y.copy_(x)
            r["raw_memcpy_GBps"] = n * nbytes / (time.perf_counter() - t) / 1e9
            d = tmp / f"bw-{nbytes}"
            fs = OutStream(FileSender(d))
            t = time.perf_counter()
            for _ in range(n):
                flush(fs, desc, x)
            r["file_write_GBps"] = n * nbytes / (time.perf_counter() - t) / 1e9
            t = time.perf_counter()
            inp = InStream(FileReceiver(d))
            for _ in range(n):
                with fetch(inp, 5) as c:
                    y.view(-1).copy_(c.data.reshape(-1))
            r["file_read_GBps"] = n * nbytes / (time.perf_counter() - t) / 1e9
            t = time.perf_counter()
            for i in range(n):
                with open(d / f"raw{i}", "wb", buffering=0) as f:
                    f.write(view)
            r["raw_file_write_GBps"] = n * nbytes / (time.perf_counter() - t) / 1e9
            rows.append(r)
        tcp.sender.close()
        shm.sender.close()
        raw.close(0)
    finally:
        for proc, conn, _ in procs.values():
            conn.send(None)
            proc.join(10)
    return rows


# ---------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=500)
    ap.add_argument("--new", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bw-mbytes", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(exist_ok=True)
    ck = load_checkpoint(None)
    model = LlamaModel.from_state_dict(ck.config, ck.state_dict)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        warm = argparse.Namespace(**{**vars(args), "prompt": 16, "new": 4})
        generate(model, warm, None, None)  # warm-up: allocator, kernels
        plan = [(None, None), ("tcp", "naive"), ("tcp", "buffered"), ("tcp", "overlap"), ("disk", "buffered"), ("disk", "overlap"), (None, None)]
        for i, (kind, mode) in enumerate(plan):
            r = generate(model, args, kind, mode, tmp / f"store{i}")
            runs.append(r)
            print(f"  {r['transport']:>4} {r['mode']:>8}: {r['total_s']:.2f}s (on-thread streaming {r['hook_s']:.3f}s)", flush=True)
        ref = runs[0].pop("tokens")
        for r in runs[1:]:
            assert r.pop("tokens") == ref, f"streaming changed the tokens ({r['transport']}/{r['mode']})"
        bw = bandwidth([64 << 10, 1 << 20, 16 << 20], args.bw_mbytes << 20, tmp)
    off = min(runs[0]["total_s"], runs[-1]["total_s"])
    for r in runs:
        r["slowdown_pct"] = 100 * (r["total_s"] - off) / off
    by = {(r["transport"], r["mode"]): r for r in runs[1:-1]}
    summary = {
        "buffering_speedup_on_thread": by["tcp", "naive"]["hook_s"] / by["tcp", "buffered"]["hook_s"],
        "overlap_speedup_on_thread": by["tcp", "buffered"]["hook_s"] / by["tcp", "overlap"]["hook_s"],
        "buffering_speedup_end_to_end": by["tcp", "naive"]["total_s"] / by["tcp", "buffered"]["total_s"],
        "overlap_speedup_end_to_end": by["tcp", "buffered"]["total_s"] / by["tcp", "overlap"]["total_s"],
        "slowdown_pct_tcp_overlap": by["tcp", "overlap"]["slowdown_pct"],
        "slowdown_pct_disk_overlap": by["disk", "overlap"]["slowdown_pct"],
        "off_run_spread_pct": 100 * abs(runs[0]["total_s"] - runs[-1]["total_s"]) / off,
    }
    print(f"\nbatch {args.batch}, prompt {args.prompt}, new {args.new}, SmolLM2-135M fp32 on CPU ({args.threads} thread(s))")
    print(f"{'transport':>9} {'mode':>9} {'total s':>8} {'slowdown':>9} {'on-thread s':>12} {'chunks':>8} {'MB':>8}")
    for r in runs:
        print(f"{r['transport']:>9} {r['mode']:>9} {r['total_s']:8.2f} {r['slowdown_pct']:8.1f}% {r['hook_s']:12.3f} {r.get('chunks', 0):8d} {r.get('mbytes', 0):8.1f}")
    print("\nbandwidth GB/s")
    print(f"{'chunk':>9} {'raw zmq':>8} {'tcp':>7} {'memcpy':>7} {'shm':>7} {'raw write':>9} {'file write':>10} {'file read':>9}")
    for r in bw:
        print(f"{r['chunk_bytes']:>9} {r['raw_zmq_GBps']:8.2f} {r['tcp_GBps']:7.2f} {r['raw_memcpy_GBps']:7.2f} {r['shm_GBps']:7.2f} {r['raw_file_write_GBps']:9.2f} {r['file_write_GBps']:10.2f} {r['file_read_GBps']:9.2f}")
    print("\n" + "\n".join(f"{k}: {v:.2f}" for k, v in summary.items()))
    data = {"args": vars(args), "cpu_count": os.cpu_count(), "runs": runs, "bandwidth": bw, "summary": summary}
    (RESULTS / "streaming.json").write_text(json.dumps(data, indent=2))
    plot(runs, bw, RESULTS / "streaming.png")


def plot(runs: list[dict], bw: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    tcp = [r for r in runs if r["transport"] == "tcp"]
    ax[0].bar([r["mode"] for r in tcp], [r["hook_s"] for r in tcp], color=["#c44", "#48c", "#4a4"])
    ax[0].set_yscale("log")
    ax[0].set_title("(a) streaming time on the compute thread (TCP)")
    ax[0].set_ylabel("seconds (log)")
    labels = [f"{r['transport']}\n{r['mode']}" for r in runs]
    ax[1].bar(range(len(runs)), [r["slowdown_pct"] for r in runs], tick_label=labels)
    ax[1].axhline(2, color="k", ls="--", lw=1, label="2% target")
    ax[1].set_title("(b) end-to-end slowdown vs streaming off")
    ax[1].set_ylabel("%")
    ax[1].legend()
    x = range(len(bw))
    for j, (key, name) in enumerate([("raw_zmq_GBps", "raw zmq"), ("tcp_GBps", "tcp chunks"), ("raw_memcpy_GBps", "memcpy"), ("shm_GBps", "shm chunks"), ("raw_file_write_GBps", "raw file write"), ("file_write_GBps", "file chunks")]):
        ax[2].bar([i + j * 0.13 for i in x], [r[key] for r in bw], width=0.13, label=name)
    ax[2].set_xticks([i + 0.33 for i in x], [f"{r['chunk_bytes'] >> 10} KiB" for r in bw])
    ax[2].set_title("(c) bandwidth vs raw")
    ax[2].set_ylabel("GB/s")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
