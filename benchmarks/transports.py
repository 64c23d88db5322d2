"""Transport bandwidth against the raw wire each one is built on, at 64 KB, 1 MB, 4 MB and 16 MB chunks.

  tcp        flush() through TcpSender to a TcpReceiver in another process that fetch()es
             (MAC, header and checksum verified) and releases every chunk
  raw zmq    the same bytes through a plain ZeroMQ PUSH -> PULL pair (no header, no check, no
             acknowledgement), the faster of copy=False and copy=True sends
  raw sock   the same bytes through a plain TCP socket: sendall() from the tensor, recv_into() one
             reused buffer (the wire TcpSender/TcpReceiver are built on)
  shm        flush() through ShmSender (payload copied into a slot of the mapped segment) to a
             ShmReceiver in another process that fetch()es and releases every chunk
  shm rsv    the zero-copy staging path scatter() uses: pack into `reserve()`d slot memory, then
             flush (the packing is timed: it is the copy memcpy measures)
  tcp batch / shm batch   flush_many() of BATCH chunks per call to a receiver that fetch_many()es
             (same checks per chunk): the per-chunk Python and system calls shared by a batch
  memcpy     the same bytes copied into one slot of a mapped shared-memory segment, nothing else
  memcpy+xxh3  that copy plus the checksum of the slot: what a checked shm send cannot go below
  memcpy+msg   that copy plus one small message per chunk over a Unix socket to another process
             (no acknowledgement): the least an unchecked shm send cost when every chunk sent a
             control message (before descriptors and acknowledgements moved into the segment)
  file       flush() through FileSender (one file per chunk, temp name + rename)
  raw write  os.open / os.write / os.close of one file per chunk
  tcp / shm / file unchecked   the same transports with the payload checksum replaced by a constant
             in both processes (header and MAC still checked): the difference is what checking costs
  xxh3       the payload checksum alone

All variants of a round run in one process, in a shuffled order, for each chunk size; the table
shows medians over rounds of GB/s and of each transport's ratio to its raw counterpart in the same
round. Timed from the first send to the receiver's last release (network and shm) or the last
close (files). One thread everywhere. Each process's CPU seconds are recorded too (`cpu_us` per
chunk, sender + receiver, and `cpu_us_rx`, the receiver's share): on a loaded machine they move
less than wall time.

    python benchmarks/transports.py [--mbytes 128 --rounds 7 --sizes 64K,1M,4M,16M]

Writes results/transports.json and results/transports.png.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import socket
import statistics
import tempfile
import time
import uuid
from multiprocessing import shared_memory
from pathlib import Path

import torch
import xxhash

from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter
from kvflow.streaming.chunk import ChunkDesc, Segment, tensor_bytes
from kvflow.streaming.primitives import InStream, OutStream, fetch, flush

try:  # the batch API (absent from older trees this script is run against for before/after tables)
    from kvflow.streaming.primitives import fetch_many, flush_many
except ImportError:
    fetch_many = flush_many = None
from kvflow.streaming.transports import FileSender, ShmReceiver, ShmSender, TcpReceiver, TcpSender

RESULTS = Path(__file__).resolve().parents[1] / "results"
SECRET = b"transport-benchmark-secret"
SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]
SLOTS = 4
BATCH = 32  # chunks per flush_many in the batch variants
PAIRS = [("tcp", "raw_zmq"), ("tcp", "raw_sock"), ("tcp_batch", "raw_zmq"), ("shm", "memcpy"), ("shm_rsv", "memcpy"), ("shm_batch", "memcpy"),
         ("shm", "memcpy_xxh3"), ("shm", "memcpy_msg"), ("file", "raw_write")]
CHECKED = {"tcp": "raw_zmq", "shm": "memcpy", "file": "raw_write"}  # transports timed unchecked too


# ---------------------------------------------------------------- receiving processes
def _usage() -> tuple[float, int]:
    """CPU seconds and minor page faults of this process so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_minflt


def _since(start: tuple[float, int]) -> tuple[float, int]:
    now = _usage()
    return now[0] - start[0], now[1] - start[1]


def peer(kind: str, conn) -> None:
    """Receive `n` chunks each time the parent sends n (None: exit), then answer the CPU seconds
    and minor page faults that took."""
    torch.set_num_threads(1)
    if kind == "raw_zmq":
        import zmq

        sock = zmq.Context.instance().socket(zmq.PULL)
        conn.send(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
        while (n := conn.recv()) is not None:
            c = _usage()
            for _ in range(n):
                sock.recv(copy=False)
            conn.send(_since(c))
        return
    if kind == "raw_sock":
        listener = socket.create_server(("127.0.0.1", 0))
        conn.send(f"127.0.0.1:{listener.getsockname()[1]}")
        sock, _ = listener.accept()
        while (msg := conn.recv()) is not None:
            n, size = msg
            buf = memoryview(bytearray(size))
            c = _usage()
            for _ in range(n):
                got = 0
                while got < size:
                    got += sock.recv_into(buf[got:], size - got)
            conn.send(_since(c))
        return
    if kind == "raw_msg":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        name = f"kvflow-bench-{uuid.uuid4().hex}"
        listener.bind("\0" + name)
        listener.listen(1)
        conn.send(name)
        sock, _ = listener.accept()
        while (n := conn.recv()) is not None:
            c = _usage()
            for _ in range(n):
                sock.recv(256)
            conn.send(_since(c))
        return
    if kind.endswith("_unchecked"):
        _no_checksum()
    rx = TcpReceiver() if kind.startswith("tcp") else ShmReceiver()
    conn.send(rx.address)
    inp = InStream(rx, secret=SECRET)
    while (n := conn.recv()) is not None:
        c = _usage()
        if kind.endswith("_batch"):
            while n > 0:
                for chunk in fetch_many(inp, min(n, 2 * BATCH), 60):
                    chunk.release()
                    n -= 1
        for _ in range(n):
            fetch(inp, 60).release()
        if hasattr(rx, "flush_acks"):
            rx.flush_acks()  # held-back acks out before the answer (shared memory acknowledges each release at once)
        conn.send(_since(c))
    rx.close()


def _no_checksum():
    """For the unchecked variants only: every payload 'hashes' to 0 on both sides."""
    import kvflow.streaming.chunk as chunk

    saved = chunk.checksum
    chunk.checksum = lambda payload: 0
    return saved


def start_peer(kind: str):
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=peer, args=(kind, child), daemon=True)
    proc.start()
    return proc, conn, conn.recv()


# ---------------------------------------------------------------- one round at one chunk size
class Bench:
    def __init__(self, tmp: Path) -> None:
        import zmq

        self.tmp = tmp
        kinds = ["raw_zmq", "raw_sock", "raw_msg", "tcp", "shm", "tcp_unchecked", "shm_unchecked"] + (["tcp_batch", "shm_batch"] if flush_many else [])
        self.peers = {k: start_peer(k) for k in kinds}
        self.raw = zmq.Context.instance().socket(zmq.PUSH)
        self.raw.connect(self.peers["raw_zmq"][2])
        host, port = self.peers["raw_sock"][2].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.msg = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.msg.connect("\0" + self.peers["raw_msg"][2])
        self.tcp = OutStream(TcpSender(self.peers["tcp"][2], timeout=60), "bench-tcp", SECRET)
        self.shm = OutStream(ShmSender(self.peers["shm"][2], slots=SLOTS, slot_bytes=max(SIZES), timeout=60), "bench-shm", SECRET)
        self.tcp_u = OutStream(TcpSender(self.peers["tcp_unchecked"][2], timeout=60), "bench-tcp-u", SECRET)
        self.shm_u = OutStream(ShmSender(self.peers["shm_unchecked"][2], slots=SLOTS, slot_bytes=max(SIZES), timeout=60), "bench-shm-u", SECRET)
        self.batched = {}
        if flush_many:
            self.batched = {"tcp_batch": OutStream(TcpSender(self.peers["tcp_batch"][2], timeout=60), "bench-tcp-b", SECRET),
                            "shm_batch": OutStream(ShmSender(self.peers["shm_batch"][2], slots=SLOTS, slot_bytes=max(SIZES), timeout=60), "bench-shm-b", SECRET)}
        self.seg = shared_memory.SharedMemory(create=True, size=SLOTS * max(SIZES))
        self.file_index = 0

    def close(self) -> None:
        for out in (self.tcp, self.shm, self.tcp_u, self.shm_u, *self.batched.values()):
            out.sender.close()
        self.raw.close(0)
        self.sock.close()
        self.msg.close()
        self.seg.close()
        self.seg.unlink()
        for proc, conn, _ in self.peers.values():
            conn.send(None)
            proc.join(10)

    def _remote(self, kind: str, n: int, send, job=None, calls: int | None = None) -> tuple[float, float, int, float]:
        """(wall seconds, CPU seconds, minor page faults, of both processes; the receiver's CPU
        seconds) to move n chunks to the `kind` peer with `calls` (default n) calls of `send`."""
        conn = self.peers[kind][1]
        t, c = time.perf_counter(), _usage()
        conn.send(n if job is None else job)
        for _ in range(n if calls is None else calls):
            send()
        peer_cpu, peer_faults = conn.recv()
        cpu, faults = _since(c)
        return time.perf_counter() - t, cpu + peer_cpu, faults + peer_faults, peer_cpu

    def _local(self, n: int, op) -> tuple[float, float, int, float]:
        t, c = time.perf_counter(), _usage()
        for i in range(n):
            op(i)
        return (time.perf_counter() - t, *_since(c), 0.0)

    def _dir(self, name: str) -> Path:
        self.file_index += 1
        d = self.tmp / f"{name}-{self.file_index}"
        d.mkdir()
        return d

    def run(self, variant: str, x: torch.Tensor, desc: ChunkDesc, n: int) -> tuple[float, float, int, float]:
        """(wall seconds, CPU seconds, minor page faults, receiver CPU seconds) to move n chunks of
        x with `variant` (batch variants: n rounded up to whole batches)."""
        view = tensor_bytes(x)
        size = view.nbytes
        if variant == "raw_zmq":
            copy = self._remote("raw_zmq", n, lambda: self.raw.send(view, copy=True))
            nocopy = self._remote("raw_zmq", n, lambda: self.raw.send(view, copy=False))
            return min(copy, nocopy)
        if variant == "raw_sock":
            return self._remote("raw_sock", n, lambda: self.sock.sendall(view), job=(n, size))
        if variant == "tcp":
            return self._remote("tcp", n, lambda: flush(self.tcp, desc, x))
        if variant == "shm":
            return self._remote("shm", n, lambda: flush(self.shm, desc, x))
        if variant in ("tcp_batch", "shm_batch"):
            n = -(-n // BATCH) * BATCH
            out, items = self.batched[variant], [(desc, x)] * BATCH
            return self._remote(variant, n, lambda: flush_many(out, items), calls=n // BATCH)
        if variant in ("tcp_unchecked", "shm_unchecked", "file_unchecked"):
            import kvflow.streaming.chunk as chunk

            saved = _no_checksum()
            try:
                if variant == "file_unchecked":
                    return self.run("file", x, desc, n)
                out = self.tcp_u if variant == "tcp_unchecked" else self.shm_u
                return self._remote(variant, n, lambda: flush(out, desc, x))
            finally:
                chunk.checksum = saved
        if variant == "shm_rsv":
            src = x.view(-1).view(torch.uint8)

            def packed():  # the packing is timed: it is what memcpy measures
                room = self.shm.sender.reserve(size)
                room.copy_(src)
                flush(self.shm, desc, room.view(x.dtype).view(x.shape))

            return self._remote("shm", n, packed)
        if variant in ("memcpy", "memcpy_xxh3"):
            slot = self.seg.buf[:size]
            if variant == "memcpy":
                t = self._local(n, lambda i: slot.__setitem__(slice(None), view))
            else:
                t = self._local(n, lambda i: (slot.__setitem__(slice(None), view), xxhash.xxh3_64_intdigest(slot)))
            slot.release()
            return t
        if variant == "memcpy_msg":
            slot = self.seg.buf[:size]
            note = bytes(24)

            def copy_and_tell():
                slot[:] = view
                self.msg.send(note)

            t = self._remote("raw_msg", n, copy_and_tell)
            slot.release()
            return t
        if variant == "xxh3":
            return self._local(n, lambda i: xxhash.xxh3_64_intdigest(view))
        if variant == "file":
            d = self._dir("ours")
            out = OutStream(FileSender(d), "bench-file", SECRET)
            t = self._local(n, lambda i: flush(out, desc, x))
            shutil.rmtree(d)
            return t
        if variant == "raw_write":
            d = self._dir("raw")

            def write(i):
                fd = os.open(os.path.join(d, f"{i:012d}.raw"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(fd, view)
                os.close(fd)

            t = self._local(n, write)
            shutil.rmtree(d)
            return t
        raise ValueError(variant)


VARIANTS = ["raw_zmq", "raw_sock", "tcp", "tcp_unchecked", "tcp_batch", "memcpy", "memcpy_xxh3", "memcpy_msg", "shm", "shm_rsv", "shm_unchecked",
            "shm_batch", "raw_write", "file", "file_unchecked", "xxh3"]
if flush_many is None:
    VARIANTS = [v for v in VARIANTS if not v.endswith("_batch")]
    PAIRS = [p for p in PAIRS if not p[0].endswith("_batch")]


def measure(args) -> list[dict]:
    rounds: list[dict] = []
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        bench = Bench(Path(tmp))
        try:
            for r in range(args.rounds + 1):  # round 0 warms up (connections, page cache, allocators)
                for size in args.sizes:
                    tokens = size // (2 * 192 * 4)
                    x = torch.randn(1, 2, tokens, 3, 64)
                    desc = ChunkDesc((Segment("r", 0, tokens),), 0, 1)
                    n = max(8, (args.mbytes << 20) // size)
                    order = VARIANTS[:]
                    rng.shuffle(order)
                    row = {"round": r, "chunk_bytes": size, "count": n, "cpu_us": {}, "cpu_us_rx": {}, "faults": {}}
                    for v in order:
                        wall, cpu, faults, rx_cpu = bench.run(v, x, desc, n)
                        m = -(-n // BATCH) * BATCH if v.endswith("_batch") else n
                        row[v] = m * size / wall / 1e9
                        row["cpu_us"][v] = cpu / m * 1e6
                        row["cpu_us_rx"][v] = rx_cpu / m * 1e6
                        row["faults"][v] = faults / m
                    if r:
                        rounds.append(row)
                        print(f"  round {r} {_kb(size):>6}: " + " ".join(f"{v} {row[v]:.2f}" for v in VARIANTS), flush=True)
        finally:
            bench.close()
    return rounds


def summarize(rounds: list[dict], sizes: list[int]) -> list[dict]:
    rows = []
    for size in sizes:
        rs = [r for r in rounds if r["chunk_bytes"] == size]
        row = {"chunk_bytes": size, **{f"{v}_GBps": statistics.median(r[v] for r in rs) for v in VARIANTS}}
        row["cpu_us_per_chunk"] = {v: statistics.median(r["cpu_us"][v] for r in rs) for v in VARIANTS}
        row["rx_cpu_us_per_chunk"] = {v: statistics.median(r["cpu_us_rx"][v] for r in rs) for v in VARIANTS}
        row["faults_per_chunk"] = {v: statistics.median(r["faults"][v] for r in rs) for v in VARIANTS}
        for ours, raw in PAIRS:
            row[f"{ours}_pct_of_{raw}"] = 100 * statistics.median(r[ours] / r[raw] for r in rs)
        for t, raw in CHECKED.items():  # share of a chunk's time that checking takes: 1 - t_unchecked / t_checked
            row[f"checking_cost_{t}_pct"] = 100 * statistics.median(1 - r[t] / r[f"{t}_unchecked"] for r in rs)
            row[f"{t}_unchecked_pct_of_{raw}"] = 100 * statistics.median(r[f"{t}_unchecked"] / r[raw] for r in rs)
        rows.append(row)
    return rows


def _kb(size: int) -> str:
    return f"{size >> 10} KB" if size < 1 << 20 else f"{size >> 20} MB"


def print_table(rows: list[dict]) -> None:
    batched = "tcp_batch" in VARIANTS
    print("\nGB/s (median over rounds); (%) = median of the per-round ratios to the raw counterpart")
    print(f"{'chunk':>6} | {'raw zmq':>7} {'raw sock':>8} {'tcp':>12}" + (f" {'tcp batch':>12}" if batched else "")
          + f" | {'memcpy':>6} {'shm':>12} {'shm rsv':>12}" + (f" {'shm batch':>12}" if batched else "")
          + f" {'cp+xxh3':>12} {'cp+msg':>12} | {'raw write':>9} {'file':>12} | {'xxh3':>5}")
    for r in rows:
        cell = lambda v, raw: f"{r[v + '_GBps']:5.2f} ({r[f'{v}_pct_of_{raw}']:3.0f}%)"
        rel = lambda v: f"{r[v + '_GBps']:5.2f} ({100 * r[v + '_GBps'] / r['memcpy_GBps']:3.0f}%)"
        print(
            f"{_kb(r['chunk_bytes']):>6} | {r['raw_zmq_GBps']:7.2f} {r['raw_sock_GBps']:8.2f} {cell('tcp', 'raw_zmq'):>12}" + (f" {cell('tcp_batch', 'raw_zmq'):>12}" if batched else "")
            + f" | {r['memcpy_GBps']:6.2f} {cell('shm', 'memcpy'):>12} {cell('shm_rsv', 'memcpy'):>12}" + (f" {cell('shm_batch', 'memcpy'):>12}" if batched else "")
            + f" {rel('memcpy_xxh3'):>12} {rel('memcpy_msg'):>12} | {r['raw_write_GBps']:9.2f} {cell('file', 'raw_write'):>12} | {r['xxh3_GBps']:5.1f}"
        )
    print("tcp vs the raw socket it is built on: " + ", ".join(f"{_kb(r['chunk_bytes'])} {r['tcp_pct_of_raw_sock']:.0f}%" for r in rows))
    print("checking (XXH3 of every payload at both ends): the same transports with it replaced by a constant; cost = share of a checked chunk's time")
    print(f"{'chunk':>6} | {'tcp':>5} {'unchecked':>15} {'cost':>5} | {'shm':>5} {'unchecked':>15} {'cost':>5} | {'file':>5} {'unchecked':>15} {'cost':>5}")
    for r in rows:
        cells = []
        for t, raw in CHECKED.items():
            cells.append(f"{r[t + '_GBps']:5.2f} {r[t + '_unchecked_GBps']:5.2f} ({r[f'{t}_unchecked_pct_of_{raw}']:3.0f}% raw) {r[f'checking_cost_{t}_pct']:4.0f}%")
        print(f"{_kb(r['chunk_bytes']):>6} | " + " | ".join(cells))
    show = [v for v in ("raw_zmq", "raw_sock", "tcp", "tcp_batch", "memcpy", "memcpy_xxh3", "shm", "shm_batch", "raw_write", "file") if v in VARIANTS]
    print("CPU microseconds per chunk, sender + receiver (the receiver's share in brackets; median over rounds)")
    print(f"{'chunk':>6} | " + " ".join(f"{v:>15}" for v in show))
    for r in rows:
        cpu, rx = r["cpu_us_per_chunk"], r["rx_cpu_us_per_chunk"]
        print(f"{_kb(r['chunk_bytes']):>6} | " + " ".join(f"{f'{cpu[v]:.1f} ({rx[v]:.1f})':>15}" for v in show))
    print("minor page faults per chunk, sender + receiver (median over rounds)")
    print(f"{'chunk':>6} | " + " ".join(f"{v:>10}" for v in show))
    for r in rows:
        print(f"{_kb(r['chunk_bytes']):>6} | " + " ".join(f"{r['faults_per_chunk'][v]:10.1f}" for v in show))


def _size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text)


def plot(rows: list[dict], path: Path) -> None:
    from kvflow.plotting import pyplot

    plt = pyplot()

    labels = [_kb(r["chunk_bytes"]) for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
    pairs = [("tcp", "raw_zmq", "#48c"), ("tcp_batch", "raw_zmq", "#7ae"), ("tcp", "raw_sock", "#26a"), ("shm", "memcpy", "#c84"), ("shm_rsv", "memcpy", "#a62"),
             ("shm_batch", "memcpy", "#eb7"), ("file", "raw_write", "#4a4")]
    pairs = [p for p in pairs if p[0] in VARIANTS]
    w = 0.8 / len(pairs)
    for i, (ours, raw, c) in enumerate(pairs):
        xs = [j + (i - (len(pairs) - 1) / 2) * w for j in range(len(rows))]
        ax[0].bar(xs, [r[f"{ours}_pct_of_{raw}"] for r in rows], w, color=c, label=f"{ours} / {raw}")
    ax[0].axhline(80, color="k", ls="--", lw=0.8)
    ax[0].axhline(60, color="k", ls=":", lw=0.8)
    ax[0].set_xticks(range(len(rows)), labels)
    ax[0].set_ylabel("% of raw (median of per-round ratios)")
    ax[0].set_title("transport vs its raw counterpart")
    ax[0].legend(fontsize=8)
    for v, c, ls in [("raw_zmq", "#48c", "--"), ("raw_sock", "#26a", "--"), ("tcp", "#48c", "-"), ("memcpy", "#c84", "--"), ("memcpy_xxh3", "#c84", ":"),
                     ("shm", "#c84", "-"), ("raw_write", "#4a4", "--"), ("file", "#4a4", "-"), ("xxh3", "#888", ":")]:
        ax[1].plot(labels, [r[f"{v}_GBps"] for r in rows], ls, color=c, marker="o", label=v)
    ax[1].set_yscale("log")
    ax[1].set_ylabel("GB/s (log)")
    ax[1].set_title("bandwidth by chunk size")
    ax[1].legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--mbytes", type=int, default=128, help="bytes moved per variant, chunk size and round (MB)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per variant, after one warm-up round")
    ap.add_argument("--sizes", type=lambda t: [_size(x) for x in t.split(",")], default=SIZES, help="chunk sizes, e.g. 64K,1M (default: 64K,1M,4M,16M)")
    ap.add_argument("--tmp", default=None, help="directory for the file variants (default: the system temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "transports.json"), help="JSON output")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds = measure(args)
    rows = summarize(rounds, args.sizes)
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cpu_count": os.cpu_count(), "summary": rows, "rounds": rounds}, indent=2))
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
